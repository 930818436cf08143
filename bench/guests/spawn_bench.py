"""Benchmark guest for bench/children.py: spawn-to-first-token of a child inferlet.

    parent N PROMPT   N times: spawn a child of this program, take its report, wait for its
                      end, then the same first token in a fresh Context of its own (pairs side
                      by side). Result: JSON [[start_s, token_s, own_token_s], ...] (seconds
                      from just before the spawn / the Context's creation)
    child T0 PROMPT   report [entered - T0, first token - T0] (wall clock, seconds) to the parent
"""
import json
import time

import inferlet


def first_token(prompt: str) -> None:
    ctx = inferlet.Context()
    ctx.fill(prompt)
    ctx.generate_tokens(1, inferlet.sampling.greedy(), stop_token_ids=())


@inferlet.main
def main(args: list[str]) -> str:
    entered = time.time()
    if args[0] == "child":
        t0 = float(args[1])
        first_token(args[2])
        inferlet.send(json.dumps([entered - t0, time.time() - t0]))
        return "ok"
    num_runs, prompt = int(args[1]), args[2]
    runs = []
    for _ in range(num_runs):
        t0 = time.time()
        child = inferlet.spawn("", ["child", repr(t0), prompt])
        start, token = json.loads(child.receive())
        child.result()
        t0 = time.time()
        first_token(prompt)
        runs.append([start, token, time.time() - t0])
    return json.dumps(runs)
