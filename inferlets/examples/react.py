"""ReAct: think, act, observe, repeat. The KV of the whole episode stays in the context: each
observation is appended to it and nothing earlier is recomputed.

    pie run inferlets/examples/react.py -- --task "Plan a trip to Rome." --num-calls 3
    pie run inferlets/examples/react.py -- --num-calls 4 --calls-per-turn 4 --tool client

Each turn the model writes a thought and its actions (one assistant turn, greedy, at most
--turn-tokens tokens); the turn issues --calls-per-turn tool calls (1 by default; --num-calls in
all, the last turn takes the remainder) and runs them concurrently: all are started before any
result is awaited, so k calls of one turn take the time of the slowest, not k times it. Their
observations, one line each, are appended as the next user turn. Tools:
- `simulated` (default): each call takes --delay-ms (100 ms, as in the Pie paper's evaluation)
  and returns a fixed observation; the calls of a turn overlap, so the turn waits --delay-ms once.
- `client`: each call is a JSON message to the client,
  {"type": "tool_call", "id": N, "name": "search", "arguments": {"query": <the turn's text>}}
  (N counts the episode's calls from 0); the client answers each with {"id": N, "content": TEXT},
  in any order. Every call of a turn is sent before the first answer is read.
- `http`: each call is a real request, GET --tool-url?q=<the turn's text, first 100 characters>
  (inferlet.http; the host must allow its host: `pie run --allow-host 127.0.0.1:8080`); the
  server answers {"results": [TEXT, ...]} and the first result is the observation. A turn's
  requests are all in flight at once (the host's max_concurrent bounds them); a refused or
  failed request ends the run with its error, which names the limit. tests/host/servers/
  tool_server.py is such a server (`/search`).
With --system-export NAME the system prompt's KV is imported from the export NAME when it exists
(no prefill) and exported there (persistent) otherwise.
Returns JSON: {turns, observations, answer, num_generated, num_context_tokens, imported,
calls_per_turn}; with --timings also `timings`: per turn {generate_s (the turn's pass over its
new tokens and its decode), tool_s (its tool calls, started to last answer)}, as the guest's
clock measures them (bench/react_turn.py).
"""
import json
import time
from urllib.parse import quote

import inferlet

SYSTEM = ("You are an agent that solves tasks step by step. Each turn write one short Thought "
          "and one Action: search(query). You then get an Observation.")
TOOLS = ("simulated", "client", "http")
MAX_QUERY_CHARS = 100
MAX_CALLS = 4096


def observe(call_index: int) -> str:
    """The simulated tool's answer to the `call_index`-th action (0-based)."""
    return f"Observation {call_index + 1}: the search found one more useful fact."


def turn_sizes(num_calls: int, calls_per_turn: int) -> list[int]:
    """The number of tool calls of each turn: `calls_per_turn`, the remainder in the last."""
    return [min(calls_per_turn, num_calls - first) for first in range(0, num_calls, calls_per_turn)]


def run_simulated(call_ids: list[int], delay_s: float) -> list[str]:
    """The simulated calls `call_ids`, started together: each takes `delay_s`, so they all end
    after `delay_s` (one wait for the turn)."""
    time.sleep(delay_s)
    return [observe(call_id) for call_id in call_ids]


def parse_answer(message: str, pending: set[int]) -> tuple[int, str]:
    """(id, content) of a client's answer to one of the `pending` calls; InferletError else."""
    try:
        answer = json.loads(message)
    except ValueError:
        raise inferlet.InferletError(f"tool answer is not JSON: {message[:80]!r}") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("content"), str):
        raise inferlet.InferletError('a tool answer must be {"id": N, "content": TEXT}')
    call_id = answer.get("id")
    if type(call_id) is not int or call_id not in pending:
        raise inferlet.InferletError(f"tool answer id {call_id!r} is not a pending call "
                                     f"{sorted(pending)}")
    return call_id, answer["content"]


def run_on_client(call_ids: list[int], query: str) -> list[str]:
    """Send every call of `call_ids` to the client, then collect the answers in any order."""
    for call_id in call_ids:
        inferlet.send_json({"type": "tool_call", "id": call_id, "name": "search",
                            "arguments": {"query": query}})
    contents: dict[int, str] = {}
    while len(contents) < len(call_ids):
        call_id, content = parse_answer(inferlet.receive(), set(call_ids) - set(contents))
        contents[call_id] = content
    return [f"Observation {call_id + 1}: {contents[call_id]}" for call_id in call_ids]


def run_http(call_ids: list[int], query: str, url: str) -> list[str]:
    """GET `url`?q=query for every call of `call_ids`, all in flight at once; the first result
    of each answer is its observation."""
    pending = [inferlet.http.start("GET", f"{url}?q={quote(query[:MAX_QUERY_CHARS])}")
               for _ in call_ids]
    observations = []
    for call_id, request in zip(call_ids, pending):
        answer = request.result().raise_for_status().json()
        results = answer.get("results") if isinstance(answer, dict) else None
        first = results[0] if isinstance(results, list) and results else "(no result)"
        observations.append(f"Observation {call_id + 1}: {str(first)[:200]}")
    return observations


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="react", description="A ReAct agent with a tool.")
    parser.add_argument("--task", default="Find the tallest mountain in Europe.")
    parser.add_argument("--system", default=SYSTEM)
    parser.add_argument("--num-calls", type=int, default=3, help="tool calls before the answer")
    parser.add_argument("--calls-per-turn", type=int, default=1, help="concurrent calls a turn")
    parser.add_argument("--tool", choices=TOOLS, default="simulated")
    parser.add_argument("--delay-ms", type=float, default=100.0, help="simulated tool latency")
    parser.add_argument("--tool-url", default="", help="the http tool's search URL")
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--system-export", default="", help="export name of the system prompt")
    parser.add_argument("--release", action="store_true", help="release the export at the end")
    parser.add_argument("--timings", action="store_true", help="return each turn's phases")
    opts = parser.parse_args(args)
    if not 0 <= opts.num_calls <= MAX_CALLS or opts.delay_ms < 0 or opts.calls_per_turn < 1:
        raise inferlet.InferletError(f"--num-calls must be in [0, {MAX_CALLS}], --delay-ms >= 0 "
                                     f"and --calls-per-turn >= 1")
    if opts.tool == "http" and not opts.tool_url:
        raise inferlet.InferletError("--tool http needs --tool-url")

    ctx, imported = inferlet.shared_system_context(opts.system, opts.system_export)
    ctx.fill_user(opts.task)
    turns, observations, num_generated, timings = [], [], 0, []
    for num_turn_calls in turn_sizes(opts.num_calls, opts.calls_per_turn):
        started = time.perf_counter()
        generation = ctx.generation(opts.turn_tokens).run()   # thought + actions
        generated = time.perf_counter()
        turns.append(generation.text)
        num_generated += len(generation.token_ids)
        call_ids = list(range(len(observations), len(observations) + num_turn_calls))
        if opts.tool == "client":
            turn_observations = run_on_client(call_ids, generation.text)
        elif opts.tool == "http":
            turn_observations = run_http(call_ids, generation.text, opts.tool_url)
        else:
            turn_observations = run_simulated(call_ids, opts.delay_ms / 1000)
        timings.append({"generate_s": generated - started,
                        "tool_s": time.perf_counter() - generated})
        observations += turn_observations
        ctx.fill_user("\n".join(turn_observations))
    started = time.perf_counter()
    final = ctx.generation(opts.turn_tokens).run()
    timings.append({"generate_s": time.perf_counter() - started, "tool_s": 0.0})
    num_generated += len(final.token_ids)
    num_context_tokens = len(ctx.token_ids)
    ctx.close()
    if opts.release and opts.system_export:
        inferlet.release_export(opts.system_export)
    result = {"turns": turns, "observations": observations, "answer": final.text,
              "num_generated": num_generated, "num_context_tokens": num_context_tokens,
              "imported": imported, "calls_per_turn": opts.calls_per_turn}
    if opts.timings:
        result["timings"] = timings
    return result
