"""Load test of `pie serve`'s OpenAI endpoint: N concurrent clients running chat completions.

    .venv/bin/python bench/load.py                       # in-process server, real model, N = 1 16 64
    .venv/bin/python bench/load.py --clients 1 4 --rounds 1 --max-tokens 16
    .venv/bin/python bench/load.py --url http://127.0.0.1:8080 --token T   # a running server

Each of the N clients (the official `openai` async client, streaming) sends `rounds` requests one
after the other. Printed per N: requests/s, generated tokens/s, p50/p99 time to first token and
request latency, the mean engine batch size during the run, and the KV pages in use once the
load is over (must return to 0: every instance gave its pages back). N = 1 is the baseline the
other rows' throughput is compared against (the speed-up from batching concurrent requests).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import openai
import trio

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

MODEL = "SmolLM2-135M-Instruct"   # the id /v1/models lists for the embedded model
TOPICS = ("the sea", "mountains", "a city at night", "bread", "rivers", "the moon", "trains",
          "gardens", "winter", "libraries", "bees", "clocks", "deserts", "music", "rain", "bridges")


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    latency_s: float
    num_tokens: int


class InProcessServer:
    """`pie serve` with the default model in a thread of this process (trio loop of its own)."""

    def __init__(self, num_pages: int, max_instances: int) -> None:
        from host.server.server_config import parse_config
        data_dir = Path.home() / ".cache" / "pie" / "bench-server"   # keeps the built-in build
        self.token = "bench-token"
        self.config = parse_config({
            "server": {"data_dir": str(data_dir), "openai": True, "shutdown_grace_s": 2.0},
            "engine": {"num_pages": num_pages, "page_size": 16},
            # The store outlives a run (it keeps the built-in's build), so every earlier build
            # of an example stays counted: a quota far above one run's few programs.
            "tenants": [{"name": "bench", "token": self.token, "max_instances": max_instances,
                         "max_kv_pages": num_pages, "max_program_bytes": 4 * 1024 ** 3}]})
        self.url = ""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        from host.server.app import serve
        self._token = trio.lowlevel.current_trio_token()
        self._shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            self.url = (await nursery.start(partial(serve, self.config, port=0,
                                                    shutdown=self._shutdown)))[0]
            self._ready.set()

    def __enter__(self) -> "InProcessServer":
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc_info) -> None:
        trio.from_thread.run_sync(self._shutdown.set, trio_token=self._token)
        self._thread.join(60)


async def one_request(client: openai.AsyncOpenAI, index: int, max_tokens: int) -> Sample:
    start = time.perf_counter()
    first = None
    num_tokens = 0
    stream = await client.chat.completions.create(
        model=MODEL, max_tokens=max_tokens, temperature=0.7, seed=index, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"Write a short poem about {TOPICS[index % 16]}."}])
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, num_tokens)


async def run_level(url: str, token: str, num_clients: int, rounds: int,
                    max_tokens: int) -> tuple[list[Sample], float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0,
                                timeout=600, http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_connections=num_clients + 4)))
    samples: list[Sample] = []

    async def one_client(client_index: int) -> None:
        for round_index in range(rounds):
            samples.append(await one_request(client, client_index * rounds + round_index,
                                             max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(one_client(i) for i in range(num_clients)))
    elapsed = time.perf_counter() - start
    await client.close()
    return samples, elapsed


def scrape(url: str) -> dict[str, float]:
    figures = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            figures[name] = float(value)
    return figures


def pages_after(url: str, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        used = scrape(url)["pie_kv_pages_used"]
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(url: str, token: str, levels: list[int], rounds: int, max_tokens: int) -> bool:
    print(f"{'N':>4} {'reqs':>5} {'req/s':>7} {'tok/s':>8} {'vs N=1':>7} {'ttft p50':>9} "
          f"{'ttft p99':>9} {'lat p50':>8} {'lat p99':>8} {'batch':>6} {'pages after':>11}")
    baseline = None
    all_clean = True
    for num_clients in levels:
        before = scrape(url)
        samples, elapsed = asyncio.run(run_level(url, token, num_clients, rounds, max_tokens))
        after = scrape(url)
        num_batches = after["pie_batch_size_count"] - before["pie_batch_size_count"]
        mean_batch = (after["pie_batch_size_sum"] - before["pie_batch_size_sum"]) / max(num_batches, 1)
        tokens_per_s = sum(s.num_tokens for s in samples) / elapsed
        baseline = baseline or tokens_per_s
        used = pages_after(url)
        all_clean &= used == 0
        ttfts, latencies = [s.ttft_s for s in samples], [s.latency_s for s in samples]
        print(f"{num_clients:>4} {len(samples):>5} {len(samples) / elapsed:>7.2f} "
              f"{tokens_per_s:>8.1f} {tokens_per_s / baseline:>6.2f}x "
              f"{statistics.median(ttfts):>8.3f}s {percentile(ttfts, 0.99):>8.3f}s "
              f"{statistics.median(latencies):>7.2f}s {percentile(latencies, 0.99):>7.2f}s "
              f"{mean_batch:>6.1f} {used:>11.0f}", flush=True)
    print("KV pages in use returned to 0 after every level" if all_clean
          else "KV pages did NOT return to 0")
    return all_clean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-pages", type=int, default=2048, help="in-process server only")
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    print(f"load: N concurrent clients x {args.rounds} streamed chat completions, "
          f"max_tokens={args.max_tokens}, temperature=0.7")
    if args.url:
        return 0 if report(args.url, args.token, args.clients, args.rounds, args.max_tokens) else 1
    started = time.perf_counter()
    with InProcessServer(args.num_pages, max(args.clients) + 4) as server:
        print(f"in-process server {server.url} ready in {time.perf_counter() - started:.1f} s")
        clean = report(server.url, server.token, args.clients, args.rounds, args.max_tokens)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
