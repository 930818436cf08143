"""LoRA adapters (engine/adapters/): PEFT files checked against the base model, applied per request
inside one batch, equal to the same model with the adapter merged into its weights.

The exactness tests run the default model (SmolLM2-135M) in float32 with random adapters the tests
write in the PEFT layout: a request naming an adapter gives the greedy tokens of, and logits within
1e-4 (relative to the largest) of, a model whose weights are W + scale * B @ A.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.adapters import AdapterError, AdapterStore
from engine.adapters.peft import (CONFIG_FILE, projection_shapes, read_adapter_spec, save_adapter,
                                  tensor_name)
from engine.batch import GREEDY, ForwardBatch, ForwardRequest
from engine.chunking import split_request
from engine.engine_config import EngineConfig
from engine.errors import RequestError
from engine.paging import last_page_len, num_pages_needed
from tests.engine.conftest import TINY

PROMPT = "The three primary colors are"
NUM_NEW_TOKENS = 8
RELATIVE = 1e-4
_MODULE_NAME = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# name -> (rank, alpha, target modules, seed)
ADAPTERS = {
    "r8-qv-down": (8, 16, ("q_proj", "v_proj", "down_proj"), 1),
    "r16-ko-gateup": (16, 32, ("k_proj", "o_proj", "gate_proj", "up_proj"), 2),
    "r16-all": (16, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"), 3),
}


def random_tensors(config, rank: int, modules, seed: int, sigma: float = 0.02,
                   layers=None) -> dict:
    """Random (A [r, in], B [out, r]) per (layer, module), float32."""
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config.num_layers) if layers is None else layers:
        for module in modules:
            out_dim, in_dim = shapes[module]
            a = torch.randn(rank, in_dim, generator=generator) / math.sqrt(in_dim)
            b = torch.randn(out_dim, rank, generator=generator) * sigma
            tensors[(layer, module)] = (a, b)
    return tensors


def write_adapter(directory: Path, config, name: str) -> tuple[Path, dict, float]:
    """Write ADAPTERS[name] under `directory` -> (its folder, its tensors, its scale)."""
    rank, alpha, modules, seed = ADAPTERS[name]
    tensors = random_tensors(config, rank, modules, seed)
    return save_adapter(directory / name, rank, alpha, tensors), tensors, alpha / rank


def merged_weights(weights: dict, tensors: dict, scale: float) -> dict:
    """A copy of HF-named weights with W += scale * B @ A for every adapted projection."""
    merged = dict(weights)
    for (layer, module), (a, b) in tensors.items():
        name = f"model.layers.{layer}.{_MODULE_NAME[module]}.{module}.weight"
        merged[name] = weights[name] + scale * (b @ a)
    return merged


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def batch_logits(engine, prompts, adapters) -> list[torch.Tensor]:
    """Logits at every position of each prompt, all prompts in one pass on fresh pages."""
    page_size, requests, first_page = engine.page_size, [], 0
    for prompt, adapter in zip(prompts, adapters):
        num_pages = num_pages_needed(len(prompt), page_size)
        requests.append(ForwardRequest(
            tuple(prompt), tuple(range(len(prompt))), tuple(range(first_page, first_page + num_pages)),
            last_page_len(len(prompt), page_size), tuple(range(len(prompt))),
            (GREEDY,) * len(prompt), adapter=adapter))
        first_page += num_pages
    logits = engine.logits(ForwardBatch(tuple(requests)))
    return list(logits.split([len(p) for p in prompts]))


# ---- the default model in float32 -------------------------------------------------------------

@pytest.fixture(scope="module")
def base_weights():
    """The default model's float32 weights (HF names), loaded once, never consumed."""
    from engine import loaders

    loaded = loaders.load_model(loaders.default_gguf_path(), dtype=torch.float32, progress=False)
    return loaded


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, real_engine):
    """ADAPTERS written in the PEFT layout and registered with real_engine -> {name: (tensors,
    scale)}."""
    directory = tmp_path_factory.mktemp("adapters")
    written = {}
    for name in ADAPTERS:
        path, tensors, scale = write_adapter(directory, real_engine.model_config, name)
        real_engine.adapters.register(name, path)
        written[name] = (tensors, scale)
    return written


def _merged_engine(loaded, tensors, scale):
    from engine.engine import Engine

    return Engine(loaded.config, merged_weights(loaded.weights, tensors, scale), loaded.tokenizer,
                  EngineConfig(dtype="float32", num_pages=64), seed=0)


@pytest.mark.parametrize("name", ["r8-qv-down", "r16-ko-gateup"])
def test_an_adapter_equals_its_merged_weights(real_engine, base_weights, adapters_dir, name,
                                              one_torch_thread):
    tensors, scale = adapters_dir[name]
    merged = _merged_engine(base_weights, tensors, scale)
    prompt = real_engine.tokenizer.encode(PROMPT)

    with_adapter = real_engine.prompt_logits(prompt, all_positions=True, adapter=name)
    expected = merged.prompt_logits(prompt, all_positions=True)
    base = real_engine.prompt_logits(prompt, all_positions=True)
    assert relative_error(with_adapter, expected) <= RELATIVE
    assert relative_error(base, expected) > 100 * RELATIVE        # the adapter does change them

    tokens = real_engine.generate_greedy_batch([prompt], NUM_NEW_TOKENS, adapters=[name])[0]
    assert tokens == merged.generate_greedy(prompt, NUM_NEW_TOKENS)
    # the decode steps (one row, the whole-batch path) agree too, not only the prefill
    decoded = real_engine.prompt_logits(prompt + tokens[:-1], adapter=name)
    assert relative_error(decoded, merged.prompt_logits(prompt + tokens[:-1])) <= RELATIVE


def test_a_mixed_batch_equals_each_request_alone(real_engine, adapters_dir, one_torch_thread):
    """No adapter and three adapters (one of them twice) in one batch: each request's logits and
    greedy tokens are those it gets alone."""
    tokenizer = real_engine.tokenizer
    texts = [PROMPT, "Once upon a time", "def add(a, b):", "Paris is the capital of",
             "The quick brown fox jumps over"]
    prompts = [tokenizer.encode(text) for text in texts]
    adapters = [None, "r8-qv-down", "r16-ko-gateup", "r8-qv-down", "r16-all"]
    assert len({len(p) for p in prompts}) > 1          # ragged groups: the padded rows' path

    together = batch_logits(real_engine, prompts, adapters)
    for prompt, adapter, logits in zip(prompts, adapters, together):
        alone = batch_logits(real_engine, [prompt], [adapter])[0]
        assert relative_error(logits, alone) <= RELATIVE, adapter

    tokens = real_engine.generate_greedy_batch(prompts, NUM_NEW_TOKENS, adapters=adapters)
    for prompt, adapter, got in zip(prompts, adapters, tokens):
        assert got == real_engine.generate_greedy_batch([prompt], NUM_NEW_TOKENS,
                                                        adapters=[adapter])[0], adapter
    assert len({tuple(t) for t in tokens[:3]}) > 1     # the adapters lead somewhere different


def test_an_unregistered_adapter_fails_its_request_alone(real_engine):
    prompt = real_engine.tokenizer.encode(PROMPT)
    request = ForwardRequest(tuple(prompt), tuple(range(len(prompt))), (0,), len(prompt), (0,),
                             (GREEDY,), adapter="never-registered")
    with pytest.raises(RequestError) as error:
        real_engine.forward(ForwardBatch((request,)))
    assert (error.value.request_index, error.value.field) == (0, "adapter")
    assert real_engine.generate_greedy(prompt, 2)          # the engine serves the next batch


def test_a_chunked_pass_keeps_its_adapter():
    request = ForwardRequest(tuple(range(10)), tuple(range(10)), (0, 1, 2), 2, (9,), (GREEDY,),
                             adapter="x")
    first, rest, _, _ = split_request(request, 4, page_size=4)
    assert first.adapter == rest.adapter == "x"


def test_decode_step_carries_the_adapter():
    step = ForwardRequest.decode_step(5, 3, (0,), 4, GREEDY, adapter="x")
    assert step == ForwardRequest((5,), (3,), (0,), 4, (0,), (GREEDY,), adapter="x")
    assert ForwardRequest.decode_step(5, 3, (0,), 4, GREEDY).adapter is None


# ---- validation of the files against the base model --------------------------------------------

def _tiny_adapter(tmp_path: Path, name="a", rank=4, modules=("q_proj", "down_proj"), seed=0,
                  layers=None) -> Path:
    return save_adapter(tmp_path / name, rank, 2 * rank,
                        random_tensors(TINY, rank, modules, seed, layers=layers))


def test_a_valid_adapter_is_described(tmp_path):
    spec = read_adapter_spec("a", _tiny_adapter(tmp_path, layers=[1]), TINY)
    assert spec.rank == 4 and spec.scale == 2.0
    assert spec.targets == ((), ("q_proj", "down_proj"))
    assert spec.num_parameters == 4 * (64 + 64) + 4 * (96 + 64)


def test_a_wrong_shape_names_the_tensor(tmp_path):
    tensors = random_tensors(TINY, 4, ("k_proj",), 0)
    a, b = tensors[(1, "k_proj")]
    tensors[(1, "k_proj")] = (a, torch.zeros(64, 4))             # k_proj's out is 2 * 16 = 32
    path = save_adapter(tmp_path / "bad", 4, 8, tensors)
    with pytest.raises(AdapterError) as error:
        read_adapter_spec("bad", path, TINY)
    assert error.value.tensor == tensor_name(1, "k_proj", "B")
    assert "(64, 4)" in str(error.value) and "(32, 4)" in str(error.value)


def test_a_missing_b_is_named(tmp_path):
    from safetensors.torch import save_file

    path = _tiny_adapter(tmp_path, modules=("q_proj",))
    a, b = random_tensors(TINY, 4, ("q_proj",), 0)[(0, "q_proj")]
    save_file({tensor_name(0, "q_proj", "A"): a, tensor_name(1, "q_proj", "A"): a.clone(),
               tensor_name(1, "q_proj", "B"): b}, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="is missing") as error:
        read_adapter_spec("a", path, TINY)
    assert error.value.tensor == tensor_name(0, "q_proj", "B")


def test_a_layer_the_model_lacks_is_named(tmp_path):
    tensors = random_tensors(TINY, 4, ("q_proj",), 0)
    tensors[(5, "q_proj")] = tuple(t.clone() for t in tensors[(0, "q_proj")])
    path = save_adapter(tmp_path / "bad", 4, 8, tensors)
    with pytest.raises(AdapterError, match="layer 5") as error:
        read_adapter_spec("bad", path, TINY)
    assert error.value.tensor in (tensor_name(5, "q_proj", "A"), tensor_name(5, "q_proj", "B"))


@pytest.mark.parametrize("key, value, words", [
    ("target_modules", ["q_proj", "lm_head"], "lm_head"),
    ("r", 0, "r must be"),
    ("use_dora", True, "use_dora"),
    ("peft_type", "IA3", "IA3"),
    ("target_modules", "q_proj|v_proj", "target_modules"),
])
def test_bad_configs_are_refused(tmp_path, key, value, words):
    path = _tiny_adapter(tmp_path)
    config = json.loads((path / CONFIG_FILE).read_text())
    config[key] = value
    (path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=words):
        read_adapter_spec("a", path, TINY)


def test_a_tensor_of_an_undeclared_module_is_refused(tmp_path):
    path = _tiny_adapter(tmp_path, modules=("q_proj", "v_proj"))
    config = json.loads((path / CONFIG_FILE).read_text())
    config["target_modules"] = ["q_proj"]
    (path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(AdapterError) as error:
        read_adapter_spec("a", path, TINY)
    assert "v_proj" in error.value.tensor


def test_not_a_safetensors_file_is_refused(tmp_path):
    path = _tiny_adapter(tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(AdapterError, match="safetensors"):
        read_adapter_spec("a", path, TINY)


# ---- the store: names, budget, least recently used ---------------------------------------------

def _requests(*adapters):
    return [ForwardRequest((1, 2), (0, 1), (i,), 2, (1,), (GREEDY,), adapter=adapter)
            for i, adapter in enumerate(adapters)]


def test_the_store_keeps_the_most_recent_adapters_within_its_budget(tmp_path):
    paths = [_tiny_adapter(tmp_path, name, seed=i) for i, name in enumerate("abc")]
    one = read_adapter_spec("a", paths[0], TINY).resident_bytes(4)
    store = AdapterStore(TINY, torch.float32, torch.device("cpu"), memory_bytes=2 * one + one // 2)
    for name, path in zip("abc", paths):
        store.register(name, path)
    assert store.resident_names == ()                        # loaded on first use only
    store.prepare(_requests("a"))
    store.prepare(_requests("b", None))
    store.prepare(_requests("a"))
    assert store.resident_names == ("b", "a")
    store.prepare(_requests("c"))
    assert store.resident_names == ("a", "c")                # b was the least recently used
    assert store.resident_bytes == 2 * one
    # a batch naming more than the budget holds still runs; the surplus goes at the next batch
    store.prepare(_requests("a", "b", "c"))
    assert set(store.resident_names) == {"a", "b", "c"}
    store.prepare(_requests("b"))
    assert len(store.resident_names) == 2 and "b" in store.resident_names
    assert store.prepare(_requests(None, None)) is None


def test_the_store_refuses_bad_names_and_oversized_adapters(tmp_path):
    path = _tiny_adapter(tmp_path)
    store = AdapterStore(TINY, torch.float32, torch.device("cpu"), memory_bytes=1024)
    with pytest.raises(AdapterError, match="budget"):
        store.register("a", path)
    store = AdapterStore(TINY, torch.float32, torch.device("cpu"), memory_bytes=2**20)
    for bad in ("", "base:lora", "../x", "a" * 65, 7):
        with pytest.raises(AdapterError, match="name"):
            store.register(bad, path)
    store.register("a", path)
    with pytest.raises(RequestError) as error:
        store.prepare(_requests(None, "b"))
    assert (error.value.request_index, error.value.field) == (1, "adapter")
    assert store.unregister("a") and not store.unregister("a")


def test_scoped_adapters_resolve_within_their_scope(tmp_path):
    """A tenant's adapter ("scope/name") is found by its scope alone, before an unscoped one of
    the same name; other scopes see only the unscoped ones."""
    path = _tiny_adapter(tmp_path)
    store = AdapterStore(TINY, torch.float32, torch.device("cpu"), memory_bytes=2**20)
    store.register("shared", path)
    info = store.register("mine", path, scope="alice")
    assert info.name == "alice/mine" and "alice/mine" in store
    store.register("shared", path, scope="alice")
    assert store.resolve("mine", "alice") == "alice/mine"
    assert store.resolve("shared", "alice") == "alice/shared"
    assert store.resolve("shared", "bob") == "shared"
    assert store.resolve("mine", "bob") is None and store.resolve("mine") is None
    assert store.resolve("alice/mine", "bob") is None          # not a name: no reaching across
    assert store.names_in("alice") == ("mine", "shared") and store.names_in("bob") == ("shared",)
    assert store.prepare(_requests("alice/mine")) is not None
    with pytest.raises(AdapterError, match="scope"):
        store.register("x", path, scope="a/b")
    assert store.unregister("mine", scope="alice") and store.resolve("mine", "alice") is None


def test_the_store_fails_a_request_whose_adapter_files_went_bad(tmp_path):
    path = _tiny_adapter(tmp_path)
    store = AdapterStore(TINY, torch.float32, torch.device("cpu"), memory_bytes=2**20)
    store.register("a", path)
    (path / "adapter_model.safetensors").write_bytes(b"junk")
    with pytest.raises(RequestError) as error:
        store.prepare(_requests(None, None, "a"))
    assert error.value.request_index == 2 and "safetensors" in error.value.reason


def test_an_adapter_with_non_finite_values_fails_its_request(tmp_path):
    tensors = random_tensors(TINY, 4, ("o_proj",), 0)
    a, b = tensors[(1, "o_proj")]
    b[3, 2] = float("nan")
    path = save_adapter(tmp_path / "nan", 4, 8, tensors)
    store = AdapterStore(TINY, torch.float32, torch.device("cpu"), memory_bytes=2**20)
    store.register("nan", path)                  # the header is fine: found when loaded
    with pytest.raises(RequestError) as error:
        store.prepare(_requests("nan"))
    assert tensor_name(1, "o_proj", "B") in error.value.reason and "finite" in error.value.reason
    assert store.resident_names == ()


def test_engine_config_checks_the_adapter_budget():
    with pytest.raises(ValueError, match="adapter_memory_mb"):
        EngineConfig(adapter_memory_mb=0)


def test_tiny_engine_with_an_adapter_matches_merged_weights(tmp_path, tiny_model, make_tiny_engine):
    """The tiny model: every target, layers 0 only, through the whole engine."""
    from engine.engine import Engine
    from tests.engine.conftest import tiny_weights

    rank, modules = 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    tensors = random_tensors(TINY, rank, modules, 4, sigma=0.2, layers=[0])
    path = save_adapter(tmp_path / "t", rank, 8, tensors)
    engine = make_tiny_engine()
    engine.adapters.register("t", path)
    merged = Engine(TINY, merged_weights(tiny_weights(tiny_model), tensors, 1.0), None,
                    EngineConfig(page_size=4, num_pages=64, dtype="float32"), seed=0)
    prompt = [3, 14, 15, 92, 65, 35]
    assert relative_error(engine.prompt_logits(prompt, True, "t"),
                          merged.prompt_logits(prompt, True)) <= RELATIVE
    assert relative_error(engine.prompt_logits(prompt, True),
                          merged.prompt_logits(prompt, True)) > 100 * RELATIVE
