"""What every loader returns, the one error type they raise, and the weight names they produce."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from engine.engine_config import ModelConfig

if TYPE_CHECKING:
    from engine.quant import QuantizedTensor
    from engine.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "check_weight_shapes", "expected_weight_shapes",
           "torch_dtype"]


class ModelLoadError(ValueError):
    """A model file or directory that cannot be loaded; the message names the path and the reason."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"cannot load model {str(path)!r}: {reason}")
        self.path = str(path)
        self.reason = reason


@dataclass(frozen=True)
class LoadedModel:
    """A Llama-family model ready for the engine.

    weights: Hugging Face Llama parameter names -> tensors shaped as in HF ([out, in] for
             linear layers), Q/K rows in HF order; `lm_head.weight` only when the embeddings
             are not tied. All tensors have the dtype asked of the loader, except matrices
             kept as GGUF blocks (engine.quant.QuantizedTensor) when the loader was asked to.
    tokenizer: None when the checkpoint carries no tokenizer.
    """

    config: ModelConfig
    weights: dict[str, "torch.Tensor | QuantizedTensor"]
    tokenizer: "Tokenizer | None"
    source: str


_LAYER_WEIGHTS = (
    "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj",
)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF shape of every weight of `config` ([out_features, in_features] for linears)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    per_layer = {
        "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
        "self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
        "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for layer in range(config.num_layers):
        for part, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{part}.weight"] = shape
    return shapes


def check_weight_shapes(path: object, config: ModelConfig,
                        shapes: Mapping[str, Sequence[int]]) -> None:
    """Raise ModelLoadError naming the first missing, unexpected or misshapen weight.

    shapes: HF weight name -> its shape ([out, in] for a linear), as found in the file.
    """
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ModelLoadError(path, f"missing weight {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise ModelLoadError(path, f"unexpected weight {unexpected[0]!r} for a Llama model")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(path, f"weight {name!r} has shape {tuple(shapes[name])}, "
                                       f"expected {shape} from the model's hyperparameters")


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """float32 or bfloat16, given as a torch dtype or its name; ValueError otherwise."""
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, dtype)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"loaders produce float32 or bfloat16 weights, got {dtype!r}")
    return dtype
