"""Shared engine fixtures: a tiny random Llama (HF naming, with a transformers twin as oracle) and
the real default model loaded once per session in float32."""
from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig, ModelConfig

TINY = ModelConfig(name="tiny-llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position=256,
                   rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def tiny_hf_model(config: ModelConfig = TINY, seed: int = 0):
    """A transformers LlamaForCausalLM with random weights matching `config` (float32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position,
        rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, attn_implementation="eager")
    model = LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():   # norms are ones at init; make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model


def tiny_weights(model) -> dict[str, torch.Tensor]:
    """HF-named weights of a tiny model, without the tied lm_head (as the loaders give them)."""
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    weights.pop("lm_head.weight", None)
    return weights


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_hf_model()


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_model):
    """Factory: a float32 Engine over the tiny model with the given EngineConfig fields."""
    from engine.engine import Engine

    def make(**overrides) -> Engine:
        settings = {"page_size": 4, "num_pages": 64, "dtype": "float32", **overrides}
        return Engine(TINY, tiny_weights(tiny_model), None, EngineConfig(**settings), seed=0)

    return make


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's heavy model tests on one torch thread, then restore the setting.

    On this shared 2-core machine, two OpenMP threads competing with other processes spin at
    barriers and run several times slower than one thread (measured: a 512-token prefill 3.0 s
    with 2 threads vs 1.0 s with 1 under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def real_engine():
    """The default model (SmolLM2-135M GGUF), float32, page_size 16, loaded once."""
    from engine import load_default_engine

    return load_default_engine(dtype="float32", num_pages=512, progress=False, seed=0)


@pytest.fixture(scope="session")
def real_engine_page1():
    """The default model, float32, page_size 1."""
    from engine import load_default_engine

    return load_default_engine(dtype="float32", page_size=1, num_pages=2048, progress=False, seed=0)
