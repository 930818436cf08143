"""Write tiny Llama GGUF files for loader tests (weights given in HF names and HF row order)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

TINY = dict(hidden=64, intermediate=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab=40)
_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_hf_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights of the TINY config, HF names and shapes."""
    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads = TINY["hidden"], TINY["intermediate"], TINY["num_heads"], TINY["num_kv_heads"]
    head_dim = hidden // heads
    shapes = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
              "self_attn.q_proj": (heads * head_dim, hidden),
              "self_attn.k_proj": (kv_heads * head_dim, hidden),
              "self_attn.v_proj": (kv_heads * head_dim, hidden),
              "self_attn.o_proj": (hidden, heads * head_dim), "mlp.gate_proj": (inter, hidden),
              "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    weights = {"model.embed_tokens.weight": rng.standard_normal((TINY["vocab"], hidden)),
               "model.norm.weight": rng.standard_normal(hidden)}
    if not tied:
        weights["lm_head.weight"] = rng.standard_normal((TINY["vocab"], hidden))
    for layer in range(TINY["num_layers"]):
        for part, shape in shapes.items():
            weights[f"model.layers.{layer}.{part}.weight"] = rng.standard_normal(shape)
    return {name: value.astype(np.float32) for name, value in weights.items()}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (the loader must undo it)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_PARTS[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], *, arch: str = "llama",
                    matrix_type: GGMLQuantizationType = GGMLQuantizationType.F32,
                    types: dict[str, GGMLQuantizationType] | None = None,
                    tokenizer_model: str | None = None) -> Path:
    """A GGUF of `weights` (HF order; Q/K get llama.cpp's permutation), matrices stored as
    `matrix_type` unless `types` (HF name -> type) says otherwise; vectors stay F32.
    With `tokenizer_model`, a vocabulary of single bytes (plus merges for 'gpt2') is written."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-test-llama")
    writer.add_block_count(TINY["num_layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["intermediate"])
    writer.add_head_count(TINY["num_heads"])
    writer.add_head_count_kv(TINY["num_kv_heads"])
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY["vocab"])
    if tokenizer_model is not None:
        _add_tokenizer(writer, tokenizer_model)
    for hf_name, value in weights.items():
        if hf_name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, TINY["num_heads"])
        elif hf_name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, TINY["num_kv_heads"])
        qtype = (types or {}).get(hf_name, matrix_type if value.ndim == 2 else GGMLQuantizationType.F32)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(hf_name), value)
        else:
            writer.add_tensor(gguf_name(hf_name), quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: GGUFWriter, model: str) -> None:
    """TINY["vocab"] tokens: '<eos>', then letters and their merges ('ab', 'Ġa', ...)."""
    letters = [chr(ord("a") + index) for index in range(12)]
    merges = ["a b", "Ġ a", "Ġ b", "c d"]
    tokens = ["<eos>", "Ġ", *letters, *(merge.replace(" ", "") for merge in merges)]
    tokens += [f"<unused{index}>" for index in range(TINY["vocab"] - len(tokens))]
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_eos_token_id(0)
    if model == "gpt2":
        writer.add_token_merges(merges)
