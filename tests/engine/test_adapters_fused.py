"""LoRA adapters inside the fused C decoder (engine/quant/lora.c): a quantized decode pass whose
rows name adapters still runs every layer in one C call, computes what the per-layer path
(engine/adapters/apply.py) computes, at every kernel level, and leaves the rows without an adapter
exactly as they are without any."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import loaders
from engine.adapters.peft import TARGET_MODULES, save_adapter
from engine.batch import GREEDY, ForwardBatch, ForwardRequest
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.paging import last_page_len, num_pages_needed
from engine.quant import kernels
from engine.quant.linear import BatchPlanner
from engine.quant.lora import DecoderLora, LoraTable
from tests.engine.gguf_factory import tiny_hf_weights, write_tiny_gguf
from tests.engine.test_adapters import PROMPT, random_tensors, relative_error, write_adapter
from tests.engine.test_quant_decoder import MAX_RELATIVE_DIFF, MIXED_TYPES, _types

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())]

PAGE_SIZE = 4
PAGES_EACH = 6                     # 24 slots a sequence
# name -> (rank, target modules, seed, layers (None: every one))
TINY_ADAPTERS = {
    "r3-qv": (3, ("q_proj", "v_proj"), 1, None),
    "r16-all": (16, TARGET_MODULES, 2, None),
    "r5-k-up-down-layer1": (5, ("k_proj", "up_proj", "down_proj"), 3, [1]),
}
# one sequence without an adapter, one adapter twice (a group of two rows), ranks 3 / 5 / 16
SEQUENCES = (([1, 5, 9, 3, 7, 2, 11], None), ([4, 4, 8], "r3-qv"),
             ([2, 13, 6, 1, 1, 9, 10, 3, 5, 7, 12], "r16-all"), ([7, 3], "r3-qv"),
             ([9, 9, 1, 2], "r5-k-up-down-layer1"))
NUM_STEPS = 6


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    weights = tiny_hf_weights(seed=5)
    return write_tiny_gguf(tmp_path_factory.mktemp("lora_fused") / "mixed.gguf", weights,
                           matrix_type=Q.Q8_0, types=_types(weights, MIXED_TYPES))


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory, tiny_gguf):
    """TINY_ADAPTERS written in the PEFT layout -> {name: folder}."""
    config = loaders.load_model(tiny_gguf, dtype="float32", progress=False,
                                keep_quantized=True).config
    directory = tmp_path_factory.mktemp("tiny_adapters")
    return {name: save_adapter(directory / name, rank, 2 * rank,
                               random_tensors(config, rank, modules, seed, sigma=0.2,
                                              layers=layers))
            for name, (rank, modules, seed, layers) in TINY_ADAPTERS.items()}


def tiny_engine(path, adapters: dict, fused: bool) -> Engine:
    loaded = loaders.load_model(path, dtype="float32", progress=False, keep_quantized=True)
    engine = Engine(loaded.config, dict(loaded.weights), None,
                    EngineConfig(dtype="quantized", num_pages=32, page_size=PAGE_SIZE), seed=0,
                    planner=BatchPlanner(fixed_block_rows=8))
    for name, folder in adapters.items():
        engine.adapters.register(name, folder)
    if not fused:
        engine.model.fused_decoder = None
    return engine


def count_fused_runs(engine: Engine) -> list[bool]:
    """Each later fused-decoder call appends whether it carried adapters."""
    calls: list[bool] = []
    run = engine.model.fused_decoder.run
    engine.model.fused_decoder.run = lambda *args: calls.append(args[-1] is not None) or run(*args)
    return calls


def _request(index: int, token_ids: list[int], kv_len: int, adapter: str | None) -> ForwardRequest:
    end = kv_len + len(token_ids)
    first = index * PAGES_EACH
    return ForwardRequest(tuple(token_ids), tuple(range(kv_len, end)),
                          tuple(range(first, first + num_pages_needed(end, PAGE_SIZE))),
                          last_page_len(end, PAGE_SIZE), (len(token_ids) - 1,), (GREEDY,),
                          adapter=adapter)


def decode_logits(engine: Engine, adapters, forced: list[list[int]] | None = None):
    """Prefill SEQUENCES' prompts (each with adapters[i]), then NUM_STEPS decode passes of all
    of them in one batch -> (each pass's logits [B, vocab], the tokens fed: greedy, or
    `forced`)."""
    prompts = [prompt for prompt, _ in SEQUENCES]
    batch = ForwardBatch(tuple(_request(i, p, 0, a) for i, (p, a) in enumerate(zip(prompts,
                                                                                  adapters))))
    next_ids = engine.logits(batch).argmax(-1).tolist()
    kv_lens = [len(p) for p in prompts]
    all_logits, fed = [], []
    for step in range(NUM_STEPS):
        ids = forced[step] if forced else next_ids
        fed.append(ids)
        logits = engine.logits(ForwardBatch(tuple(
            _request(i, [t], kv_lens[i], a) for i, (t, a) in enumerate(zip(ids, adapters)))))
        all_logits.append(logits)
        next_ids = logits.argmax(-1).tolist()
        kv_lens = [n + 1 for n in kv_lens]
    return all_logits, fed


@pytest.mark.parametrize("level", kernels.levels())
def test_a_mixed_batch_decodes_in_the_fused_decoder_at_every_level(tiny_gguf, tiny_adapters,
                                                                    level, monkeypatch):
    monkeypatch.setenv(kernels.LEVEL_ENV, level)
    adapters = [adapter for _, adapter in SEQUENCES]
    fused = tiny_engine(tiny_gguf, tiny_adapters, fused=True)
    calls = count_fused_runs(fused)
    got, fed = decode_logits(fused, adapters)
    assert calls[-NUM_STEPS:] == [True] * NUM_STEPS    # every decode pass, adapters and all, in C
    assert len(calls) > NUM_STEPS      # and the prompts that fit its rows (engine/routing.py)
    expected, _ = decode_logits(tiny_engine(tiny_gguf, tiny_adapters, fused=False), adapters, fed)
    base, _ = decode_logits(tiny_engine(tiny_gguf, tiny_adapters, fused=True), [None] * 5, fed)
    for step_got, step_expected, step_base in zip(got, expected, base):
        scale = float(step_expected.abs().max())
        torch.testing.assert_close(step_got, step_expected, rtol=0, atol=MAX_RELATIVE_DIFF * scale)
        assert torch.equal(step_got[0], step_base[0])       # the row without an adapter: untouched
        for row in range(1, 5):                             # ... the others moved by their adapter
            assert relative_error(step_got[row], step_base[row]) > 10 * MAX_RELATIVE_DIFF


def test_the_default_model_decodes_a_mixed_batch_in_the_fused_decoder(tmp_path, monkeypatch):
    """SmolLM2-135M's shapes (q/k/v of 576/192/192 columns): a decode step of a batch mixing no
    adapter and three (one of them twice) runs in one C call and equals the per-layer path (both
    on 16-bit activations: 8-bit ones would round the two paths' ulp-apart inputs apart by ~2%,
    test_quant_act8.py)."""
    from engine import load_default_engine

    monkeypatch.setenv(kernels.ACT8_ENV, "0")

    engine = load_default_engine(dtype="quantized", num_pages=64, progress=False, seed=0)
    names = ["r8-qv-down", "r16-ko-gateup", "r16-all"]
    for name in names:
        engine.adapters.register(name, write_adapter(tmp_path, engine.model_config, name)[0])
    prompts = [engine.tokenizer.encode(text) for text in
               (PROMPT, "Once upon a time", "def add(a, b):", "Paris is the capital of", "Hi")]
    adapters = [None, names[0], names[1], names[0], names[2]]
    calls = count_fused_runs(engine)

    def step_logits(fused: bool, step_adapters) -> torch.Tensor:
        """Prefill every prompt on its own pages, then one decode step of all of them."""
        page_size = engine.page_size
        engine.logits(ForwardBatch(tuple(
            ForwardRequest(tuple(p), tuple(range(len(p))),
                           tuple(range(8 * i, 8 * i + num_pages_needed(len(p), page_size))),
                           last_page_len(len(p), page_size), (len(p) - 1,), (GREEDY,),
                           adapter=a) for i, (p, a) in enumerate(zip(prompts, step_adapters)))))
        steps = tuple(ForwardRequest.decode_step(
            p[-1], len(p), tuple(range(8 * i, 8 * i + num_pages_needed(len(p) + 1, page_size))),
            last_page_len(len(p) + 1, page_size), GREEDY, adapter=a)
            for i, (p, a) in enumerate(zip(prompts, step_adapters)))
        decoder = engine.model.fused_decoder
        engine.model.fused_decoder = decoder if fused else None
        try:
            return engine.logits(ForwardBatch(steps))
        finally:
            engine.model.fused_decoder = decoder

    got = step_logits(True, adapters)
    assert calls == [True, True]                    # the prompts too: short ones are token rows
    expected = step_logits(False, adapters)
    base = step_logits(True, [None] * len(prompts))
    assert calls == [True, True, True, False, False]
    for row in range(len(prompts)):
        assert relative_error(got[row], expected[row]) <= MAX_RELATIVE_DIFF, adapters[row]
    assert torch.equal(got[0], base[0])
    for row in range(1, len(prompts)):
        assert relative_error(got[row], base[row]) > 10 * MAX_RELATIVE_DIFF, adapters[row]


# ---- what the C decoder refuses -------------------------------------------------------------

@pytest.fixture(scope="module")
def adapted_engine(tiny_gguf, tiny_adapters):
    return tiny_engine(tiny_gguf, tiny_adapters, fused=True)


def _lora_pass(engine: Engine, names):
    """The LoraPass of a pass of one token per adapter in `names`."""
    return engine.adapters.prepare([ForwardRequest((1,), (0,), (0,), 1, (0,), (GREEDY,),
                                                   adapter=name) for name in names])


def test_a_table_names_the_factor_that_does_not_fit(adapted_engine):
    fused = adapted_engine.model.fused_decoder
    adapter = adapted_engine.adapters.load("r3-qv")
    layers = [list(layer) for layer in adapter.layers]
    good = layers[0][0]
    bad_b = type(good)(good.a, good.slices, (good.b_t[0], good.b_t[1][:, :-1]))
    layers[1][0] = bad_b
    with pytest.raises(ValueError, match=r"adapter 0 layer 1 projection 0 B must be"):
        LoraTable([layers], fused.shape, len(fused.layers))
    layers[1][0] = type(good)(good.a.double(), good.slices, good.b_t)
    with pytest.raises(ValueError, match=r"adapter 0 layer 1 projection 0 A must be"):
        LoraTable([layers], fused.shape, len(fused.layers))
    layers[1][0] = type(good)(good.a, (good.slices[0], (good.slices[1][0], 10_000)), good.b_t)
    with pytest.raises(ValueError, match=r", 10000\) are outside the projection's"):
        LoraTable([layers], fused.shape, len(fused.layers))
    with pytest.raises(ValueError, match="2 layers"):
        LoraTable([layers[:1]], fused.shape, len(fused.layers))


def test_the_decoder_refuses_rows_outside_the_pass_or_in_two_groups(adapted_engine):
    """The rows reach C as addresses: C checks them against the pass itself."""
    engine, fused = adapted_engine, adapted_engine.model.fused_decoder
    lora = _lora_pass(engine, ["r3-qv", "r16-all"])
    table = lora.stacked.decoder_table(fused.shape, len(fused.layers))
    batch = ForwardBatch((_request(0, [3], 5, None), _request(1, [4], 5, None)))
    from engine.page_table import build_page_table

    page_table = build_page_table(batch, PAGE_SIZE)
    engine.attention.plan(page_table)
    plan = engine.attention.decode_plan(engine.kv_cache.num_pages * 2 * PAGE_SIZE)
    model = engine.model
    positions = torch.tensor([5, 5])
    args = (model.rope_cos[positions].contiguous(), model.rope_signed_sin[positions].contiguous(),
            engine.kv_cache.pool, plan, 1)
    x = torch.zeros(2, fused.shape.hidden)
    for groups in ([[0], [2]], [[0], [0]], [[1, 0], [-1]]):
        with pytest.raises(ValueError, match="rows"):
            fused.run(x, *args, DecoderLora.of(table, groups))
    with pytest.raises(ValueError, match="1 groups for 2 adapters"):
        DecoderLora.of(table, [[0]])
    engine.kv_cache.pool.zero_()             # the context's earlier slots, never written
    fused.run(x, *args, DecoderLora.of(table, [[1], [0]]))        # the same pass, rows right
    assert bool(torch.isfinite(x).all())
