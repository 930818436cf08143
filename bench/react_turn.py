"""Where one ReAct agent's turn spends its time, inferlet vs OpenAI API (react-http of apps.py).

    .venv/bin/python bench/react_turn.py                  # 1 agent, 8 calls (4 a turn), 5 runs
    .venv/bin/python bench/react_turn.py --agents 8 --runs 3 --json

One in-process `pie serve` and the tool server (tests/host/servers/tool_server.py, /search after
--delay-ms) in a process of its own, as in bench/apps.py. Path (a): react.py --tool http
--timings: per turn the guest's clock splits the turn's generation (the pass over the tokens
filled since the last one, the observations, then the decode) from its tool calls (started to
last answer, through inferlet.http and host/outbound). Path (b): apps.py's API agent with the
same split on the client's clock: the chat completion request (the whole conversation resent)
and the httpx calls of the turn. Also timed: a bare GET of the tool from this process (the tool's
floor). Reported: the median of each phase over the runs' turns, the tokens the engine computed
per agent, and each path's workflow time; a second pass of `--agents` concurrent agents shows the
same under load.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai
import torch
import trio

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))
sys.path.insert(0, str(REPO_DIR / "bench"))

from apps import (EXAMPLES, KEEPALIVE_S, api_http_tool, chat_turn, inferlet_args,  # noqa: E402
                  machine_line, tool_server, warm_up, REACT_SYSTEM, REACT_TASKS)
from apps_tools import turn_sizes  # noqa: E402
from load import scrape  # noqa: E402
from servers import InProcessServer  # noqa: E402


async def inferlet_agents(url: str, token: str, program: str, argvs: list[list[str]]) -> list:
    """Run the agents at once; each one's (wall seconds, timings)."""
    from host.client import connect
    results: list = [None] * len(argvs)
    async with connect(url, token) as client:
        async def agent(index: int) -> None:
            start = time.perf_counter()
            final = await (await client.launch(program, argvs[index])).wait()
            if final.kind != "result":
                raise RuntimeError(f"{final.kind}: {final.data}")
            results[index] = (time.perf_counter() - start, json.loads(final.data)["timings"])
        async with trio.open_nursery() as nursery:
            for index in range(len(argvs)):
                nursery.start_soon(agent, index)
    return results


async def api_agents(url: str, token: str, num_agents: int, calls: int, opts) -> list:
    """apps.py's API agents with each turn's phases timed on the client; per agent (wall s,
    timings)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=900,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(
                                    max_connections=num_agents * 2 + 4,
                                    keepalive_expiry=KEEPALIVE_S)))
    tools = httpx.AsyncClient(timeout=60, trust_env=False, limits=httpx.Limits(
        max_connections=num_agents * opts.calls_per_turn + 4))

    async def agent(index: int) -> tuple:
        start, timings, num_done = time.perf_counter(), [], 0
        messages = [{"role": "system", "content": REACT_SYSTEM},
                    {"role": "user", "content": REACT_TASKS[index % len(REACT_TASKS)]}]
        for num_turn_calls in turn_sizes(calls, opts.calls_per_turn):
            began = time.perf_counter()
            text, _ = await chat_turn(client, messages, opts)
            generated = time.perf_counter()
            messages.append({"role": "assistant", "content": text})
            observations = await asyncio.gather(*(
                api_http_tool(tools, text, num_done + i, opts) for i in range(num_turn_calls)))
            timings.append({"generate_s": generated - began,
                            "tool_s": time.perf_counter() - generated})
            num_done += num_turn_calls
            messages.append({"role": "user", "content": "\n".join(observations)})
        began = time.perf_counter()
        await chat_turn(client, messages, opts)
        timings.append({"generate_s": time.perf_counter() - began, "tool_s": 0.0})
        return time.perf_counter() - start, timings

    results = await asyncio.gather(*(agent(i) for i in range(num_agents)))
    await client.close()
    await tools.aclose()
    return list(results)


async def bare_tool_s(url: str, num: int) -> list[float]:
    """Seconds of `num` single GETs of the tool from this process, one after another."""
    times = []
    async with httpx.AsyncClient(trust_env=False) as tools:
        for _ in range(num):
            start = time.perf_counter()
            (await tools.get(url, params={"q": "floor"})).raise_for_status()
            times.append(time.perf_counter() - start)
    return times


def summary(results: list, computed: int) -> dict:
    """Medians of the phases over every turn of every agent (tool turns apart from the last)."""
    turns = [t for _, timings in results for t in timings]
    tool_turns = [t for t in turns if t["tool_s"] > 0]
    return {"workflow_s": round(statistics.median(w for w, _ in results), 3),
            "generate_s": round(statistics.median(t["generate_s"] for t in turns), 4),
            "first_generate_s": round(statistics.median(t[0]["generate_s"]
                                                        for _, t in results), 4),
            "tool_s": round(statistics.median(t["tool_s"] for t in tool_turns), 4),
            "computed_per_agent": round(computed / len(results))}


def measure(server, run) -> tuple[list, int]:
    before = scrape(server.url)["pie_input_tokens_total"]
    results = run()
    return results, int(scrape(server.url)["pie_input_tokens_total"] - before)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--calls-per-turn", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=100.0)
    parser.add_argument("--runs", type=int, default=5, help="single-agent runs of each path")
    parser.add_argument("--agents", type=int, default=8, help="the loaded pass's agents (0: none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    opts.num_pages, opts.max_instances = 4096, 80
    machine_line(opts)
    from host.client import SyncClient
    from host.sandbox.programs.build import build_cached
    rows = {}
    with tool_server(opts.delay_ms) as port, InProcessServer(
            num_pages=opts.num_pages, max_instances=opts.max_instances,
            outbound={"allow_hosts": [f"127.0.0.1:{port}"],
                      "requests_per_minute": 1_000_000}) as server:
        opts.tool_url = f"http://127.0.0.1:{port}/search"
        with SyncClient(server.url, server.token) as client:
            program = client.upload(build_cached(EXAMPLES / "react.py")[0].read_bytes())
        warm_up(server, {"react-http": program}, opts)
        floor = asyncio.run(bare_tool_s(opts.tool_url, 20))
        rows["bare_tool_s"] = round(statistics.median(floor), 4)
        for label, num_agents, runs in (("1", 1, opts.runs), (str(opts.agents), opts.agents, 1)):
            if num_agents == 0:
                continue
            argvs = [inferlet_args("react-http", a, opts.calls, opts, "t")[0] + ["--timings"]
                     for a in range(num_agents)]
            pie, api, pie_computed, api_computed = [], [], 0, 0
            for _ in range(runs):
                results, computed = measure(server, lambda: trio.run(
                    inferlet_agents, server.url, server.token, program, argvs))
                pie += results
                pie_computed += computed
                results, computed = measure(server, lambda: asyncio.run(
                    api_agents(server.url, server.token, num_agents, opts.calls, opts)))
                api += results
                api_computed += computed
            rows[label] = {"inferlet": summary(pie, pie_computed), "api": summary(api, api_computed)}
            for path in ("inferlet", "api"):
                print(f"{label:>3} agents {path:<8} " + "  ".join(
                    f"{k} {v}" for k, v in rows[label][path].items()), flush=True)
    print(f"bare tool GET: {rows['bare_tool_s']} s (median of 20)")
    if opts.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
