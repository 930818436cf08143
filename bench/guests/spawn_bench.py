"""Benchmark guest for bench/children.py: spawn-to-first-token of a child inferlet.

    parent N PROMPT   N times: spawn a child of this program, take its report, wait for its
                      end, then the same first token in a fresh Context of its own (pairs side
                      by side). Result: JSON [[start_s, token_s, own_token_s], ...] (seconds
                      from just before the spawn / the Context's creation)
    child T0 PROMPT   report [entered - T0, first token - T0] (wall clock, seconds) to the parent
    parent-import N PROMPT   the prompt's KV computed once and exported; then N times: spawn a
                      child that imports it and samples one token (one decode pass: the
                      prompt's last token again, its page copied), then the same in a fresh
                      import of its own. Result as `parent`
    child-import T0 NAME     report as `child`, the first token sampled after importing NAME
"""
import json
import time

import inferlet


def first_token(prompt: str) -> None:
    ctx = inferlet.Context()
    ctx.fill(prompt)
    ctx.generate_tokens(1, inferlet.sampling.greedy(), stop_token_ids=())


def first_token_imported(name: str) -> None:
    ctx = inferlet.Context.from_import(name)
    ctx.generate_tokens(1, inferlet.sampling.greedy(), stop_token_ids=())
    ctx.close()


def export_prompt(prompt: str) -> str:
    """The prompt's KV computed and exported; the export's name."""
    name = f"spawn-bench/{time.time_ns()}"
    ctx = inferlet.Context()
    ctx.fill(prompt)
    ctx.export(name)
    return name


@inferlet.main
def main(args: list[str]) -> str:
    entered = time.time()
    if args[0] in ("child", "child-import"):
        t0 = float(args[1])
        (first_token if args[0] == "child" else first_token_imported)(args[2])
        inferlet.send(json.dumps([entered - t0, time.time() - t0]))
        return "ok"
    num_runs, prompt = int(args[1]), args[2]
    imported = args[0] == "parent-import"
    name = export_prompt(prompt) if imported else ""
    runs = []
    for _ in range(num_runs):
        t0 = time.time()
        child = inferlet.spawn("", ["child-import", repr(t0), name] if imported
                               else ["child", repr(t0), prompt])
        start, token = json.loads(child.receive())
        child.result()
        t0 = time.time()
        first_token_imported(name) if imported else first_token(prompt)
        runs.append([start, token, time.time() - t0])
    if imported:
        inferlet.release_export(name)
    return json.dumps(runs)
