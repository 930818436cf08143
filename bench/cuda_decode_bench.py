"""Decode throughput on CUDA: the FlashInfer backend vs the torch backend, side by side.

    python bench/cuda_decode_bench.py [--batch-sizes 1,32,128] [--context 256] [--steps 32]

For each backend (one engine each, the embedded SmolLM2-135M in bfloat16) and each batch size:
prefill `batch` random prompts of `context` tokens, warm up, then time `steps` decode steps of
the whole batch through `Engine.forward` (greedy sampling included, as the host would call it).
Prints ms per step, generated tokens/s and the ratio FlashInfer / torch (the baseline).
Exits with status 1 and a clear message when CUDA is not available.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from engine.batch import GREEDY, ForwardBatch, ForwardRequest
from engine.paging import last_page_len, num_pages_needed

WARMUP_STEPS = 3


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--backends", default="flashinfer,torch")
    parser.add_argument("--page-size", type=int, default=16)
    return parser.parse_args()


class Sequences:
    """Page bookkeeping of `batch` sequences decoding side by side (pages fixed up front)."""

    def __init__(self, batch: int, max_len: int, page_size: int) -> None:
        self.page_size = page_size
        pages_each = -(-max_len // page_size)
        self.page_ids = [tuple(range(b * pages_each, (b + 1) * pages_each)) for b in range(batch)]
        self.lengths = [0] * batch

    def request(self, b: int, token_ids: list[int]) -> ForwardRequest:
        start, end = self.lengths[b], self.lengths[b] + len(token_ids)
        self.lengths[b] = end
        return ForwardRequest(
            token_ids=tuple(token_ids), positions=tuple(range(start, end)),
            page_ids=self.page_ids[b][:num_pages_needed(end, self.page_size)],
            last_page_len=last_page_len(end, self.page_size),
            output_indices=(len(token_ids) - 1,), samplers=(GREEDY,))


def _prefill(engine, seqs: Sequences, batch: int, context: int, gen: torch.Generator) -> list[int]:
    """Prefill every sequence (as many per pass as max_batch_tokens allows); last tokens."""
    per_pass = max(1, engine.engine_config.max_batch_tokens // context)
    last_tokens = []
    for first in range(0, batch, per_pass):
        requests = []
        for b in range(first, min(batch, first + per_pass)):
            prompt = torch.randint(100, engine.model_config.vocab_size, (context,), generator=gen)
            requests.append(seqs.request(b, prompt.tolist()))
        results = engine.forward(ForwardBatch(tuple(requests)))
        last_tokens += [r.outputs[0] for r in results]
    return last_tokens


def _decode_ms_per_step(engine, batch: int, context: int, steps: int, page_size: int) -> float:
    seqs = Sequences(batch, context + WARMUP_STEPS + steps, page_size)
    tokens = _prefill(engine, seqs, batch, context, torch.Generator().manual_seed(batch))
    elapsed = 0.0
    for step in range(WARMUP_STEPS + steps):
        requests = tuple(seqs.request(b, [tokens[b]]) for b in range(batch))
        torch.cuda.synchronize()
        started = time.perf_counter()
        results = engine.forward(ForwardBatch(requests))   # sampled ids come back: a sync point
        if step >= WARMUP_STEPS:
            elapsed += time.perf_counter() - started
        tokens = [r.outputs[0] for r in results]
    return 1000 * elapsed / steps


def _load(backend: str, num_pages: int, page_size: int):
    from engine import load_default_engine
    from engine.device import FlashInferUnavailable

    try:
        return load_default_engine(device="cuda", dtype="bfloat16", attention_backend=backend,
                                   num_pages=num_pages, page_size=page_size, progress=False, seed=0)
    except (FlashInferUnavailable, ValueError) as err:
        print(f"[{backend}] not run: {err}", file=sys.stderr)
        return None


def main() -> int:
    if not torch.cuda.is_available():
        print("cuda_decode_bench: CUDA is not available on this machine (torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); this benchmark "
              "needs an NVIDIA GPU and `pip install 'pie-serve[cuda]'`.", file=sys.stderr)
        return 1
    args = _parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    backends = args.backends.split(",")
    pages_each = -(-(args.context + WARMUP_STEPS + args.steps) // args.page_size)
    num_pages = max(batch_sizes) * pages_each
    print(f"device: {torch.cuda.get_device_name()}  model: SmolLM2-135M bf16  "
          f"context {args.context}  steps {args.steps}  page_size {args.page_size}")
    ms = {}
    for backend in backends:
        engine = _load(backend, num_pages, args.page_size)
        if engine is None:
            continue
        for batch in batch_sizes:
            ms[backend, batch] = _decode_ms_per_step(engine, batch, args.context, args.steps,
                                                     args.page_size)
        del engine
        torch.cuda.empty_cache()
    print(f"{'batch':>5} {'backend':>10} {'ms/step':>9} {'tok/s':>9} {'vs torch':>9}")
    for batch in batch_sizes:
        for backend in backends:
            if (backend, batch) not in ms:
                continue
            step_ms = ms[backend, batch]
            base = ms.get(("torch", batch))
            ratio = f"{base / step_ms:8.2f}x" if base else "        -"
            print(f"{batch:>5} {backend:>10} {step_ms:>9.2f} {1000 * batch / step_ms:>9.0f} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
