"""QuantizedLinear's two paths, the fused/mixed layer factory, and the dtype policy."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.engine_config import EngineConfig
from engine.dtype_choice import choose_dtype
from engine.model.linear import Linear, PartsLinear, make_linear
from engine.quant import QuantizedTensor
from engine.quant import kernels
from engine.quant import linear as quant_linear
from engine.quant.linear import BatchPlanner, QuantizedLinear
from tests.engine.test_quant_kernels import random_blocks, reference_weight

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())


def random_weight(qtype: Q, num_rows: int, num_cols: int,
                  seed: int) -> tuple[QuantizedTensor, torch.Tensor]:
    blocks = random_blocks(qtype, num_rows, num_cols, seed)
    return (QuantizedTensor(torch.from_numpy(blocks), qtype, num_cols),
            reference_weight(blocks, qtype, num_cols))


def assert_rows_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Each output row within 1e-4 of its norm (16-bit activation rounding, summation order)."""
    relative = (got - expected).norm(dim=1) / expected.norm(dim=1)
    assert float(relative.max()) < 1e-4


@pytest.mark.parametrize("num_x_rows", [1, 5, 40])
def test_both_paths_compute_x_times_w_transposed(num_x_rows: int, monkeypatch) -> None:
    monkeypatch.setattr(quant_linear, "SCRATCH_ELEMENTS", 64 * 256)   # force several slabs
    weight, dense = random_weight(Q.Q4_1, 200, 256, seed=2)
    x = torch.randn(num_x_rows, 256)
    expected = x @ dense.T
    for block_rows in (1 << 20, 0):                        # all block kernel / all GEMM
        layer = QuantizedLinear(weight, BatchPlanner(fixed_block_rows=block_rows))
        assert_rows_close(layer(x), expected)


def test_no_rows_give_an_empty_output_without_dequantizing(monkeypatch) -> None:
    """A pass with no output rows asks the head for none: neither path runs."""
    weight, _ = random_weight(Q.Q8_0, 64, 128, seed=5)
    layer = QuantizedLinear(weight, BatchPlanner(fixed_block_rows=8))

    def refuse(*args: object) -> None:
        raise AssertionError("a path ran for 0 rows")
    monkeypatch.setattr(layer.planner, "dequantized_matmul", refuse)
    monkeypatch.setattr(layer, "block_matmul", refuse)
    out = layer(torch.empty(0, 128))
    assert out.shape == (0, 64) and out.dtype == torch.float32


def test_calibration_picks_a_limit_from_the_ladder() -> None:
    weight, _ = random_weight(Q.Q8_0, 64, 128, seed=4)
    limit = BatchPlanner().block_rows_limit(weight)
    assert limit == 1 or limit in quant_linear.CALIBRATION_LADDER


def test_calibration_keeps_no_dequantization_scratch() -> None:
    planner = BatchPlanner()
    planner.block_rows_limit(random_weight(Q.Q8_0, 64, 128, seed=4)[0])
    assert planner.scratch.numel() == 0          # measured through it, then let go
    weight, reference = random_weight(Q.Q8_0, 64, 128, seed=5)
    x = torch.randn(3, 128)
    assert_rows_close(planner.dequantized_matmul(x, weight), x @ reference.T)


def rounds_of(rounds_by_rows: dict[int, list[tuple[float, float]]]):
    """A time_pair for crossover_limit that replays given rounds per M (block faster by
    default), recording how many rounds each M was timed."""
    asked: dict[int, int] = {}

    def time_pair(num_x_rows: int) -> tuple[float, float]:
        asked[num_x_rows] = asked.get(num_x_rows, 0) + 1
        rounds = rounds_by_rows.get(num_x_rows, [])
        return rounds[asked[num_x_rows] - 1] if asked[num_x_rows] <= len(rounds) else (1.0, 2.0)
    return time_pair, asked


def test_one_disturbed_round_does_not_cut_the_limit() -> None:
    time_pair, asked = rounds_of({16: [(5.0, 2.0), (1.0, 2.0)]})   # 16: a slow first round
    assert quant_linear.crossover_limit(time_pair) == quant_linear.CALIBRATION_LADDER[-1]
    assert asked[16] == 2 and asked[8] == 1


def test_a_loss_that_holds_ends_the_ladder() -> None:
    losing = [(3.0, 2.0)] * quant_linear.CALIBRATION_ROUNDS
    time_pair, asked = rounds_of({32: losing, 64: [(1.0, 2.0)]})
    assert quant_linear.crossover_limit(time_pair) == 16
    assert asked[32] == quant_linear.CALIBRATION_ROUNDS and 64 not in asked
    time_pair, _ = rounds_of({quant_linear.CALIBRATION_LADDER[0]: losing})
    assert quant_linear.crossover_limit(time_pair) == 1


def test_rounds_are_judged_on_the_best_times_so_far() -> None:
    # round 2 alone shows the block kernel faster (1.2 < 1.5), but the GEMM's best (1.0, round 1)
    # is faster than the block kernel's best in every round: the loss holds
    time_pair, asked = rounds_of({8: [(2.0, 1.0), (1.2, 1.5), (1.1, 1.5)]})
    assert quant_linear.crossover_limit(time_pair) == 4
    assert asked[8] == 3


def test_one_type_fuses_and_a_mix_concatenates() -> None:
    q4, q4_dense = random_weight(Q.Q4_0, 32, 256, seed=5)
    q8, q8_dense = random_weight(Q.Q8_0, 16, 256, seed=6)
    planner = BatchPlanner(fixed_block_rows=8)
    x = torch.randn(3, 256)
    fused = make_linear([q4, q4], allow_int4=False, planner=planner)
    assert isinstance(fused, QuantizedLinear) and fused.weight.num_rows == 64
    mixed = make_linear([q4, q8, q8_dense], allow_int4=False, planner=planner)
    assert isinstance(mixed, PartsLinear)
    expected = x @ torch.cat([q4_dense, q8_dense, q8_dense]).T
    assert_rows_close(mixed(x), expected)
    assert isinstance(make_linear([q8_dense], allow_int4=False, planner=None), Linear)


def test_auto_keeps_blocks_on_the_cpu_and_quantized_refuses_cuda() -> None:
    choice = choose_dtype("auto", torch.device("cpu"))
    assert choice.keep_quantized and choice.dtype == torch.float32
    assert not choose_dtype("float32", torch.device("cpu")).keep_quantized
    with pytest.raises(ValueError, match="CPU only"):
        choose_dtype("quantized", torch.device("cuda"))
    assert EngineConfig(dtype="quantized").dtype == "quantized"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="int4")


def test_the_kv_cache_is_float16_on_the_block_kernels_unless_asked_otherwise() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_dtype("auto", cpu).kv_cache_dtype == torch.float16
    assert choose_dtype("quantized", cpu).kv_cache_dtype == torch.float16
    assert choose_dtype("float32", cpu).kv_cache_dtype == torch.float32     # exact mode stays exact
    assert choose_dtype("bfloat16", cpu).kv_cache_dtype == torch.bfloat16
    assert choose_dtype("auto", cuda).kv_cache_dtype == torch.bfloat16
    asked = choose_dtype("auto", cpu, "float32")
    assert asked.keep_quantized and asked.kv_cache_dtype == torch.float32
    assert "kv_dtype float32 asked for" in asked.reason
    assert choose_dtype("float32", cpu, "float16").kv_cache_dtype == torch.float16
    with pytest.raises(ValueError, match="kv_dtype 'float16' is for the CPU"):
        choose_dtype("auto", cuda, "float16")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int8")
