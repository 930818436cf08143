"""8-bit activations on the interleaved Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 layout (engine/quant/
interleaved_act8*.c): the vpdpbusd kernels equal the portable reference bit for bit at every level
the machine has, the reference equals an independent float64 computation of the same quants, the
choice between 8 and 16 bits is made per shape and row count, the fused decoder stays within the
8-bit rounding of its 16-bit self, and the default model within a measured distance of the float32
model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.quant import QuantizedTensor, kernels
from engine.quant.decoder import FusedDecoder, projection_act8_rows
from engine.quant.linear import ACT8_MEASURE_ROWS, ANY_ROWS, BatchPlanner
from tests.engine.test_adapters_fused import tiny_adapters, tiny_gguf  # noqa: F401 (fixtures)
from tests.engine.test_quant_kernels import random_blocks, reference_weight

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())

QTYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
ACT8_LEVELS = [level for level in kernels.levels() if level in kernels.ACT8_LEVELS]
# The float32 result against float64 sums of the same quants: the kernel's float steps (one
# product and sum per block of 32) round at float32's 6e-8; over a row of 24 blocks, 1e-6 of the
# row's norm holds them with room.
FLOAT_ROUNDING = 1e-6
# Against x @ W^T in float32: each activation moves by at most half a step, max |x| / 254 of its
# block, ~0.3% of a Gaussian block's values on average; measured 0.4-1.0% of the row's norm
# (random weights, Gaussian x), bounded at 2%.
ACT8_ROUNDING = 2e-2


def interleaved(qtype: Q, num_rows: int, num_cols: int, seed: int):
    blocks = random_blocks(qtype, num_rows, num_cols, seed)
    weight = kernels.interleave(QuantizedTensor(torch.from_numpy(blocks), qtype, num_cols))
    return weight, reference_weight(blocks, qtype, num_cols)


def quantized_8bit(x: torch.Tensor) -> torch.Tensor:
    """x with each block of 32 rounded to its 8-bit quants (formats.h act_q8), as float64: d =
    max |x| / 127 in float32, q = round-half-even(x / d), clamped to +-127."""
    blocks = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(np.clip(blocks * inverse, -127, 127))
    return torch.from_numpy((q * d.astype(np.float64)).reshape(x.shape))


@pytest.mark.parametrize("level", ACT8_LEVELS)
@pytest.mark.parametrize("num_x_rows", [1, 2, 4, 5, 8, 9, 13])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_every_level_equals_the_reference_bit_for_bit(qtype: Q, num_x_rows: int, level: str) -> None:
    weight, reference = interleaved(qtype, 104, 768, seed=num_x_rows)    # 13 groups: one odd
    x = torch.randn(num_x_rows, 768, generator=torch.Generator().manual_seed(num_x_rows))
    expected = kernels.matmul(x, weight, level="scalar", num_threads=1, act_bits=8)
    for num_threads in (1, 3):
        got = kernels.matmul(x, weight, level=level, num_threads=num_threads, act_bits=8)
        assert torch.equal(got, expected)
    exact = quantized_8bit(x) @ reference.double().T                     # float64 sums
    assert float(((expected - exact).norm(dim=1) / exact.norm(dim=1)).max()) < FLOAT_ROUNDING
    relative = (expected - x @ reference.T).norm(dim=1) / (x @ reference.T).norm(dim=1)
    assert float(relative.max()) < ACT8_ROUNDING


@pytest.mark.parametrize("level", ACT8_LEVELS)
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_extreme_blocks_stay_exact(qtype: Q, level: str) -> None:
    """Zero blocks (d = 0), one huge value among tiny ones, and +-max in every lane: the integer
    sums stay exact (Q8_0's offset and weight-sum correction included)."""
    weight, reference = interleaved(qtype, 32, 128, seed=7)
    x = torch.zeros(6, 128)
    x[1, 32:64] = 1e-30
    x[1, 40] = 3e4
    x[2] = 1.0
    x[3] = -1.0
    x[4, ::2], x[4, 1::2] = 5.0, -5.0
    x[5] = torch.linspace(-7, 7, 128)
    got = kernels.matmul(x, weight, level=level, num_threads=1, act_bits=8)
    assert torch.isfinite(got).all() and torch.equal(got[0], torch.zeros(32))
    exact = quantized_8bit(x) @ reference.double().T
    assert float((got - exact).abs().max()) <= FLOAT_ROUNDING * float(exact.abs().max())


def test_refusals_name_the_cause() -> None:
    weight, _ = interleaved(Q.Q4_1, 16, 64, seed=1)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="act_bits 12"):
        kernels.matmul(x, weight, act_bits=12)
    rows = QuantizedTensor(torch.from_numpy(random_blocks(Q.Q4_1, 16, 64, 1)), Q.Q4_1, 64)
    assert not kernels.act8_supported(rows)
    with pytest.raises(ValueError, match="8-bit activations need an interleaved"):
        kernels.matmul(x, rows, level="scalar", act_bits=8)
    if "avx2" in kernels.levels():
        with pytest.raises(ValueError, match="8-bit activations need an interleaved"):
            kernels.matmul(x, weight, level="avx2", act_bits=8)
    with pytest.raises(ValueError, match="8-bit activations from 1 rows"):
        kernels.PreparedMatmul(rows, act8_min_rows=1)


@pytest.mark.skipif("avx512-vnni" not in kernels.levels(), reason="no 8-bit kernels but the reference")
def test_a_prepared_matmul_switches_width_at_its_row_count() -> None:
    weight, _ = interleaved(Q.Q8_0, 64, 256, seed=2)
    prepared = kernels.PreparedMatmul(weight, act8_min_rows=4)
    for num_x_rows, act_bits in ((3, 16), (4, 8), (9, 8)):
        x = torch.randn(num_x_rows, 256)
        assert torch.equal(prepared(x, 1), kernels.matmul(x, weight, num_threads=1,
                                                          act_bits=act_bits))


def test_the_choice_is_one_for_every_batch_size(monkeypatch) -> None:
    """8 bits in every batch or in none (timed once, at ACT8_MEASURE_ROWS): a choice by size
    would make a request's output depend on its batch."""
    weight, _ = interleaved(Q.Q4_1, 64, 256, seed=3)
    monkeypatch.setattr("engine.quant.linear.kernels.act8_supported", lambda weight: True)
    monkeypatch.setattr("engine.quant.linear.kernels.best_level", lambda: "avx512-vnni")
    for eight_wins, expected in ((True, 1), (False, 0)):
        timed_rows = []
        monkeypatch.setattr("engine.quant.linear._first_holds",
                            lambda time_pair, rows: timed_rows.append(rows) or eight_wins)
        planner = BatchPlanner()
        assert planner.act8_min_rows(weight) == expected
        assert timed_rows == [ACT8_MEASURE_ROWS]
        if expected:      # a weight on 8 bits never takes the GEMM path, at any batch size
            assert planner.block_rows_limit(weight) == ANY_ROWS


def test_the_planner_measures_per_shape_and_not_without_kernels() -> None:
    planner = BatchPlanner()
    weight, _ = interleaved(Q.Q4_1, 64, 256, seed=3)
    rows = QuantizedTensor(torch.from_numpy(random_blocks(Q.Q4_1, 64, 256, 3)), Q.Q4_1, 256)
    assert planner.act8_min_rows(rows) == 0
    threshold = planner.act8_min_rows(weight)
    assert threshold in (0, 1)
    if "avx512-vnni" not in kernels.levels():
        assert threshold == 0
    fixed = BatchPlanner(fixed_block_rows=8, fixed_act8_rows=5)
    assert fixed.act8_min_rows(weight) == (5 if kernels.best_level() == "avx512-vnni" else 0)
    off = BatchPlanner(fixed_block_rows=8, fixed_act8_rows=5, act8=False)   # EngineConfig.act8
    assert off.act8_min_rows(weight) == 0
    assert off.activation_summary() == "activations in 16-bit blocks"


def test_engine_config_act8_takes_a_bool_only() -> None:
    assert EngineConfig(act8=False).act8 is False
    with pytest.raises(ValueError, match="act8 must be true or false, got 'no'"):
        EngineConfig(act8="no")


def test_a_projection_of_two_layouts_stays_16_bit() -> None:
    q4, _ = interleaved(Q.Q4_0, 16, 64, seed=1)
    q8, _ = interleaved(Q.Q8_0, 16, 64, seed=1)
    assert projection_act8_rows((q4, q8), lambda weight: 1) == 0
    assert projection_act8_rows((q4, q4), lambda weight: 2 if weight is q4 else 0) == 2
    assert projection_act8_rows((q8,), lambda weight: 0) == 0
    assert projection_act8_rows((q8,), None) == 0


# The tiny random model's logits, 8-bit O / down against 16-bit, as a share of the largest: 1.5-2.3%
# measured over 4 steps (its random weights amplify a step's rounding more than a trained model's
# do), bounded at 5%.
TINY_MODEL_ACT8_DRIFT = 5e-2
needs_vnni = pytest.mark.skipif("avx512-vnni" not in kernels.levels(),
                                reason="the 8-bit kernels run at avx512-vnni only")


@needs_vnni
def test_fused_decode_in_8_bits_stays_near_16_bits(tmp_path) -> None:
    """The mixed-type tiny model of test_quant_decoder: O and down (Q4_1) run 8-bit, Q/K/V and
    gate/up (parts of two layouts) stay 16-bit. Logits move by the 8-bit rounding only."""
    from tests.engine.test_quant_decoder import (PROMPTS, _types, MIXED_TYPES, decode_logits,
                                                 quantized_engine)
    from tests.engine.gguf_factory import tiny_hf_weights, write_tiny_gguf
    weights = tiny_hf_weights(seed=3)
    path = write_tiny_gguf(tmp_path / "mixed.gguf", weights, matrix_type=Q.Q8_0,
                           types=_types(weights, MIXED_TYPES))
    sixteen = quantized_engine(path, fused=True)
    eight = quantized_engine(path, fused=True)
    fused = eight.model.fused_decoder
    eight.model.fused_decoder = FusedDecoder(fused.shape, fused.layers, fused.max_rows,
                                             act8_min_rows=lambda weight: 1)
    assert {rows for layer in eight.model.fused_decoder.act8_rows for rows in layer} == {0, 1}
    expected, fed = decode_logits(sixteen, PROMPTS, 4, None)
    got, _ = decode_logits(eight, PROMPTS, 4, fed)
    differ = False
    for a, b in zip(got, expected):
        relative = float((a - b).abs().max() / b.abs().max())
        assert relative < TINY_MODEL_ACT8_DRIFT
        differ |= relative > 0
    assert differ                                    # the 8-bit kernels ran


@needs_vnni
def test_the_decoder_refuses_8_bits_where_a_level_lacks_them(tmp_path, monkeypatch) -> None:
    from tests.engine.test_quant_decoder import _types, MIXED_TYPES, quantized_engine
    from tests.engine.gguf_factory import tiny_hf_weights, write_tiny_gguf
    weights = tiny_hf_weights(seed=3)
    path = write_tiny_gguf(tmp_path / "mixed.gguf", weights, matrix_type=Q.Q8_0,
                           types=_types(weights, MIXED_TYPES))
    fused = quantized_engine(path, fused=True).model.fused_decoder
    monkeypatch.setenv(kernels.LEVEL_ENV, "avx2")
    with pytest.raises(ValueError, match="8-bit activations from 1 rows"):
        FusedDecoder(fused.shape, fused.layers, fused.max_rows, act8_min_rows=lambda weight: 1)


# The default model (SmolLM2-135M Q4_1, Q8_0 head) with every weight on 8-bit activations against
# the float32 model, over test_quant_model's prompts and 24 greedy float32 tokens each (191
# positions): measured top-1 the same at 97.9%, logits max |diff| 2.03 and mean 0.198 of logits up
# to ~45 (the 16-bit path: 100%, 0.035 and 0.0027; the same 5 prompts with 48 tokens: 8-bit 97.4%,
# 2.29, 0.208). Bounded at 95%, 4.0 and 0.4; a mean above 0.02 shows the 8-bit kernels ran.
MIN_TOP1_AGREEMENT_8_BIT, MAX_LOGIT_DIFF_8_BIT, MAX_MEAN_LOGIT_DIFF_8_BIT = 0.95, 4.0, 0.4
MIN_MEAN_LOGIT_DIFF_8_BIT = 0.02


@needs_vnni
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_the_default_model_in_8_bits_stays_near_float32(real_engine) -> None:
    from engine import loaders
    from tests.engine.test_quant_model import PROMPTS
    loaded = loaders.load_model(loaders.default_gguf_path(), dtype="float32", progress=False,
                                keep_quantized=True)
    engine = Engine(loaded.config, dict(loaded.weights), loaded.tokenizer,
                    EngineConfig(dtype="quantized", num_pages=256), seed=0,
                    planner=BatchPlanner(fixed_block_rows=1 << 20, fixed_act8_rows=1))
    assert set(engine.model.planner.act8_limits.values()) == {1}
    prompts = [real_engine.tokenizer.encode(text) for text in PROMPTS]
    continuations = real_engine.generate_greedy_batch(prompts, 24)
    agree = total = 0
    diff_sum = diff_max = 0.0
    for sequence in (p + c for p, c in zip(prompts, continuations)):
        expected = real_engine.prompt_logits(sequence, all_positions=True)
        got = engine.prompt_logits(sequence, all_positions=True)
        diff = (got - expected).abs()
        diff_max, diff_sum = max(diff_max, float(diff.max())), diff_sum + float(diff.mean(-1).sum())
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        total += len(sequence)
    mean = diff_sum / total                                    # per position, then over all
    assert agree / total >= MIN_TOP1_AGREEMENT_8_BIT
    assert diff_max < MAX_LOGIT_DIFF_8_BIT
    assert MIN_MEAN_LOGIT_DIFF_8_BIT < mean < MAX_MEAN_LOGIT_DIFF_8_BIT


@needs_vnni
def test_adapters_in_the_fused_decoder_on_8_bits(tiny_gguf, tiny_adapters) -> None:
    """A mixed batch of adapters on the 8-bit decoder: near the 16-bit one, and the row without
    an adapter exactly as in a pass without any (the adapters' units beside 8-bit slices)."""
    from tests.engine.test_adapters_fused import SEQUENCES, decode_logits, tiny_engine
    adapters = [adapter for _, adapter in SEQUENCES]

    def eight_bit(engine: Engine) -> Engine:
        fused = engine.model.fused_decoder
        engine.model.fused_decoder = FusedDecoder(fused.shape, fused.layers, fused.max_rows,
                                                  act8_min_rows=lambda weight: 1)
        return engine
    expected, fed = decode_logits(tiny_engine(tiny_gguf, tiny_adapters, fused=True), adapters)
    got, _ = decode_logits(eight_bit(tiny_engine(tiny_gguf, tiny_adapters, fused=True)),
                           adapters, fed)
    base, _ = decode_logits(eight_bit(tiny_engine(tiny_gguf, tiny_adapters, fused=True)),
                            [None] * len(adapters), fed)
    for step_got, step_expected, step_base in zip(got, expected, base):
        assert float((step_got - step_expected).abs().max()
                     / step_expected.abs().max()) < TINY_MODEL_ACT8_DRIFT
        assert torch.equal(step_got[0], step_base[0])
