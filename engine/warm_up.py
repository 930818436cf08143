"""Running every kind of batch once before a server reports ready, so no request pays a first use.

On CUDA, FlashInfer compiles each kernel module the first time it is used (docs/cuda.md: ~15-20 s
per attention module, ~90 s for the sampling module on a 16-core machine), and which module runs
depends on the batch: unmasked prefills, masked prefills (a different module on Hopper), pure
decode batches, sampling. `warm_up(engine, progress)` runs one tiny batch of each kind through the
engine's own forward pass and sampler type, timing each step and reporting it through `progress`
as it ends. The CPU has nothing to compile; there it is a few small passes.

Contract:
- call it after the engine is built and before anything hands out its KV pages (a host's page
  pool, `Engine.generate_greedy`): it writes K/V into the pool's first pages (as few as the
  batches need, at most `pages_needed(page_size)`), which hold nothing afterwards;
- it changes nothing else the engine shows: not its statistics (it calls `Engine.logits`, not
  `forward`), nor its sampler's random stream (it samples with a fresh sampler of the same kind,
  whose kernels are the engine's);
- a step that fails raises `WarmUpError` naming the step, with the engine's error as its cause:
  a kernel that cannot run in the warm-up would fail every request of that kind.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.batch import Distribution, ForwardBatch, ForwardRequest, SamplerSpec
from engine.paging import last_page_len, num_pages_needed
from engine.sampling import Sampler
from engine.sampling_cuda import CudaSampler

__all__ = ["WarmUpError", "WarmUpStep", "WarmUpReport", "warm_up", "needs_warm_up",
           "pages_needed", "STEP_NAMES"]

LONG_PROMPT = 20     # > the torch backend's MAX_PADDED_Q: its one-request-per-call path runs too
SHORT_PROMPT = 5     # the torch backend's padded short-request path
STEP_NAMES = ("prefill", "masked prefill", "decode", "sampling")

# greedy, the fused top-k/top-p rows (CudaSampler: unseeded, no min_p), and the rows the reference
# sampler takes (min_p, seeded, distributions)
WARM_UP_SAMPLERS = (
    SamplerSpec(),
    SamplerSpec(kind="sample", temperature=0.7, top_k=40, top_p=0.9),
    SamplerSpec(kind="sample", temperature=1.0, top_p=0.8),
    SamplerSpec(kind="sample", temperature=1.0, top_k=5),
    SamplerSpec(kind="sample", temperature=0.8, min_p=0.05),
    SamplerSpec(kind="sample", temperature=1.0, seed=1),
    SamplerSpec(kind="distribution", num_top=5),
)


class WarmUpError(RuntimeError):
    """A warm-up step failed; `step` names it (one of STEP_NAMES), the cause is chained."""

    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(f"warming the engine's kernels failed at the {step} step: "
                         f"{type(error).__name__}: {error}")
        self.step = step


@dataclass(frozen=True)
class WarmUpStep:
    """One step: its name and how long it took, in seconds (device work included)."""

    name: str
    seconds: float


@dataclass(frozen=True)
class WarmUpReport:
    """What ran: the steps in order, and which kernels they warmed ("flashinfer" or "torch")."""

    attention_backend: str
    steps: tuple[WarmUpStep, ...]

    @property
    def total_s(self) -> float:
        return sum(step.seconds for step in self.steps)


def needs_warm_up(engine) -> bool:
    """True when the engine compiles kernels on first use (CUDA), where a start without the
    warm-up makes the first requests of each kind wait for the compiler."""
    return engine.device.type == "cuda"


def pages_needed(page_size: int) -> int:
    """Pages of the pool the warm-up writes (pages 0..n-1)."""
    return (num_pages_needed(LONG_PROMPT + 1, page_size)
            + num_pages_needed(SHORT_PROMPT + 1, page_size))


def _token_ids(count: int, first: int, vocab_size: int) -> tuple[int, ...]:
    return tuple((first + 7 * i) % vocab_size for i in range(count))


def _request(num_tokens: int, kv_len: int, page_ids: tuple[int, ...], page_size: int,
             vocab_size: int, first_token: int,
             mask: tuple[tuple[int, ...], ...] | None = None) -> ForwardRequest:
    """The last `num_tokens` of a sequence of kv_len slots on the first pages of `page_ids`,
    one greedy output at its last token."""
    return ForwardRequest(
        token_ids=_token_ids(num_tokens, first_token, vocab_size),
        positions=tuple(range(kv_len - num_tokens, kv_len)),
        page_ids=page_ids[:num_pages_needed(kv_len, page_size)],
        last_page_len=last_page_len(kv_len, page_size), output_indices=(num_tokens - 1,),
        samplers=(SamplerSpec(),), mask=mask)


def _skip_one(kv_len: int) -> tuple[int, ...]:
    """A run-length mask row over kv_len that skips slot 1 (never a whole row: slot 0 stays)."""
    return (1, 1, kv_len - 2) if kv_len > 2 else (kv_len,)


def _batches(page_size: int, num_pages: int,
             vocab_size: int) -> dict[str, ForwardBatch]:
    """The warm-up's forward batches by step name, sized to the pool: a long and a short
    sequence (only the long one when the pool holds fewer pages; a shorter one when it must)."""
    long_len, with_short = LONG_PROMPT, pages_needed(page_size) <= num_pages
    if not with_short:
        long_len = max(2, min(LONG_PROMPT, num_pages * page_size - 1))
    long_pages = tuple(range(num_pages_needed(long_len + 1, page_size)))
    short_pages = tuple(range(len(long_pages), len(long_pages)
                              + num_pages_needed(SHORT_PROMPT + 1, page_size)))

    def long(num_tokens: int, kv_len: int, first: int, mask=None) -> ForwardRequest:
        return _request(num_tokens, kv_len, long_pages, page_size, vocab_size, first, mask)

    def short(num_tokens: int, kv_len: int, first: int) -> ForwardRequest:
        return _request(num_tokens, kv_len, short_pages, page_size, vocab_size, first)

    prefill = [long(long_len, long_len, 11)] + ([short(SHORT_PROMPT, SHORT_PROMPT, 13)]
                                                if with_short else [])
    masked = [long(long_len, long_len, 17, mask=(_skip_one(long_len),) * long_len)]
    decode = [long(1, long_len + 1, 19)] + ([short(1, SHORT_PROMPT + 1, 23)] if with_short else [])
    return {"prefill": ForwardBatch(tuple(prefill)),
            "masked prefill": ForwardBatch(tuple(masked)),
            "decode": ForwardBatch(tuple(decode))}


def _sampler_like(engine) -> Sampler | CudaSampler:
    """A fresh sampler of the engine's sampler's kind (its own random stream)."""
    if isinstance(engine.sampler, CudaSampler):
        return CudaSampler(engine.sampler.device, seed=0,
                           use_flashinfer=engine.sampler.uses_flashinfer)
    return Sampler(seed=0)


def _sample(sampler: Sampler | CudaSampler, logits: torch.Tensor,
            specs: Sequence[SamplerSpec]) -> list[int | Distribution]:
    """Every spec on rows of `logits` [R, vocab] (rows repeat as needed)."""
    rows = torch.arange(len(specs), device=logits.device) % logits.shape[0]
    return sampler.sample(logits[rows], list(specs), positions=[1] * len(specs))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(engine, progress: Callable[[str], None] = lambda line: None) -> WarmUpReport:
    """Run a tiny batch of each kind (prefill, masked prefill, decode, then every sampler kind on
    the decode logits) through `engine` (an engine.Engine); `progress` gets one line per step as
    it ends ("warming FlashInfer kernels: decode (12.3 s)"). See the module contract."""
    backend = engine.attention.name
    label = "FlashInfer" if backend == "flashinfer" else f"{backend} {engine.device.type}"
    batches = _batches(engine.page_size, engine.num_pages, engine.model_config.vocab_size)
    steps: list[WarmUpStep] = []
    logits = None

    def step(name: str, run: Callable[[], object]) -> object:
        start = time.perf_counter()
        try:
            result = run()
            _synchronize(engine.device)
        except Exception as error:   # noqa: BLE001 - any failure of a step is reported as one
            raise WarmUpError(name, error) from error
        steps.append(WarmUpStep(name, time.perf_counter() - start))
        progress(f"warming {label} kernels: {name} ({steps[-1].seconds:.1f} s)")
        return result

    with torch.inference_mode():
        for name, batch in batches.items():
            logits = step(name, lambda batch=batch: engine.logits(batch))    # [R, vocab]
        sampler = _sampler_like(engine)
        step("sampling", lambda: _sample(sampler, logits, WARM_UP_SAMPLERS))
    report = WarmUpReport(backend, tuple(steps))
    progress(f"{label} kernels warm in {report.total_s:.1f} s")
    return report
