"""Agentic workflows as inferlets vs the same workflows driven over the OpenAI API, on one server.

    .venv/bin/python bench/apps.py --quick            # 32x8, 8x8, 1x2 (agents x tool calls)
    .venv/bin/python bench/apps.py --grid full        # 1, 8, 32 agents x 2, 8, 32 tool calls
    .venv/bin/python bench/apps.py --grid react-full  # the full grid for react, quick for others
    .venv/bin/python bench/apps.py --quick --json     # one JSON object on the last line
    .venv/bin/python bench/apps.py --cells 1x2 4x2 --workflows react --no-techniques
    .venv/bin/python bench/apps.py --techniques-only --json   # only the technique rows

One in-process `pie serve` (the default model, SmolLM2-135M) runs both paths, side by side:
(a) the example inferlet (react.py, codeact.py, swarm.py): the KV of the episode stays across
tool calls, the system prompt's KV is an export made once (warm-up) and imported by every agent,
tools run inside the instance (a simulated --delay-ms) and the agents of a swarm talk over
broadcast; (b) a client with the official `openai` package: every turn resends the whole
conversation to /v1/chat/completions (pie's endpoint has no automatic prefix cache, so the
server recomputes it), runs the same tools with the same delay and appends the observations.
Both: same prompts, greedy, the same turn limit (--turn-tokens), the same tool calls; the
agents of a cell run concurrently in both paths (their tool waits overlap each other's
generation); within one agent, each turn issues --calls-per-turn (4) tool calls and both paths
run them concurrently (one delay per turn, asyncio.gather on the API side), and the next turn
follows their observations. torch runs on --threads (1) threads: two collapse when the other
core is busy.
A swarm "agent" is a team of two roles (writer, critic); its tool calls are the messages each
role answers. Reported per cell: workflows/s, generated tokens/s, p50/p99 workflow latency,
tokens computed by the engine; the speed-up is the inferlet's throughput over the API path's,
the p50 ratio the API path's median latency over the inferlet's.
`react-http` is react with a real HTTP tool: a server on 127.0.0.1 in a process of its own
(tests/host/servers/tool_server.py, /search, answering after --delay-ms) that the inferlet calls through
inferlet.http (`react.py --tool http`, the tenant allowed that address only) and the API path's
client calls with httpx, both with the same query and the same observation.
Then one row per technique (bench/apps_techniques.py): the inferlet vs the nearest thing a
client can do over the OpenAI API.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import json
import platform
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import torch
import trio

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))
sys.path.insert(0, str(REPO_DIR / "bench"))

from apps_tools import codeact_tools, react_observation, turn_sizes  # noqa: E402
from load import percentile, scrape  # noqa: E402
from servers import InProcessServer  # noqa: E402

EXAMPLES = REPO_DIR / "inferlets" / "examples"
REACT_SYSTEM = ("You are an agent that solves tasks step by step. Each turn write one short "
                "Thought and one Action: search(query). You then get an Observation.")
CODEACT_SYSTEM = ("You solve math problems by writing one Python arithmetic expression per turn, "
                  "like (3 + 4) * 2. You then get its Output.")
REACT_TASKS = ("Find the tallest mountain in Europe.", "Plan a day trip to Rome.",
               "Find a good book about birds.", "Compare two laptops for students.")
CODEACT_TASKS = ("What is (17 + 25) * 3?", "What is 144 / 12 + 7?", "What is 2 ** 10 - 24?",
                 "What is (9 - 4) * (6 + 2)?")
SWARM_ROLES = ("writer", "critic")
SWARM_TASKS = ("Write a slogan for a bakery.", "Name a new tea shop.", "Describe a quiet park.",
               "Invent a board game.")
WORKFLOWS = ("react", "codeact", "swarm", "react-http")
PROGRAMS = {"react-http": "react"}          # a workflow's example, when not its own name
HTTP_QUERY_CHARS = 100                      # react.py's MAX_QUERY_CHARS
QUICK_CELLS = ((32, 8), (8, 8), (1, 2))
FULL_CELLS = tuple((agents, calls) for agents in (1, 8, 32) for calls in (2, 8, 32))
HTTP_CELLS = ((32, 8), (8, 8))
# below hypercorn's keep-alive timeout (5 s): a connection idle longer (a slow turn on a loaded
# machine) is never reused as the server closes it (a ReadError, and the API path would fail)
KEEPALIVE_S = 2.0
GRIDS = {"quick": {**{w: QUICK_CELLS for w in WORKFLOWS}, "react-http": HTTP_CELLS},
         "full": {w: FULL_CELLS for w in WORKFLOWS},
         "react-full": {"react": FULL_CELLS, "codeact": QUICK_CELLS, "swarm": QUICK_CELLS,
                        "react-http": HTTP_CELLS}}


@dataclass(frozen=True)
class Cell:
    """One (workflow, path, agents, calls) measurement."""

    elapsed_s: float
    latencies_s: tuple[float, ...]
    num_generated: int
    num_computed: int

    def workflows_per_s(self) -> float:
        return len(self.latencies_s) / self.elapsed_s


# -- (a) inferlets over the websocket --------------------------------------------------------
def inferlet_args(workflow: str, agent: int, calls: int, opts, team: str) -> list[list[str]]:
    """The argv of each instance of one agent (a swarm agent is one instance per role)."""
    common = ["--turn-tokens", str(opts.turn_tokens)]
    if workflow == "swarm":
        return [common + ["--roles", ",".join(SWARM_ROLES), "--role", role, "--team",
                          f"{team}-{agent}", "--rounds", str(calls), "--task",
                          SWARM_TASKS[agent % len(SWARM_TASKS)]] for role in SWARM_ROLES]
    system, tasks = (CODEACT_SYSTEM, CODEACT_TASKS) if workflow == "codeact" else (REACT_SYSTEM, REACT_TASKS)
    tool = (["--tool", "http", "--tool-url", opts.tool_url] if workflow == "react-http"
            else ["--delay-ms", str(opts.delay_ms)])
    return [common + ["--system", system, "--task", tasks[agent % len(tasks)], "--num-calls",
                      str(calls), "--calls-per-turn", str(opts.calls_per_turn), *tool,
                      "--system-export", f"bench/{workflow}/system"]]


async def run_inferlets(url: str, token: str, program: str, argvs: list[list[list[str]]]) -> tuple:
    """Launch every agent's instances at once; (elapsed, per-agent latency, generated tokens)."""
    from host.client import connect
    latencies, generated = [0.0] * len(argvs), [0]
    async with connect(url, token) as client:
        async def agent(index: int, argv_list: list[list[str]]) -> None:
            start = time.perf_counter()
            instances = [await client.launch(program, argv) for argv in argv_list]
            for instance in instances:
                final = await instance.wait()
                if final.kind != "result":
                    raise RuntimeError(f"agent {index}: {final.kind}: {final.data}")
                generated[0] += json.loads(final.data)["num_generated"]
            latencies[index] = time.perf_counter() - start
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for index, argv_list in enumerate(argvs):
                nursery.start_soon(agent, index, argv_list)
        return time.perf_counter() - start, latencies, generated[0]


# -- (b) the same workflows over /v1/chat/completions ---------------------------------------
async def chat_turn(client, messages: list[dict], opts) -> tuple[str, int]:
    response = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=opts.turn_tokens, temperature=0)
    return response.choices[0].message.content or "", response.usage.completion_tokens


async def api_agent(client, workflow: str, agent: int, calls: int, opts,
                    tools: httpx.AsyncClient | None = None) -> int:
    """One agent's workflow over the API; returns the tokens generated. `tools`: the client of
    react-http's tool server."""
    if workflow == "swarm":
        return await api_swarm(client, agent, calls, opts)
    system, tasks = (CODEACT_SYSTEM, CODEACT_TASKS) if workflow == "codeact" else (REACT_SYSTEM, REACT_TASKS)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": tasks[agent % len(tasks)]}]
    generated, num_done = 0, 0
    for num_turn_calls in turn_sizes(calls, opts.calls_per_turn):
        text, num_tokens = await chat_turn(client, messages, opts)
        generated += num_tokens
        messages.append({"role": "assistant", "content": text})
        observations = await asyncio.gather(*(
            api_http_tool(tools, text, num_done + index, opts) if workflow == "react-http"
            else api_tool(workflow, text, num_done, index, opts)
            for index in range(num_turn_calls)))
        num_done += num_turn_calls
        messages.append({"role": "user", "content": "\n".join(observations)})
    text, num_tokens = await chat_turn(client, messages, opts)
    return generated + num_tokens


async def api_tool(workflow: str, text: str, num_done: int, index: int, opts) -> str:
    """The `index`-th tool call of a turn whose assistant text is `text`, after `num_done` calls
    of earlier turns: its delay, then its observation (codeact: the text's index-th expression)."""
    await asyncio.sleep(opts.delay_ms / 1000)
    if workflow == "react":
        return react_observation(num_done + index)
    return codeact_tools(text, index + 1)[index][1]


async def api_http_tool(tools: httpx.AsyncClient, text: str, call_id: int, opts) -> str:
    """react.py's http tool, called by the client: the same query, the same observation."""
    response = await tools.get(opts.tool_url, params={"q": text[:HTTP_QUERY_CHARS]})
    response.raise_for_status()
    results = response.json().get("results") or ["(no result)"]
    return f"Observation {call_id + 1}: {str(results[0])[:200]}"


async def api_swarm(client, agent: int, calls: int, opts) -> int:
    """A team of roles in a ring, each role's conversation resent every turn."""
    conversations = {role: [{"role": "system", "content":
                             f"You are the {role} of a team of {', '.join(SWARM_ROLES)}. "
                             f"Answer in one short sentence."}] for role in SWARM_ROLES}
    message, generated = f"task: {SWARM_TASKS[agent % len(SWARM_TASKS)]}", 0
    for _ in range(calls):
        for role in SWARM_ROLES:
            conversations[role].append({"role": "user", "content": message})
            text, num_tokens = await chat_turn(client, conversations[role], opts)
            generated += num_tokens
            conversations[role].append({"role": "assistant", "content": text})
            message = f"{role}: {text.strip()}"
    return generated


async def run_api(url: str, token: str, workflow: str, agents: int, calls: int, opts) -> tuple:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=900,
                                http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_connections=agents * 2 + 4,
                                                        keepalive_expiry=KEEPALIVE_S)))
    latencies = [0.0] * agents
    tools = httpx.AsyncClient(limits=httpx.Limits(max_connections=agents * opts.calls_per_turn + 4),
                              timeout=60, trust_env=False)

    async def agent(index: int) -> int:
        start = time.perf_counter()
        generated = await api_agent(client, workflow, index, calls, opts, tools)
        latencies[index] = time.perf_counter() - start
        return generated

    start = time.perf_counter()
    generated = await asyncio.gather(*(agent(i) for i in range(agents)))
    elapsed = time.perf_counter() - start
    await client.close()
    await tools.aclose()
    return elapsed, latencies, sum(generated)


@contextlib.contextmanager
def tool_server(delay_ms: float):
    """tests/host/servers/tool_server.py in a process of its own, on 127.0.0.1; its port."""
    process = subprocess.Popen([sys.executable, "-m", "tests.host.servers.tool_server",
                                "--delay-ms", str(delay_ms)], cwd=REPO_DIR,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield int(process.stdout.readline())
    finally:
        process.stdin.close()
        process.wait(30)


# -- the grid --------------------------------------------------------------------------------
def measure(server, run) -> Cell:
    before = scrape(server.url)["pie_input_tokens_total"]
    elapsed, latencies, generated = run()
    computed = scrape(server.url)["pie_input_tokens_total"] - before
    return Cell(elapsed, tuple(latencies), generated, int(computed))


def measure_run(server, run) -> dict:
    """{computed: tokens the engine computed, wall_s} of `run()`."""
    before = scrape(server.url)["pie_input_tokens_total"]
    start = time.perf_counter()
    run()
    wall_s = time.perf_counter() - start
    return {"computed": int(scrape(server.url)["pie_input_tokens_total"] - before),
            "wall_s": round(wall_s, 3)}


def warm_up(server, programs: dict[str, str], opts) -> None:
    """Export the system prompts (the inferlet path's shared prefix) and warm both paths."""
    for workflow in set(programs) & {"react", "codeact", "react-http"}:
        argv = inferlet_args(workflow, 0, 0, opts, "warm")
        trio.run(run_inferlets, server.url, server.token, programs[workflow], [argv])
    asyncio.run(run_api(server.url, server.token, "react", 1, 0, opts))


def cell_row(workflow: str, agents: int, calls: int, pie: Cell, api: Cell) -> dict:
    speedup = pie.workflows_per_s() / api.workflows_per_s()
    p50_ratio = statistics.median(api.latencies_s) / statistics.median(pie.latencies_s)
    row = {"workflow": workflow, "agents": agents, "calls": calls, "speedup": round(speedup, 2),
           "p50_ratio": round(p50_ratio, 2), "wall_s": round(pie.elapsed_s + api.elapsed_s, 1)}
    for name, cell in (("inferlet", pie), ("api", api)):
        row[name] = {"workflows_per_s": round(cell.workflows_per_s(), 3),
                     "tokens_per_s": round(cell.num_generated / cell.elapsed_s, 1),
                     "p50_s": round(statistics.median(cell.latencies_s), 2),
                     "p99_s": round(percentile(list(cell.latencies_s), 0.99), 2),
                     "generated": cell.num_generated, "computed": cell.num_computed}
    return row


def print_row(row: dict) -> None:
    pie, api = row["inferlet"], row["api"]
    print(f"{row['workflow']:<8} {row['agents']:>3}x{row['calls']:<3} "
          f"{pie['workflows_per_s']:>7.3f} {api['workflows_per_s']:>7.3f} {row['speedup']:>6.2f}x "
          f"{pie['tokens_per_s']:>7.1f} {api['tokens_per_s']:>7.1f} "
          f"{pie['p50_s']:>6.2f} {api['p50_s']:>6.2f} {pie['p99_s']:>6.2f} {api['p99_s']:>6.2f} "
          f"{row['p50_ratio']:>6.2f}x {pie['generated']:>6} {api['generated']:>6} "
          f"{pie['computed']:>7} {api['computed']:>7} {row['wall_s']:>7.1f}", flush=True)


def cpu_model() -> str:
    """The CPU's model name (lscpu's), else the platform's processor."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def machine_line(opts) -> None:
    print(f"apps: {cpu_model()}, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} "
          f"threads; turn_tokens={opts.turn_tokens}, delay={opts.delay_ms:g} ms, "
          f"calls_per_turn={opts.calls_per_turn}, {opts.num_pages} pages / {opts.max_instances} "
          f"instances, greedy",
          flush=True)


def header() -> None:
    print(f"{'workflow':<8} {'AxC':<7} {'wf/s':>7} {'api':>7} {'speedup':>7} {'tok/s':>7} "
          f"{'api':>7} {'p50':>6} {'api':>6} {'p99':>6} {'api':>6} {'p50 api/':>7} {'gen':>6} "
          f"{'api':>6} {'computed':>7} {'api':>7} {'wall_s':>7}", flush=True)


def run_cell(server, program: str, workflow: str, agents: int, calls: int, opts) -> dict:
    """Both paths of one cell, the inferlet first; its row."""
    team = uuid.uuid4().hex[:8]
    argvs = [inferlet_args(workflow, a, calls, opts, team) for a in range(agents)]
    pie = measure(server, lambda: trio.run(run_inferlets, server.url, server.token, program, argvs))
    api = measure(server, lambda: asyncio.run(run_api(server.url, server.token, workflow, agents,
                                                      calls, opts)))
    return cell_row(workflow, agents, calls, pie, api)


def grid_plan(grid: dict, workflows: list[str], cells: list[str] | None) -> list[tuple]:
    """(workflow, agents, calls) to run, the quick cells first (a cut-short run has them);
    `cells` ("AxC") replaces the grid's cells for every workflow."""
    if cells:
        chosen = [tuple(int(n) for n in cell.split("x")) for cell in cells]
        grid = {workflow: chosen for workflow in workflows}
    order = dict.fromkeys(QUICK_CELLS + FULL_CELLS + tuple(c for w in workflows for c in grid[w]))
    return [(workflow, agents, calls) for agents, calls in order for workflow in workflows
            if (agents, calls) in grid[workflow]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="full",
                        help="quick: 32x8, 8x8, 1x2; full: 1, 8, 32 agents x 2, 8, 32 calls; "
                             "react-full: full for react, quick for the others")
    parser.add_argument("--quick", action="store_true", help="the same as --grid quick")
    parser.add_argument("--cells", nargs="+", default=None, help="AxC cells, e.g. 1x2 32x8")
    parser.add_argument("--workflows", nargs="+", choices=WORKFLOWS, default=list(WORKFLOWS))
    parser.add_argument("--turn-tokens", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=100.0)
    parser.add_argument("--calls-per-turn", type=int, default=4,
                        help="tool calls a turn issues (run concurrently in both paths)")
    parser.add_argument("--num-pages", type=int, default=4096, help="the server's KV pool")
    parser.add_argument("--max-instances", type=int, default=80,
                        help="the tenant's instances; each reserves num_pages / max_instances "
                             "pages (51 by default, 816 tokens: too few for swarm at 32 calls, "
                             "which needs --num-pages 8192)")
    parser.add_argument("--no-techniques", action="store_true")
    parser.add_argument("--techniques-only", action="store_true",
                        help="only the technique rows (no workflow cells)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (two collapse when the other core is busy)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    if opts.calls_per_turn < 1:
        parser.error("--calls-per-turn must be >= 1")
    if opts.techniques_only and opts.no_techniques:
        parser.error("--techniques-only and --no-techniques exclude each other")
    plan = [] if opts.techniques_only else \
        grid_plan(GRIDS["quick" if opts.quick else opts.grid], opts.workflows, opts.cells)
    machine_line(opts)
    from host.sandbox.programs.build import build_cached
    with tool_server(opts.delay_ms) as tool_port, \
            InProcessServer(num_pages=opts.num_pages, max_instances=opts.max_instances,
                            outbound={"allow_hosts": [f"127.0.0.1:{tool_port}"],
                                      "requests_per_minute": 1_000_000}) as server:
        opts.tool_url = f"http://127.0.0.1:{tool_port}/search"
        from host.client import SyncClient
        with SyncClient(server.url, server.token) as client:
            programs = {w: client.upload(build_cached(
                EXAMPLES / f"{PROGRAMS.get(w, w)}.py")[0].read_bytes()) for w in opts.workflows}
        techniques = []
        if not opts.no_techniques:   # first: short, and a cut-short run still reports them
            from apps_techniques import run_techniques
            techniques = run_techniques(server, lambda run: measure_run(server, run))
        rows = []
        if plan:
            warm_up(server, programs, opts)
            header()
        for workflow, agents, calls in plan:
            rows.append(run_cell(server, programs[workflow], workflow, agents, calls, opts))
            print_row(rows[-1])
    if opts.json:
        summary = {f"{r['workflow']}_speedup_{r['agents']}x{r['calls']}": r["speedup"] for r in rows}
        print(json.dumps({**summary, "cells": rows, "techniques": techniques}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
