"""8-bit activations on the row-major Q4_K, Q5_K and Q6_K (engine/quant/kquant_act8*.c): the
vpdpbusd kernels equal the portable reference bit for bit at every level the machine has, the reference
equals float64 sums of the same quants and stays within the 8-bit rounding of x @ W^T with the
GGUF's own dequantized weights, the planner and the fused decoder take them, and a tiny Q4_K /
Q6_K model's logits on 8 bits stay near its 16-bit ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from engine import loaders
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.quant import QuantizedTensor, kernels
from engine.quant.decoder import projection_act8_rows
from engine.quant.linear import BatchPlanner
from tests.engine import gguf_factory
from tests.engine.test_quant_act8 import (ACT8_ROUNDING, FLOAT_ROUNDING, TINY_MODEL_ACT8_DRIFT,
                                          needs_vnni, quantized_8bit)
from tests.engine.test_quant_kernels import random_blocks, reference_weight

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())

K_QTYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
ACT8_LEVELS = [level for level in kernels.levels() if level in kernels.ACT8_LEVELS]
NUM_ROWS = 40        # not a multiple of a thread chunk (8) nor of 16


def k_weight(qtype: Q, num_rows: int, num_cols: int, seed: int):
    blocks = random_blocks(qtype, num_rows, num_cols, seed)
    return (QuantizedTensor(torch.from_numpy(blocks), qtype, num_cols),
            reference_weight(blocks, qtype, num_cols))       # gguf-py's dequantizer


@pytest.mark.parametrize("num_cols", [256, 2048])
@pytest.mark.parametrize("num_x_rows", [1, 3, 8, 32, 33])
@pytest.mark.parametrize("qtype", K_QTYPES, ids=lambda q: q.name)
def test_every_level_equals_the_reference_bit_for_bit(qtype: Q, num_x_rows: int,
                                                      num_cols: int) -> None:
    weight, reference = k_weight(qtype, NUM_ROWS, num_cols, seed=num_x_rows)
    x = torch.randn(num_x_rows, num_cols, generator=torch.Generator().manual_seed(num_cols))
    expected = kernels.matmul(x, weight, level="scalar", num_threads=1, act_bits=8)
    for level in ACT8_LEVELS:
        for num_threads in (1, 3):
            got = kernels.matmul(x, weight, level=level, num_threads=num_threads, act_bits=8)
            assert torch.equal(got, expected), (level, num_threads)
    exact = quantized_8bit(x) @ reference.double().T                     # float64 sums
    assert float(((expected - exact).norm(dim=1) / exact.norm(dim=1)).max()) < FLOAT_ROUNDING
    dense = x @ reference.T
    assert float(((expected - dense).norm(dim=1) / dense.norm(dim=1)).max()) < ACT8_ROUNDING


@pytest.mark.parametrize("qtype", K_QTYPES, ids=lambda q: q.name)
def test_extreme_blocks_stay_exact(qtype: Q) -> None:
    """Zero blocks (d = 0), one huge value among tiny ones, +-max in every lane, and the
    largest weight quants against them: the offset (+128) and its weight-sum correction, and
    Q4_K / Q5_K's minimums and Q6_K's -32, keep the integer sums exact."""
    blocks = random_blocks(qtype, 16, 512, seed=7)
    if qtype in (Q.Q4_K, Q.Q5_K):                       # all quants 15 (Q5_K: 31, qh all set)
        blocks[0].reshape(2, GGML_QUANT_SIZES[qtype][1])[:, 16:] = 0xFF
    else:
        blocks[0].reshape(2, 210)[:, :192] = 0xFF                      # all quants 63 - 32
    weight = QuantizedTensor(torch.from_numpy(blocks), qtype, 512)
    reference = reference_weight(blocks, qtype, 512)
    x = torch.zeros(6, 512)
    x[1, 32:64] = 1e-30
    x[1, 40] = 3e4
    x[2] = 1.0
    x[3] = -1.0
    x[4, ::2], x[4, 1::2] = 5.0, -5.0
    x[5] = torch.linspace(-7, 7, 512)
    expected = kernels.matmul(x, weight, level="scalar", num_threads=1, act_bits=8)
    for level in ACT8_LEVELS:
        got = kernels.matmul(x, weight, level=level, num_threads=1, act_bits=8)
        assert torch.equal(got, expected)
    assert torch.isfinite(expected).all() and torch.equal(expected[0], torch.zeros(16))
    exact = quantized_8bit(x) @ reference.double().T
    assert float((expected - exact).abs().max()) <= FLOAT_ROUNDING * float(exact.abs().max())


def test_k_quants_have_8_bit_kernels_where_the_levels_do() -> None:
    weight, _ = k_weight(Q.Q6_K, 16, 256, seed=1)
    assert kernels.act8_layout(weight) == kernels.act8_layout(k_weight(Q.Q4_K, 16, 256, 1)[0])
    assert kernels.act8_supported(weight, level="scalar")
    x = torch.randn(2, 256)
    if "avx2" in kernels.levels():
        assert not kernels.act8_supported(weight, level="avx2")
        with pytest.raises(ValueError, match="Q4_K / Q5_K / Q6_K weight at the scalar or avx512-vnni"):
            kernels.matmul(x, weight, level="avx2", act_bits=8)
    q4_k, _ = k_weight(Q.Q4_K, 16, 256, seed=2)
    assert projection_act8_rows((q4_k, weight), lambda part: 1) == 1    # one layout: Q/K/V


@needs_vnni
def test_the_planner_measures_k_quants() -> None:
    weight, _ = k_weight(Q.Q4_K, 64, 512, seed=3)
    planner = BatchPlanner()
    assert planner.act8_min_rows(weight) in (0, 1)
    fixed = BatchPlanner(fixed_block_rows=8, fixed_act8_rows=1)
    assert fixed.act8_min_rows(weight) == 1
    assert "8-bit blocks (vpdpbusd) in every batch" in fixed.activation_summary()


# The tiny model at hidden 256 / intermediate 512 (K-quant rows are whole super-blocks of 256):
# every projection Q4_K, V and down Q6_K (Q4_K_M's mix) but O as Q5_K (Q5_K_M's main type),
# embeddings / head Q8_0. Its layers'
# Gaussian weights are scaled by 1 / sqrt(K), as a trained model's are about: unscaled, attention
# at this width is one-hot and a rounding can flip it (measured drifts of 20-80% at some steps,
# Q4_0 / Q4_1 models as well); scaled, 1.4-1.6% over 4 steps (Q4_0 / Q4_1: 1.1-2.0%), under
# test_quant_act8's TINY_MODEL_ACT8_DRIFT.
K_MODEL = dict(hidden=256, intermediate=512)
K_MODEL_TYPES = {"self_attn.q_proj": Q.Q4_K, "self_attn.k_proj": Q.Q4_K,
                 "self_attn.v_proj": Q.Q6_K, "self_attn.o_proj": Q.Q5_K,
                 "mlp.gate_proj": Q.Q4_K, "mlp.up_proj": Q.Q4_K, "mlp.down_proj": Q.Q6_K}
def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0"""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b > 0)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> Q4_K blocks [N, K / 256 * 144]: per sub-block of 32, min-max steps of
    15, its step and minimum 6-bit multiples of the super-block's fp16 d and dmin (gguf-py has
    no K-quant quantizer; the bytes are checked against its dequantizer)."""
    sub = values.reshape(-1, 8, 32).astype(np.float32)              # [super, sub-block, 32]
    low = np.minimum(sub.min(axis=2), 0)
    step = (sub.max(axis=2) - low) / 15
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = ((-low).max(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_divide(step, d32)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_divide(-low, dmin32)), 0, 63).astype(np.uint8)
    q = np.clip(np.rint(_divide(sub + (dmin32 * mn)[:, :, None], (d32 * sc)[:, :, None])), 0, 15)
    q = q.astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(sub), 128)  # sub-blocks 2p, 2p + 1
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           scales, qs], axis=1).reshape(values.shape[0], -1)


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> Q5_K blocks [N, K / 256 * 176]: quantize_q4_k's scheme with steps of
    31, bit 4 of value l of sub-block s at bit s of qh[l]."""
    sub = values.reshape(-1, 8, 32).astype(np.float32)              # [super, sub-block, 32]
    low = np.minimum(sub.min(axis=2), 0)
    step = (sub.max(axis=2) - low) / 31
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = ((-low).max(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_divide(step, d32)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_divide(-low, dmin32)), 0, 63).astype(np.uint8)
    q = np.clip(np.rint(_divide(sub + (dmin32 * mn)[:, :, None], (d32 * sc)[:, :, None])), 0, 31)
    q = q.astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=1)
    qh = sum(((q[:, s] >> 4) & 1) << s for s in range(8)).astype(np.uint8)   # [super, 32]
    nibbles = q & 0xF
    qs = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).reshape(len(sub), 128)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           scales, qh, qs], axis=1).reshape(values.shape[0], -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> Q6_K blocks [N, K / 256 * 210]: per 16 values, steps of max |v| / 31,
    each an 8-bit multiple of the super-block's fp16 d."""
    sub = values.reshape(-1, 16, 16).astype(np.float32)             # [super, scale, 16]
    step = np.abs(sub).max(axis=2) / 31
    d = (step.max(axis=1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_divide(step, d32)), 0, 127)
    q = np.clip(np.rint(_divide(sub, (d32 * sc)[:, :, None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)                      # [super, half, quarter, l]
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2)
    qh = sum(((q[:, :, quarter] >> 4) & 3) << (2 * quarter) for quarter in range(4))
    return np.concatenate([ql.reshape(-1, 128), qh.astype(np.uint8).reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                          axis=1).reshape(values.shape[0], -1)


K_QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}
# the quantizers above against gguf-py's dequantizer, Gaussian rows: measured 7.7% (Q4_K), 3.8%
# (Q5_K) and 1.9% (Q6_K) of the norm
K_QUANTIZER_ERROR = {Q.Q4_K: 0.1, Q.Q5_K: 0.05, Q.Q6_K: 0.03}


@pytest.mark.parametrize("qtype", K_QTYPES, ids=lambda q: q.name)
def test_the_test_quantizer_writes_gguf_bytes(qtype: Q) -> None:
    values = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    back = reference_weight(K_QUANTIZERS[qtype](values), qtype, 512).numpy()
    assert np.linalg.norm(back - values) / np.linalg.norm(values) < K_QUANTIZER_ERROR[qtype]


@pytest.fixture(scope="module")
def k_gguf(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in K_MODEL.items():
            patch.setitem(gguf_factory.TINY, name, value)
        quantize = gguf_factory.quants.quantize
        patch.setattr(gguf_factory.quants, "quantize", lambda values, qtype: (
            K_QUANTIZERS[qtype](values) if qtype in K_QTYPES else quantize(values, qtype)))
        weights = {name: value / np.sqrt(value.shape[-1]) if value.ndim == 2 and ".layers." in name
                   else value
                   for name, value in gguf_factory.tiny_hf_weights(seed=11).items()}
        types = {name: qtype for name in weights for part, qtype in K_MODEL_TYPES.items()
                 if name.endswith(part + ".weight")}
        return gguf_factory.write_tiny_gguf(tmp_path_factory.mktemp("kquants") / "k.gguf",
                                            weights, matrix_type=Q.Q8_0, types=types)


def k_engine(path, act8_rows: int) -> Engine:
    from tests.engine.test_quant_decoder import PAGE_SIZE
    loaded = loaders.load_model(path, dtype="float32", progress=False, keep_quantized=True)
    return Engine(loaded.config, dict(loaded.weights), None,
                  EngineConfig(dtype="quantized", num_pages=32, page_size=PAGE_SIZE), seed=0,
                  planner=BatchPlanner(fixed_block_rows=8, fixed_act8_rows=act8_rows))


@needs_vnni
@pytest.mark.usefixtures("one_torch_thread")
def test_a_k_quant_model_in_8_bits_stays_near_16_bits(k_gguf) -> None:
    """Prefill (the per-layer path) and fused decode of the tiny Q4_K / Q5_K / Q6_K model: every
    projection on 8 bits, Q/K/V's Q4_K + Q6_K parts included, logits within the 8-bit rounding
    of the 16-bit engine's."""
    from tests.engine.test_quant_decoder import PROMPTS, decode_logits
    sixteen, eight = k_engine(k_gguf, 0), k_engine(k_gguf, 1)
    qkv = eight.model.fused_decoder.layers[0].projections[0]
    assert [part.qtype for part in qkv] == [Q.Q4_K, Q.Q4_K, Q.Q6_K]
    assert {rows for layer in eight.model.fused_decoder.act8_rows for rows in layer} == {1}
    expected, fed = decode_logits(sixteen, PROMPTS, 4, None)
    got, _ = decode_logits(eight, PROMPTS, 4, fed)
    differ = False
    for a, b in zip(got, expected):
        relative = float((a - b).abs().max() / b.abs().max())
        assert relative < TINY_MODEL_ACT8_DRIFT
        differ |= relative > 0
    assert differ                                    # the 8-bit kernels ran
