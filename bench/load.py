"""Load test of `pie serve`'s OpenAI endpoint: N concurrent clients running chat completions,
side by side with another OpenAI server (vLLM) when one is given.

    .venv/bin/python bench/load.py                       # starts `pie serve`, real model, N = 1 8 32
    .venv/bin/python bench/load.py --clients 1 4 --rounds 1 --max-tokens 16
    .venv/bin/python bench/load.py --url http://127.0.0.1:8080 --token T   # a running pie server
    .venv/bin/python bench/load.py --baseline-url http://127.0.0.1:8123 --baseline-token x \
        --baseline-model smollm2 --json            # vs vLLM's CPU server (../shared/notes/vllm-cpu)
    python3 bench/load.py --device cuda --clients 1,8,32,128,256 --json   # on a GPU (docs/cuda.md)

Each of the N clients (the official `openai` async client, streaming) sends `rounds` requests one
after the other: greedy, `ignore_eos` (every request generates exactly `max_tokens`, on both
servers), the same prompts. Before the first level, one request to a canned local server warms the
client library (its first request costs ~50 ms that neither server should be charged). Printed
per N: requests/s, generated tokens/s, p50/p99 time to first
token, request latency and time per output token after the first (TPOT); for pie also the mean
engine batch size and the KV pages in use once the load is over, exports aside (the built-in's
shared chat prefixes): it must return to 0, after every level and once more after the last
(`pages_used_at_end`). With a baseline, each level runs on pie and then on the
baseline, and `--json` reports `serve_vs_vllm_N` = pie tok/s / baseline tok/s.
Without `--url` it starts `pie serve` in a process of its own (bench/servers.py), as a user runs
it and as vLLM runs beside the client; `--device` / `--dtype` / `--[no-]act8` pass through to its
engine (on CUDA it warms its kernels before it is ready: `server_ready_s` counts that).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))
sys.path.insert(0, str(REPO_DIR / "bench"))

from servers import ServeProcess, bench_config  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"   # the id /v1/models lists for the embedded model
TOPICS = ("the sea", "mountains", "a city at night", "bread", "rivers", "the moon", "trains",
          "gardens", "winter", "libraries", "bees", "clocks", "deserts", "music", "rain", "bridges")


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    latency_s: float
    num_tokens: int

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None for a one-token answer)."""
        if self.num_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_tokens - 1)


@dataclass(frozen=True)
class Target:
    """One OpenAI server under load: where, with which key and model id; `is_pie` when its
    /metrics are pie's (batch size, pages in use)."""

    name: str
    url: str
    token: str
    model: str
    is_pie: bool


async def one_request(client: openai.AsyncOpenAI, model: str, index: int,
                      max_tokens: int) -> Sample:
    start = time.perf_counter()
    first = None
    num_tokens = 0
    stream = await client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": f"Write a short poem about {TOPICS[index % 16]}."}])
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, num_tokens)


_CANNED_CHUNKS = (
    {"id": "warm-up", "object": "chat.completion.chunk", "created": 0, "model": "warm-up",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"},
                  "finish_reason": None}]},
    {"id": "warm-up", "object": "chat.completion.chunk", "created": 0, "model": "warm-up",
     "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


async def _answer_canned(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read one HTTP request, answer it with _CANNED_CHUNKS as a server-sent event stream."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    events = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in _CANNED_CHUNKS)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
                 b"\r\n" + events + b"data: [DONE]\n\n")
    await writer.drain()
    writer.close()


async def warm_up_client() -> None:
    """One streamed request, as the levels send them, to a canned local server: the client's
    first request in a process costs ~50 ms that no server is responsible for (AnyIO's backend
    imported at the first connection, the first response parsed; measured against vLLM: 113-137
    ms to the first token, 77-88 for the next ones). Without this it was charged to the first
    server asked, always pie."""
    canned = await asyncio.start_server(_answer_canned, "127.0.0.1", 0)
    port = canned.sockets[0].getsockname()[1]
    async with canned:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                    max_retries=0, http_client=httpx.AsyncClient())
        sample = await one_request(client, "warm-up", 0, 1)
        await client.close()
    if sample.num_tokens != 1:
        raise RuntimeError("the client's warm-up request did not parse its canned answer")


async def run_level(target: Target, num_clients: int, rounds: int,
                    max_tokens: int) -> tuple[list[Sample], float]:
    client = openai.AsyncOpenAI(base_url=f"{target.url}/v1", api_key=target.token, max_retries=0,
                                timeout=600, http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_connections=num_clients + 4)))
    samples: list[Sample] = []

    async def one_client(client_index: int) -> None:
        for round_index in range(rounds):
            samples.append(await one_request(client, target.model,
                                             client_index * rounds + round_index, max_tokens))

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
        figures = scrape(url)
        used = figures["pie_kv_pages_used"] - figures.get("pie_kv_pages_exported", 0)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_target(target: Target, num_clients: int, rounds: int, max_tokens: int) -> dict:
    """One level on one server: its figures (pie's also: mean batch, pages in use after)."""
    before = scrape(target.url) if target.is_pie else {}
    samples, elapsed = asyncio.run(run_level(target, num_clients, rounds, max_tokens))
    ttfts, latencies = [s.ttft_s for s in samples], [s.latency_s for s in samples]
    row = {"server": target.name, "clients": num_clients, "requests": len(samples),
           "req_s": len(samples) / elapsed,
           "tok_s": sum(s.num_tokens for s in samples) / elapsed,
           "tokens_each": sorted({s.num_tokens for s in samples}),
           "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": percentile(ttfts, 0.99),
           "latency_p50_s": statistics.median(latencies),
           "latency_p99_s": percentile(latencies, 0.99)}
    tpots = [s.tpot_s for s in samples if s.tpot_s is not None]
    if tpots:
        row["tpot_p50_s"], row["tpot_p99_s"] = statistics.median(tpots), percentile(tpots, 0.99)
    if target.is_pie:
        after = scrape(target.url)
        num_batches = after["pie_batch_size_count"] - before["pie_batch_size_count"]
        row["mean_batch"] = ((after["pie_batch_size_sum"] - before["pie_batch_size_sum"])
                             / max(num_batches, 1))
        row["pages_after"] = pages_after(target.url)
    return row


def print_row(row: dict) -> None:
    batch = f"{row['mean_batch']:>6.1f}" if "mean_batch" in row else f"{'-':>6}"
    pages = f"{row['pages_after']:>6.0f}" if "pages_after" in row else f"{'-':>6}"
    tpot = (f"{row['tpot_p50_s'] * 1e3:>7.1f}ms {row['tpot_p99_s'] * 1e3:>7.1f}ms"
            if "tpot_p50_s" in row else f"{'-':>9} {'-':>9}")
    print(f"{row['server']:>8} {row['clients']:>4} {row['requests']:>5} {row['req_s']:>7.2f} "
          f"{row['tok_s']:>8.1f} {row['ttft_p50_s']:>8.3f}s {row['ttft_p99_s']:>8.3f}s "
          f"{row['latency_p50_s']:>7.2f}s {row['latency_p99_s']:>7.2f}s {batch} {pages} {tpot}",
          flush=True)


def report(targets: list[Target], levels: list[int], rounds: int, max_tokens: int,
           quiet: bool) -> dict:
    """Every level on every target, in turn (level by level); the rows and pie/baseline ratios."""
    if not quiet:
        print(f"{'server':>8} {'N':>4} {'reqs':>5} {'req/s':>7} {'tok/s':>8} {'ttft p50':>9} "
              f"{'ttft p99':>9} {'lat p50':>8} {'lat p99':>8} {'batch':>6} {'pages':>6} "
              f"{'tpot p50':>9} {'tpot p99':>9}")
    rows, ratios = [], {}
    for num_clients in levels:
        level = [run_target(t, num_clients, rounds, max_tokens) for t in targets]
        rows += level
        if not quiet:
            for row in level:
                print_row(row)
        if len(level) == 2 and level[1]["tok_s"] > 0:
            ratios[f"serve_vs_vllm_{num_clients}"] = level[0]["tok_s"] / level[1]["tok_s"]
            ratios[f"ttft_p50_vs_vllm_{num_clients}"] = (level[0]["ttft_p50_s"]
                                                         / level[1]["ttft_p50_s"])
            if not quiet:
                print(f"{'':>8} {num_clients:>4} pie / {targets[1].name}: tok/s "
                      f"{ratios[f'serve_vs_vllm_{num_clients}']:.2f}x, ttft p50 "
                      f"{ratios[f'ttft_p50_vs_vllm_{num_clients}']:.2f}x", flush=True)
    at_end = pages_after(targets[0].url) if targets[0].is_pie else 0.0
    clean = all(row.get("pages_after", 0) == 0 for row in rows) and at_end == 0
    if not quiet:
        print("pie's KV pages in use (exports aside) returned to 0 after every level" if clean
              else f"pie's KV pages did NOT return to 0 ({at_end:.0f} in use at the end)")
    return {"rows": rows, **ratios, "pages_returned": clean, "pages_used_at_end": at_end}


def machine(device: str | None) -> dict:
    """The CPU's description, and the GPU's name when the server runs on CUDA."""
    from engine_bench import cpu_description
    description = cpu_description()
    if device in ("cuda", "auto"):
        import torch
        if torch.cuda.is_available():
            description = {**description, "gpu": torch.cuda.get_device_name()}
    return description


def client_counts(values: list[str]) -> list[int]:
    """`--clients 1 8 32` or `--clients 1,8,32,128,256` -> [1, 8, 32, ...] (each >= 1)."""
    counts = [int(part) for value in values for part in value.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--clients needs counts >= 1, got {values}")
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", nargs="+", default=["1", "8", "32"],
                        help="client counts, space- or comma-separated (default: 1 8 32)")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="started server only (default: 2048; 8192 on CUDA, for 256 "
                             "clients)")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default=None,
                        help="started server only: its engine's device (default: the "
                             "engine's, auto)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                        help="started server only: its engine's dtype (default: auto)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="started server only: its data dir (default: "
                             "~/.cache/pie/bench-server; a machine without componentize-py needs "
                             "one holding builtin/<hash>.wasm, built elsewhere)")
    parser.add_argument("--spare-builtins", type=int, default=8,
                        help="started server only: server.spare_builtins (0: none)")
    parser.add_argument("--act8", action=argparse.BooleanOptionalAction, default=None,
                        help="started server only: [engine] act8 (default: the engine's, "
                             "8-bit activations); --no-act8: 16-bit")
    parser.add_argument("--url", default=None, help="a running pie server (default: start one)")
    parser.add_argument("--token", default=None)
    parser.add_argument("--baseline-url", default=None, help="another OpenAI server, e.g. vLLM")
    parser.add_argument("--baseline-token", default="x")
    parser.add_argument("--baseline-model", default="smollm2", help="its served model id")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args()
    try:
        args.clients = client_counts(args.clients)
    except (ValueError, argparse.ArgumentTypeError) as err:
        parser.error(str(err))
    engine_fields = {name: value for name, value in (("device", args.device),
                                                     ("dtype", args.dtype),
                                                     ("act8", args.act8))
                     if value is not None}
    num_pages = args.num_pages or (8192 if args.device == "cuda" else 2048)
    header = {"machine": machine(args.device), "clients": args.clients, "rounds": args.rounds,
              "max_tokens": args.max_tokens, **engine_fields}
    if not args.json:
        print(f"load: N concurrent clients x {args.rounds} streamed chat completions, "
              f"max_tokens={args.max_tokens}, greedy, ignore_eos; {header['machine']}")
    asyncio.run(warm_up_client())
    baseline = ([Target("baseline", args.baseline_url, args.baseline_token, args.baseline_model,
                        False)] if args.baseline_url else [])
    if args.url:
        result = report([Target("pie", args.url, args.token, MODEL, True)] + baseline,
                        args.clients, args.rounds, args.max_tokens, args.json)
    else:
        started = time.perf_counter()
        config = bench_config(num_pages, max(args.clients) + 4, args.spare_builtins,
                              engine_fields, args.data_dir)
        with ServeProcess(config) as server:
            header["server_ready_s"] = time.perf_counter() - started
            if not args.json:
                print(f"pie serve (pid {server.pid}) {server.url} ready in "
                      f"{header['server_ready_s']:.1f} s")
            result = report([Target("pie", server.url, server.token, MODEL, True)] + baseline,
                            args.clients, args.rounds, args.max_tokens, args.json)
    if args.json:
        print(json.dumps({**header, **result}))
    return 0 if result["pages_returned"] else 1


if __name__ == "__main__":
    sys.exit(main())
