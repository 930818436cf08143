"""The fused C decoder (engine/quant/decoder.c: every layer of a plain decode pass in one call)
computes what the per-layer path computes, on a tiny GGUF whose projections mix block types
(3-part Q/K/V, 2-part gate/up), over contexts that span several pages."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import loaders
from engine.batch import ForwardBatch, ForwardRequest, SamplerSpec
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.quant import kernels
from engine.quant.linear import BatchPlanner
from tests.engine.gguf_factory import tiny_hf_weights, write_tiny_gguf

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())]

PAGE_SIZE = 4
# The two paths round RoPE and SiLU differently by an ulp (torch's vectorized addcmul / exp vs
# plain C); the next layer's 16-bit activation blocks can turn that into one quantum (~3e-5 of a
# block's largest value). Measured: 0 on most steps, at most 4e-4 of the largest logit.
MAX_RELATIVE_DIFF = 2e-3
MIXED_TYPES = {"self_attn.q_proj": Q.Q4_0, "self_attn.k_proj": Q.Q8_0,
               "self_attn.v_proj": Q.Q4_1, "self_attn.o_proj": Q.Q4_1, "mlp.gate_proj": Q.Q4_0,
               "mlp.up_proj": Q.Q8_0, "mlp.down_proj": Q.Q4_1}
PROMPTS = ([1, 5, 9, 3, 7, 2, 11], [4, 4, 8], [2, 13, 6, 1, 1, 9, 10, 3, 5, 7, 12])


def _types(weights: dict, overrides: dict[str, Q]) -> dict[str, Q]:
    return {name: overrides[part] for name in weights for part in overrides
            if name.endswith(part + ".weight")}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    weights = tiny_hf_weights(seed=3)
    return write_tiny_gguf(tmp_path_factory.mktemp("fused") / "mixed.gguf", weights,
                           matrix_type=Q.Q8_0, types=_types(weights, MIXED_TYPES))


def quantized_engine(path, fused: bool, kv_dtype: str = "auto") -> Engine:
    loaded = loaders.load_model(path, dtype="float32", progress=False, keep_quantized=True)
    config = EngineConfig(dtype="quantized", num_pages=32, page_size=PAGE_SIZE, kv_dtype=kv_dtype)
    engine = Engine(loaded.config, dict(loaded.weights), None, config, seed=0,
                    planner=BatchPlanner(fixed_block_rows=8))
    if not fused:
        engine.model.fused_decoder = None
    return engine


def _request(sequence_index: int, token_ids: list[int], kv_len: int) -> ForwardRequest:
    end = kv_len + len(token_ids)
    first_page = sequence_index * 8                       # 8 pages (32 slots) per sequence
    num_pages = -(-end // PAGE_SIZE)
    return ForwardRequest(tuple(token_ids), tuple(range(kv_len, end)),
                          tuple(range(first_page, first_page + num_pages)),
                          (end - 1) % PAGE_SIZE + 1, (len(token_ids) - 1,), (SamplerSpec(),))


def decode_logits(engine: Engine, prompts, num_steps: int, forced: list[list[int]] | None):
    """Prefill every prompt (one pass each: the per-layer path's padded attention of short
    prompts is not the same arithmetic alone and batched), then num_steps decode passes of all
    sequences in one batch; returns the logits of each decode pass [B, vocab] and the tokens
    fed (greedy, or `forced`)."""
    next_ids = [int(engine.logits(ForwardBatch((_request(i, list(p), 0),))).argmax())
                for i, p in enumerate(prompts)]
    kv_lens = [len(p) for p in prompts]
    all_logits, fed = [], []
    for step in range(num_steps):
        ids = forced[step] if forced else next_ids
        fed.append(ids)
        batch = ForwardBatch(tuple(_request(i, [t], kv_lens[i]) for i, t in enumerate(ids)))
        logits = engine.logits(batch)                                     # [B, vocab]
        all_logits.append(logits)
        next_ids = logits.argmax(-1).tolist()
        kv_lens = [n + 1 for n in kv_lens]
    return all_logits, fed


def test_mixed_types_fuse_into_part_lists(mixed_gguf) -> None:
    fused = quantized_engine(mixed_gguf, fused=True).model.fused_decoder
    assert fused is not None and fused.max_rows == 8
    qkv, o, gate_up, down = fused.layers[0].projections
    assert [p.qtype for p in qkv] == [Q.Q4_0, Q.Q8_0, Q.Q4_1]
    assert [p.qtype for p in gate_up] == [Q.Q4_0, Q.Q8_0]
    assert len(o) == len(down) == 1


@pytest.mark.parametrize("kv_dtype", ["auto", "float32"])
@pytest.mark.parametrize("num_sequences", [1, 3])
def test_fused_decode_equals_the_per_layer_path(mixed_gguf, num_sequences, kv_dtype) -> None:
    prompts = PROMPTS[:num_sequences]
    fused_engine = quantized_engine(mixed_gguf, fused=True, kv_dtype=kv_dtype)
    expected_dtype = torch.float16 if kv_dtype == "auto" else torch.float32
    assert fused_engine.kv_cache.pool.dtype == expected_dtype
    calls = []
    run = fused_engine.model.fused_decoder.run
    fused_engine.model.fused_decoder.run = lambda *args: calls.append(1) or run(*args)
    fused_logits, fed = decode_logits(fused_engine, prompts, 10, None)
    layer_engine = quantized_engine(mixed_gguf, fused=False, kv_dtype=kv_dtype)
    layer_logits, _ = decode_logits(layer_engine, prompts, 10, fed)
    assert fused_engine.model.fused_decoder.max_rows == 8
    # every decode pass, and the prompts that fit its 8 rows (the 11-token one does not)
    assert len(calls) == 10 + {1: 1, 3: 2}[num_sequences]
    for got, expected in zip(fused_logits, layer_logits):
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=0, atol=MAX_RELATIVE_DIFF * scale)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_q5_blocks_decode_fused_as_the_per_layer_path(tmp_path, qtype) -> None:
    """A model of Q5_0 / Q5_1 matrices (the fallback types of Q4_K_M / Q5_K_M) kept as their own
    blocks: interleaved where a SIMD level runs, fused as every other type, the same logits as
    the per-layer path."""
    weights = tiny_hf_weights(seed=5)
    path = write_tiny_gguf(tmp_path / "q5.gguf", weights, matrix_type=qtype)
    fused_engine = quantized_engine(path, fused=True)
    qkv = fused_engine.model.fused_decoder.layers[0].projections[0]
    assert [p.qtype for p in qkv] == [qtype]
    assert qkv[0].interleaved == (kernels.best_level() != "scalar")
    fused_logits, fed = decode_logits(fused_engine, PROMPTS, 4, None)
    layer_logits, _ = decode_logits(quantized_engine(path, fused=False), PROMPTS, 4, fed)
    for got, expected in zip(fused_logits, layer_logits):
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=0, atol=MAX_RELATIVE_DIFF * scale)


def test_a_dense_projection_keeps_the_per_layer_path(tmp_path) -> None:
    weights = tiny_hf_weights(seed=4)
    types = _types(weights, {"self_attn.o_proj": Q.F32})
    path = write_tiny_gguf(tmp_path / "dense_o.gguf", weights, matrix_type=Q.Q8_0, types=types)
    engine = quantized_engine(path, fused=True)
    assert engine.model.fused_decoder is None
    logits, _ = decode_logits(engine, PROMPTS[:2], 2, None)
    assert logits[-1].shape == (2, 40) and bool(torch.isfinite(logits[-1]).all())


def test_run_refuses_what_does_not_fit(mixed_gguf) -> None:
    engine = quantized_engine(mixed_gguf, fused=True)
    fused, model = engine.model.fused_decoder, engine.model
    batch = ForwardBatch((_request(0, [3], 5),))
    from engine.page_table import build_page_table
    table = build_page_table(batch, PAGE_SIZE)
    engine.attention.plan(table)
    plan = engine.attention.decode_plan(engine.kv_cache.num_pages * 2 * PAGE_SIZE)
    hidden, head_dim = fused.shape.hidden, fused.shape.head_dim
    cos, sin = model.rope_cos[:1].contiguous(), model.rope_signed_sin[:1].contiguous()
    pool = engine.kv_cache.pool
    with pytest.raises(ValueError, match="tokens"):
        fused.run(torch.zeros(2, hidden), cos, sin, pool, plan, 1)       # plan has 1 request
    with pytest.raises(ValueError, match="x must be"):
        fused.run(torch.zeros(1, hidden, dtype=torch.float64), cos, sin, pool, plan, 1)
    with pytest.raises(ValueError, match="cos must be"):
        fused.run(torch.zeros(1, hidden), torch.zeros(1, head_dim + 1), sin, pool, plan, 1)
    with pytest.raises(ValueError, match="pool must be"):
        fused.run(torch.zeros(1, hidden), cos, sin, pool[:, :4], plan, 1)
    pool.zero_()                     # the context's earlier slots (never written: uninitialized)
    x = torch.zeros(1, hidden)
    fused.run(x, cos, sin, pool, plan, 1)
    assert bool(torch.isfinite(x).all())
