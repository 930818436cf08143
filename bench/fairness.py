"""Fair batches under a prefill hog, on the real engine (scheduler + engine, no Wasm).

A polite owner decodes `--steps` tokens one pass at a time (each pass waits for the previous);
a hog owner keeps `--hog-queues` high-priority passes of `--hog-tokens` tokens queued the whole
time. The polite owner's time is measured alone (the baseline) and beside the hog with
max_tokens_per_owner = max_batch_tokens (fair order, no chunking) and = `--chunk` (fair order and
chunked prefills). Prints the times and the ratios to the baseline; `--json` prints them as JSON.

Run from the repo root: .venv/bin/python bench/fairness.py [--json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

import torch  # noqa: E402

from engine import load_default_engine  # noqa: E402
from engine.batch import ForwardRequest, SamplerSpec  # noqa: E402
from host.scheduling.scheduler import BatchScheduler, SchedulerPolicy  # noqa: E402
from host.scheduling.work import PreparedForward  # noqa: E402

PAGE_SIZE = 16


def _pass(token_ids: list[int], num_context: int, first_page: int) -> ForwardRequest:
    """A pass of `token_ids` after `num_context` slots, on pages from `first_page` on."""
    kv_len = num_context + len(token_ids)
    num_pages = -(-kv_len // PAGE_SIZE)
    return ForwardRequest(tuple(token_ids), tuple(range(num_context, kv_len)),
                          tuple(range(first_page, first_page + num_pages)),
                          kv_len - (num_pages - 1) * PAGE_SIZE, (len(token_ids) - 1,),
                          (SamplerSpec(),))


def polite_time(scheduler: BatchScheduler, steps: int) -> float:
    """Seconds for a prefill of 8 tokens and `steps` greedy decode passes (pages 0..)."""
    started = time.perf_counter()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    token = scheduler.submit_forward(("polite", 0), "normal",
                                     PreparedForward(_pass(tokens, 0, 0))).result().outputs[0]
    for step in range(steps):
        tokens.append(token)
        request = _pass([token], len(tokens) - 1, 0)
        token = scheduler.submit_forward(("polite", 0), "normal",
                                         PreparedForward(request)).result().outputs[0]
    return time.perf_counter() - started


def run_hog(scheduler: BatchScheduler, stop: threading.Event, num_tokens: int,
            num_queues: int, first_page: int) -> None:
    """Keep `num_queues` high-priority passes of `num_tokens` queued until `stop`."""
    pages_per_pass = -(-num_tokens // PAGE_SIZE)
    futures = {}
    while not stop.is_set():
        for queue in range(num_queues):
            if queue not in futures or futures[queue].done():
                request = _pass([11] * num_tokens, 0, first_page + queue * pages_per_pass)
                futures[queue] = scheduler.submit_forward(("hog", queue), "high",
                                                          PreparedForward(request))
        time.sleep(0.001)
    for future in futures.values():
        future.exception()


def measure(engine, policy: SchedulerPolicy, args, with_hog: bool) -> float:
    with BatchScheduler(engine, policy) as scheduler:
        stop = threading.Event()
        hog = threading.Thread(target=run_hog, args=(scheduler, stop, args.hog_tokens,
                                                     args.hog_queues, 16))
        if with_hog:
            hog.start()
            time.sleep(0.2)
        try:
            return polite_time(scheduler, args.steps)
        finally:
            stop.set()
            if with_hog:
                hog.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--hog-tokens", type=int, default=1024)
    parser.add_argument("--hog-queues", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = load_default_engine(progress=False, page_size=PAGE_SIZE, num_pages=512,
                                 max_batch_tokens=2048, dtype="float32")
    header = (f"# {platform.processor() or platform.machine()}, torch "
              f"{torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
              f"1 thread; hog: {args.hog_queues} x {args.hog_tokens}-token high passes")
    baseline = measure(engine, SchedulerPolicy(max_batch_tokens=2048), args, with_hog=False)
    unchunked = measure(engine, SchedulerPolicy(max_batch_tokens=2048,
                                                max_tokens_per_owner=2048), args, True)
    chunked = measure(engine, SchedulerPolicy(max_batch_tokens=2048,
                                              max_tokens_per_owner=args.chunk), args, True)
    figures = {"polite_alone_s": baseline, "beside_hog_fair_unchunked_s": unchunked,
               f"beside_hog_fair_chunked_{args.chunk}_s": chunked,
               "ratio_unchunked": unchunked / baseline, "ratio_chunked": chunked / baseline}
    if args.json:
        print(json.dumps({"header": header, **figures}, indent=2))
        return
    print(header)
    for name, value in figures.items():
        print(f"{name:32s} {value:8.3f}")


if __name__ == "__main__":
    main()
