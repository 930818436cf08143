"""Frozen configuration of the model and of the engine, validated once at the boundary."""
from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "quantized")
KV_DTYPES = ("auto", "float32", "float16")
# padded batch sizes whose pure decode steps are captured as CUDA graphs (engine.cuda_graphs)
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family model, read from the model file (never hard-coded)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine lays out memory and batches. Validated once, here.

    The number of KV pages is `num_pages` when given, else derived from `kv_memory_mb`.
    """

    page_size: int = 16              # tokens per KV page
    kv_memory_mb: int = 512          # budget for the page pool when num_pages is None
    num_pages: int | None = None     # explicit page count (overrides kv_memory_mb)
    max_batch_tokens: int = 4096     # most input tokens in one forward pass
    max_pass_tokens: int | None = None   # longer batches run as consecutive passes of at most
                                         # this many tokens (None: 256 on the CPU, no limit on CUDA)
    dtype: str = "auto"              # auto | float32 | bfloat16 | quantized (GGUF blocks, CPU)
    kv_dtype: str = "auto"           # auto | float32 | float16 (CPU): the KV pages' dtype
    act8: bool = True                # GGUF blocks: 8-bit activation blocks (vpdpbusd) where
                                     # measured faster, as llama.cpp's CPU kernels do (False:
                                     # 16-bit always: slower batches, closer to float32)
    device: str = "auto"             # cpu | cuda | auto (cuda when available)
    attention_backend: str = "auto"  # auto | torch | flashinfer
    cuda_graphs: bool = True         # replay pure decode steps from CUDA graphs (flashinfer only)
    cuda_graph_batch_sizes: tuple[int, ...] = CUDA_GRAPH_BATCH_SIZES   # strictly increasing
    adapter_memory_mb: int = 512     # LoRA adapters kept resident up to this (least recent go)

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        if self.kv_memory_mb <= 0:
            raise ValueError(f"kv_memory_mb must be positive, got {self.kv_memory_mb}")
        if type(self.act8) is not bool:
            raise ValueError(f"act8 must be true or false, got {self.act8!r}")
        if type(self.adapter_memory_mb) is not int or self.adapter_memory_mb <= 0:
            raise ValueError(f"adapter_memory_mb must be a positive integer, "
                             f"got {self.adapter_memory_mb!r}")
        if self.max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {self.max_batch_tokens}")
        if self.max_pass_tokens is not None and self.max_pass_tokens <= 0:
            raise ValueError(f"max_pass_tokens must be positive, got {self.max_pass_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"attention_backend must be auto, torch or flashinfer, "
                             f"got {self.attention_backend!r}")
        sizes = tuple(self.cuda_graph_batch_sizes)
        if (not sizes or any(type(b) is not int or b <= 0 for b in sizes)
                or list(sizes) != sorted(set(sizes))):
            raise ValueError(f"cuda_graph_batch_sizes must be positive ints, strictly increasing, "
                             f"got {self.cuda_graph_batch_sizes!r}")
        object.__setattr__(self, "cuda_graph_batch_sizes", sizes)   # a list given: kept a tuple
