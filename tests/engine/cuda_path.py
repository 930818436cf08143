"""The engine's CUDA code path selected on the CPU: a stand-in `flashinfer` installed and the device
choice forced to (cpu, flashinfer), so Engine builds FlashInferAttention, FlashInfer's fused layer
kernels and the decode graph runner exactly as it does on CUDA (the graphs' `replay` then runs the
captured function eagerly over the same fixed buffers: engine.cuda_graphs)."""
from __future__ import annotations

import importlib
import sys
import types
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

import engine.engine as engine_module
from engine.engine_config import ModelConfig
from tests.engine.flashinfer_stand_in import stand_in_flashinfer
from tests.engine.test_device import _forget_backend_module


# a tiny untied Llama: GQA 4/2, 2 layers
UNTIED = ModelConfig(name="tiny-untied", vocab_size=97, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position=256,
                     rms_norm_eps=1e-6, tie_word_embeddings=False)


@contextmanager
def cuda_path_on_cpu(monkeypatch: pytest.MonkeyPatch,
                     flashinfer: types.ModuleType | None = None) -> Iterator[types.ModuleType]:
    """Install `flashinfer` (default: the stand-in) and make Engine choose it on the CPU."""
    module = flashinfer or stand_in_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    _forget_backend_module()
    choice = types.SimpleNamespace(device=torch.device("cpu"), attention_backend="flashinfer")
    monkeypatch.setattr(engine_module, "choose_device", lambda config: choice)
    try:
        yield importlib.import_module("engine.attention.flashinfer")
    finally:
        _forget_backend_module()


def random_weights(config, seed: int = 0, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """HF-named random float32 weights of a Llama `config` (norms near 1); an lm_head of its own
    unless the config ties it (a tied random model mostly repeats its last input token)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_dim, kv_dim = config.num_heads * d, config.num_kv_heads * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": rand(config.vocab_size, hidden) / scale,
               "model.norm.weight": 1 + rand(hidden)}
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = rand(config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": 1 + rand(hidden),
            p + "post_attention_layernorm.weight": 1 + rand(hidden),
            p + "self_attn.q_proj.weight": rand(q_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        })
    return weights
