"""Every kernel level of engine.quant (scalar, avx2, avx512-vnni), each run where this CPU has it
and skipped, by name, where it does not: the levels follow what CPUID / XGETBV report,
PIE_KERNEL_LEVEL forces a slower level (so the AVX2 kernels stay tested on an AVX-512 machine),
and each level's products match the portable kernels and gguf's own dequantizer for every block
type, row-major and interleaved, at shapes that reach each kernel's tails (odd 8-row groups, 1-5
activation rows, chunks over several threads); the fused decoder agrees at every level."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from engine.quant import KERNEL_QTYPES, QuantizedTensor
from engine.quant import kernels
from tests.engine.test_quant_decoder import (MAX_RELATIVE_DIFF, PROMPTS, decode_logits,
                                             mixed_gguf, quantized_engine)  # noqa: F401 (fixture)
from tests.engine.test_quant_kernels import (ACTIVATION_ROUNDING_TOLERANCE, HALF_OFFSETS,
                                             random_blocks, reference_weight)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())

INTERLEAVABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# the same integer sums at every level, float additions reordered: relative to an output row
REORDERING_TOLERANCE = 1e-6


def assert_same_products(y: torch.Tensor, scalar: torch.Tensor) -> None:
    """y equals the portable kernels' result up to the order of float additions (an element
    near a cancellation may differ by more than its own size allows, its row's norm may not)."""
    relative = (y - scalar).norm(dim=1) / scalar.norm(dim=1)
    assert float(relative.max()) < REORDERING_TOLERANCE


# The levels this CPU runs: each is tested against the scalar reference. Which ones it runs is
# itself checked against CPUID / XGETBV (test_levels_follow_the_cpu_features), so a level that
# should run here and does not is a failure, not an absent case.
RUNNABLE = kernels.levels()


def test_levels_follow_the_cpu_features() -> None:
    cpu = kernels.cpu_features()
    assert set(cpu) == {"avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx", "os_zmm"}
    expected = ["scalar"]
    if cpu["avx2"]:
        expected.append("avx2")
        if cpu["avx512"] and cpu["avx512_vnni"] and cpu["os_zmm"]:
            expected.append("avx512-vnni")
    assert list(kernels.levels()) == expected
    assert kernels.levels() == tuple(level for level in kernels.LEVELS if level in expected)


def test_the_best_level_is_the_fastest_unless_one_is_forced(monkeypatch) -> None:
    monkeypatch.delenv(kernels.LEVEL_ENV, raising=False)
    assert kernels.best_level() == kernels.levels()[-1]
    assert kernels.level_reason()
    monkeypatch.setenv(kernels.LEVEL_ENV, "scalar")
    assert kernels.best_level() == "scalar"
    assert kernels.level_index(None) == 0
    assert f"{kernels.LEVEL_ENV}=scalar" in kernels.level_reason()
    monkeypatch.setenv(kernels.LEVEL_ENV, "avx9000")
    with pytest.raises(ValueError, match="avx9000"):
        kernels.best_level()


def test_a_level_this_cpu_lacks_cannot_be_forced(monkeypatch) -> None:
    """Forcing a level the CPU lacks is an error naming what it runs (a CPU that runs only the
    scalar level stands in, so the check runs on every machine)."""

    class ScalarOnly:
        @staticmethod
        def levels() -> tuple[str, ...]:
            return ("scalar",)

    monkeypatch.setattr(kernels, "require", lambda: ScalarOnly)
    monkeypatch.setenv(kernels.LEVEL_ENV, "avx2")
    with pytest.raises(ValueError, match=r"runs the kernel levels \('scalar',\)"):
        kernels.best_level()
    monkeypatch.setenv(kernels.LEVEL_ENV, "scalar")
    assert kernels.best_level() == "scalar"


@pytest.mark.parametrize("level", RUNNABLE)
def test_the_reason_names_the_level(level: str, monkeypatch) -> None:
    monkeypatch.delenv(kernels.LEVEL_ENV, raising=False)
    if level == kernels.levels()[-1]:
        reason = kernels.level_reason()
        assert ("AVX-512" in reason) == (level == "avx512-vnni")
    monkeypatch.setenv(kernels.LEVEL_ENV, level)
    assert kernels.best_level() == level


@pytest.mark.parametrize("num_x_rows", [1, 2, 5, 8])
@pytest.mark.parametrize("qtype", sorted(KERNEL_QTYPES), ids=lambda q: q.name)
@pytest.mark.parametrize("level", RUNNABLE)
def test_row_kernels_match_scalar_and_gguf(level: str, qtype: Q, num_x_rows: int) -> None:
    num_rows, num_cols = 40, 512
    blocks = random_blocks(qtype, num_rows, num_cols, seed=11 + num_x_rows)
    weight = QuantizedTensor(torch.from_numpy(blocks), qtype, num_cols)
    x = torch.randn(num_x_rows, num_cols, generator=torch.Generator().manual_seed(num_x_rows))
    expected = x @ reference_weight(blocks, qtype, num_cols).T
    scalar = kernels.matmul(x, weight, level="scalar", num_threads=1)
    for num_threads in (1, 2):
        y = kernels.matmul(x, weight, level=level, num_threads=num_threads)
        assert_same_products(y, scalar)
        relative = (y - expected).norm(dim=1) / expected.norm(dim=1)
        assert float(relative.max()) < ACTIVATION_ROUNDING_TOLERANCE


@pytest.mark.parametrize("num_groups", [1, 2, 3, 7])        # odd: a last group alone
@pytest.mark.parametrize("qtype", INTERLEAVABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("level", RUNNABLE)
def test_interleaved_kernels_match_scalar_and_gguf(level: str, qtype: Q, num_groups: int) -> None:
    num_rows, num_cols = 8 * num_groups, 320
    blocks = random_blocks(qtype, num_rows, num_cols, seed=num_groups)
    weight = QuantizedTensor(torch.from_numpy(blocks), qtype, num_cols)
    interleaved = kernels.interleave(weight)
    expected = None
    for num_x_rows in (1, 3, 5, 8, 13):         # 8 rows a pass, then the rest
        x = torch.randn(num_x_rows, num_cols, generator=torch.Generator().manual_seed(num_x_rows))
        expected = x @ reference_weight(blocks, qtype, num_cols).T
        scalar = kernels.matmul(x, weight, level="scalar", num_threads=1)
        for num_threads in (1, 2, 3):
            y = kernels.matmul(x, interleaved, level=level, num_threads=num_threads)
            assert_same_products(y, scalar)
            relative = (y - expected).norm(dim=1) / expected.norm(dim=1)
            assert float(relative.max()) < ACTIVATION_ROUNDING_TOLERANCE
    assert expected is not None


@pytest.mark.parametrize("level", RUNNABLE)
def test_extreme_quants_do_not_overflow(level: str) -> None:
    """Every weight quant at its extreme and every activation at +-32767 (a block whose values
    are all its largest): the int32 sums of a block stay exact at every level."""
    num_cols = 256
    for qtype in sorted(KERNEL_QTYPES):
        blocks = random_blocks(qtype, 16, num_cols, seed=1)
        block_bytes = blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1])
        scales = {offset + i for offset in HALF_OFFSETS[qtype] for i in (0, 1)}
        quants = [i for i in range(block_bytes.shape[1]) if i not in scales]
        block_bytes[:, quants] = 0x80 if qtype == Q.Q8_0 else 0xFF   # -128, or 15 / 63 per nibble
        x = torch.full((3, num_cols), 4.0)
        x[1] = -4.0
        x[2, ::2] = -4.0
        weight = QuantizedTensor(torch.from_numpy(blocks), qtype, num_cols)
        expected = x @ reference_weight(blocks, qtype, num_cols).T
        targets = [weight] + ([kernels.interleave(weight)] if qtype in INTERLEAVABLE else [])
        for target in targets:
            y = kernels.matmul(x, target, level=level, num_threads=1)
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-3 * float(expected.abs().max()))


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("level", RUNNABLE)
def test_an_engine_forced_to_each_level_decodes_alike(level: str, mixed_gguf, monkeypatch) -> None:
    """The whole engine at one level (PIE_KERNEL_LEVEL: its block matmuls, the fused decoder, the
    decode attention) against the portable level, fed the same tokens: logits agree within the
    fused decoder's own tolerance."""
    monkeypatch.setenv(kernels.LEVEL_ENV, "scalar")
    reference_engine = quantized_engine(mixed_gguf, fused=True)
    monkeypatch.setenv(kernels.LEVEL_ENV, level)
    engine = quantized_engine(mixed_gguf, fused=True)
    assert engine.model.fused_decoder is not None
    logits, fed = decode_logits(engine, PROMPTS, 6, None)
    monkeypatch.setenv(kernels.LEVEL_ENV, "scalar")
    expected_logits, _ = decode_logits(reference_engine, PROMPTS, 6, fed)
    for got, expected in zip(logits, expected_logits):
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=0, atol=MAX_RELATIVE_DIFF * scale)


@pytest.mark.parametrize("level", RUNNABLE)
def test_the_kernel_line_names_the_level_and_why(level: str, mixed_gguf, monkeypatch) -> None:
    monkeypatch.delenv(kernels.LEVEL_ENV, raising=False)
    best = kernels.levels()[-1]
    line = quantized_engine(mixed_gguf, fused=True).kernel_summary
    assert f"multiplied in place by the {best} C kernels ({kernels.level_reason()})" in line
    on_c = "long prompts attend on the C prefill kernel (its {} loops)"
    on_sdpa = "long prompts attend with torch's SDPA (the C prefill kernel runs at avx2 and above)"
    assert (on_c.format(best) if best != "scalar" else on_sdpa) in line
    monkeypatch.setenv(kernels.LEVEL_ENV, level)
    line = quantized_engine(mixed_gguf, fused=True).kernel_summary
    assert (f"multiplied in place by the {level} C kernels ({kernels.LEVEL_ENV}={level}; the best "
            f"here is {best})") in line
    assert (on_c.format(level) if level != "scalar" else on_sdpa) in line


@pytest.mark.parametrize("qtype", sorted(KERNEL_QTYPES), ids=lambda q: q.name)
@pytest.mark.parametrize("level", RUNNABLE)
def test_dequantization_is_the_same_at_every_level(level: str, qtype: Q) -> None:
    """The GEMM path's dequantization: gguf's values, bit for bit what the portable code gives,
    row-major and interleaved, over several threads (chunks of whole 8-row groups)."""
    blocks = random_blocks(qtype, 72, 512, seed=21)
    weight = QuantizedTensor(torch.from_numpy(blocks), qtype, 512)
    reference = reference_weight(blocks, qtype, 512)
    scalar = kernels.dequantize(weight, level="scalar", num_threads=1)
    torch.testing.assert_close(scalar, reference, rtol=1e-6, atol=1e-7)
    targets = [weight] + ([kernels.interleave(weight)] if qtype in INTERLEAVABLE else [])
    for target in targets:
        for num_threads in (1, 3):
            assert torch.equal(kernels.dequantize(target, level=level, num_threads=num_threads),
                               scalar)


@pytest.mark.parametrize("head_dim", [24, 64])        # 16-wide steps at avx512-vnni, or 8-wide
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("level", RUNNABLE)
def test_decode_attention_agrees_with_the_portable_loops(level: str, kv_dtype: torch.dtype,
                                                         head_dim: int) -> None:
    from tests.engine.test_c_decode_attention import _gqa_case

    plan, q, k_new, v_new, slots, _, _ = _gqa_case(9, 3, head_dim, kv_dtype, seed=5)
    portable = plan(q, k_new, v_new, slots.clone(), level="scalar")
    simd_slots = slots.clone()
    out = plan(q, k_new, v_new, simd_slots, level=level)
    torch.testing.assert_close(out, portable, atol=1e-5, rtol=1e-5)
    scalar_slots = slots.clone()
    plan(q, k_new, v_new, scalar_slots, level="scalar")
    assert torch.equal(simd_slots, scalar_slots)          # the new K / V stored alike


@pytest.mark.parametrize("level", RUNNABLE)
def test_activation_rows_quantized_over_threads_give_the_same_products(level: str) -> None:
    """A long batch's activation rows are quantized on several threads (chunks of whole rows):
    the result is the one-thread result bit for bit, uneven last chunk included."""
    weight = kernels.interleave(QuantizedTensor(
        torch.from_numpy(random_blocks(Q.Q4_1, 32, 256, seed=3)), Q.Q4_1, 256))
    x = torch.randn(203, 256, generator=torch.Generator().manual_seed(3))
    one = kernels.matmul(x, weight, level=level, num_threads=1)
    for num_threads in (2, 3):
        assert torch.equal(kernels.matmul(x, weight, level=level, num_threads=num_threads), one)
