"""Load a llama.cpp GGUF file (architecture `llama`) into HF-named float32 / bfloat16 weights,
or (keep_quantized) with its quantized matrices left as their GGUF blocks (QuantizedTensor).

Every hyperparameter comes from the file's metadata. llama.cpp stores Q and K with the rows of
each head interleaved for its RoPE ([re0, im0, re1, im1, ...]); HF keeps halves ([re..., im...]).
We undo that permutation on the raw quantized rows (whole rows, so blocks stay intact) before
dequantizing, which costs a row gather of the small quantized bytes instead of the floats.
"""
from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from engine.engine_config import ModelConfig
from engine.loaders.common import LoadedModel, ModelLoadError, check_weight_shapes, torch_dtype
from engine.loaders.dequant import SUPPORTED_QTYPES, dequantize
from engine.loaders.gguf_reader import GGUFFile, GGUFTensorInfo, read_gguf
from engine.quant import KERNEL_QTYPES, QuantizedTensor
from engine.tokenizer import Tokenizer

__all__ = ["load_gguf", "gguf_model_config", "gguf_to_hf_name"]

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_DERIVED_TENSORS = ("rope_freqs.weight",)   # llama.cpp's precomputed RoPE factors; see rope_scaling


def gguf_to_hf_name(name: str) -> str | None:
    """The HF Llama parameter name of a GGUF tensor name; None when it has none."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_PATTERN.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    """ModelConfig from the metadata of a `llama` GGUF; ModelLoadError for anything else."""
    fields, path = gguf.fields, gguf.path
    architecture = fields.get("general.architecture")
    if architecture != "llama":
        raise ModelLoadError(path, f"unsupported architecture {architecture!r} (only 'llama' is supported)")

    def required(key: str) -> Any:
        if key not in fields:
            raise ModelLoadError(path, f"metadata key {key!r} is missing")
        return fields[key]

    hidden_size = int(required("llama.embedding_length"))
    num_heads = int(required("llama.attention.head_count"))
    head_dim = int(fields.get("llama.attention.key_length", hidden_size // num_heads))
    rope_dims = int(fields.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(path, f"partial rotary embedding ({rope_dims} of {head_dim} dims) "
                                   "is not supported")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else int(required("llama.vocab_size"))
    has_output = any(tensor.name == "output.weight" for tensor in gguf.tensors)
    try:
        return ModelConfig(
            name=str(fields.get("general.name") or path.stem),
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(required("llama.feed_forward_length")),
            num_layers=int(required("llama.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(fields.get("llama.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position=int(required("llama.context_length")),
            rope_theta=float(fields.get("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(required("llama.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings=not has_output,
            rope_scaling=_rope_scaling(fields),
        )
    except ValueError as error:
        raise ModelLoadError(path, f"invalid hyperparameters: {error}") from None


def _rope_scaling(fields: dict[str, Any]) -> dict | None:
    """`llama.rope.scaling.*` metadata as an HF-style dict, or None when the file has none."""
    prefix = "llama.rope.scaling."
    scaling = {key[len(prefix):]: value for key, value in fields.items() if key.startswith(prefix)}
    if not scaling or scaling.get("type", "none") == "none":
        return None
    scaling["rope_type"] = scaling.pop("type", "linear")
    return scaling


def load_gguf(path: str | Path, dtype: torch.dtype | str = torch.float32,
              progress: bool = True, keep_quantized: bool = False) -> LoadedModel:
    """Load the GGUF at `path`: config, HF-named weights of `dtype`, and its tokenizer.

    keep_quantized: matrices of a type the C kernels read (engine.quant.KERNEL_QTYPES) stay as
    QuantizedTensor (a copy of their blocks, Q/K rows in HF order); the rest become `dtype`.

    Raises ModelLoadError (naming the file and the reason) for a missing, truncated or corrupt
    file, an architecture other than llama, or a quantization type we cannot dequantize.
    """
    path = Path(path)
    dtype = torch_dtype(dtype)
    if not path.is_file():
        raise ModelLoadError(path, "no such file" if not path.exists() else "not a regular file")
    gguf = read_gguf(path)
    config = gguf_model_config(gguf)
    tokenizer = _gguf_tokenizer(gguf)
    named = _named_tensors(gguf)
    check_weight_shapes(path, config, {name: tuple(reversed(t.shape)) for name, t in named.items()})
    with _ProgressBar(progress, len(named), path.name) as advance, _single_threaded():
        weights = {}
        for hf_name, tensor in named.items():
            weights[hf_name] = _convert_tensor(tensor, config, dtype, keep_quantized)
            gguf.release_pages(tensor)
            advance()
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path))


def _gguf_tokenizer(gguf: GGUFFile) -> Tokenizer | None:
    """The file's tokenizer (None when it has no vocabulary), built before the weights so that
    an unsupported one fails fast."""
    if "tokenizer.ggml.tokens" not in gguf.fields:
        return None
    try:
        return Tokenizer.from_gguf_fields(gguf.fields)
    except (ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(gguf.path, f"cannot build its tokenizer: {error}") from None


def _named_tensors(gguf: GGUFFile) -> dict[str, GGUFTensorInfo]:
    """HF name -> tensor, checking names and quantization types before any work is done."""
    named: dict[str, GGUFTensorInfo] = {}
    for tensor in gguf.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            if tensor.name in _DERIVED_TENSORS:
                continue
            raise ModelLoadError(gguf.path, f"unexpected tensor {tensor.name!r} in a llama model")
        if tensor.qtype not in SUPPORTED_QTYPES:
            raise ModelLoadError(gguf.path, f"unsupported quantization type {tensor.qtype.name} "
                                            f"of tensor {tensor.name!r}")
        named[hf_name] = tensor
    return named


def _convert_tensor(tensor: GGUFTensorInfo, config: ModelConfig, dtype: torch.dtype,
                    keep_quantized: bool) -> torch.Tensor | QuantizedTensor:
    """[out, in] (HF order) for a matrix, [n] for a vector; a matrix's blocks when asked."""
    num_rows = int(np.prod(tensor.shape[1:], dtype=np.int64))   # GGUF shape is [in, out]
    data = tensor.data
    if tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
        is_q = tensor.name.endswith(".attn_q.weight")
        num_heads = config.num_heads if is_q else config.num_kv_heads
        data = _unpermute_rows(data.reshape(num_rows, -1), num_heads).reshape(-1)
    if keep_quantized and tensor.qtype in KERNEL_QTYPES and len(tensor.shape) == 2:
        blocks = torch.from_numpy(np.array(data.reshape(num_rows, -1), copy=True))
        return QuantizedTensor(blocks, tensor.qtype, int(tensor.shape[0]))   # [out, in] values
    values = dequantize(data, tensor.qtype, num_rows, dtype)   # [num_rows, row_len]
    return values.reshape(tuple(reversed(tensor.shape)))


def _unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row interleave of one Q or K matrix (works on any row payload).

    rows:    [num_heads * head_dim, row_bytes], per head rows ordered (pair, re/im)
    returns: same shape, per head rows ordered (re/im, pair), as HF stores them
    """
    num_rows, row_bytes = rows.shape
    head_dim = num_rows // num_heads
    interleaved = rows.reshape(num_heads, head_dim // 2, 2, row_bytes)
    return np.ascontiguousarray(interleaved.swapaxes(1, 2)).reshape(num_rows, row_bytes)


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """Run torch ops on one thread meanwhile. Dequantizing is many small ops; with an OpenMP
    team each is a barrier, and on a busy machine a barrier can wait a whole scheduler slice."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class _ProgressBar:
    """A transient rich progress bar on stderr when asked and stderr is a terminal."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.progress = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
            self.progress = Progress(TextColumn("loading {task.description}"), BarColumn(),
                                     MofNCompleteColumn(), transient=True,
                                     console=Console(stderr=True))
            self.task = self.progress.add_task(label, total=total)

    def __enter__(self) -> Callable[[], None]:
        if self.progress is None:
            return lambda: None
        self.progress.start()
        return lambda: self.progress.advance(self.task)

    def __exit__(self, *exc_info: object) -> None:
        if self.progress is not None:
            self.progress.stop()

