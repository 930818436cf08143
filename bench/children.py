"""Spawn-to-first-token of a child inferlet, on the real model.

    .venv/bin/python bench/children.py [--runs 20] [--spares 0 21] [--json]

A parent (bench/guests/spawn_bench.py) spawns a child of its own program --runs times, one at
a time; each child fills a short prompt and samples one greedy token, and reports when it
entered its main and when it had its token, from just before the parent's `inferlet.spawn`
(wall clock, read in both guests). Baseline, same run: the parent's own first token in a fresh
Context (the same prompt, the same pass), so "spawn overhead" = child first token - own first
token, the median of the run-by-run differences (each child beside its parent's own pass):
what launching an instance adds. Rows per --spares: the runtime keeps that many
instances instantiated ahead (`Runtime.keep_spares`, made while nothing runs, so at least runs
+ 1 spares cover a whole burst; 0: each child instantiates on its spawn). Medians and p90s.
Goal (issue 55): spawn-to-first-token <= 5 ms.
`--import` adds rows where the parent computes a --prompt-words prompt once and exports it, and
each child imports that export and samples its first token (one decode pass, the prompt's last
token again: what a child continuing its parent's context costs); the baseline is the parent's
own import and token. The plain rows then use the same longer prompt.
`--json` prints one object on the last line.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.engine import load_default_engine  # noqa: E402
from host.sandbox.programs.build import build_cached  # noqa: E402

PROMPT = "The capital of France is"


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(runtime, program, num_runs: int, num_spares: int, prompt: str = PROMPT,
            imported: bool = False) -> dict[str, float]:
    """One parent run of num_runs children with num_spares spares kept: medians / p90 in ms.
    `imported`: each child imports the parent's export of `prompt` (else it prefills it)."""
    runtime.keep_spares(program, num_spares)
    runtime.wait_spares(120)
    mode = "parent-import" if imported else "parent"
    outcome = runtime.wait(runtime.launch(program, [mode, str(num_runs), prompt]), 600)
    assert outcome.status == "ok", outcome
    runs = json.loads(outcome.value)
    tokens = [token for _, token, _ in runs]
    return {"spares": num_spares, "mode": "import" if imported else "prefill",
            "spawn_to_start_ms": _ms([start for start, _, _ in runs], 0.5),
            "spawn_to_first_token_ms": _ms(tokens, 0.5),
            "spawn_to_first_token_p90_ms": _ms(tokens, 0.9),
            "own_first_token_ms": _ms([own for _, _, own in runs], 0.5),
            "spawn_overhead_ms": _ms([token - own for _, token, own in runs], 0.5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--spares", type=int, nargs="+", default=None,
                        help="spares kept per row (default: 0 and runs + 1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--import", dest="imported", action="store_true",
                        help="also rows where each child imports the parent's exported prompt")
    parser.add_argument("--prompt-words", type=int, default=0,
                        help="the prompt: this many words (0: a 5-token sentence)")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    from host import Runtime, RuntimeConfig
    from host.runtime import SpawnHooks
    spares = opts.spares if opts.spares is not None else [0, opts.runs + 1]
    wasm_path, _ = build_cached(REPO / "bench" / "guests" / "spawn_bench.py",
                                REPO / ".cache" / "bench-builds")
    engine = load_default_engine(progress=False, seed=0)
    rows = []
    with Runtime(engine, RuntimeConfig(cache_dir=REPO / ".cache" / "pie-bench",
                                       max_spare_instances=max(spares + [1]))) as runtime:
        program = runtime.load_program(wasm_path.read_bytes())
        runtime.set_spawn_hooks(SpawnHooks())                # children of its own program
        prompt = PROMPT if opts.prompt_words <= 0 else " ".join(
            f"word{i % 50}" for i in range(opts.prompt_words))
        measure(runtime, program, 2, 0, prompt)                      # warm: memories, kernels
        for num_spares in spares:
            rows.append(measure(runtime, program, opts.runs, num_spares, prompt))
            if opts.imported:
                rows.append(measure(runtime, program, opts.runs, num_spares, prompt, True))
    out = sys.stderr if opts.json else sys.stdout
    print(f"machine: {platform.machine()} {platform.processor() or ''}, torch threads "
          f"{opts.threads}, {opts.runs} children per row, prompt {len(prompt.split())} words",
          file=out)
    print(f"{'spares':>6} {'mode':>7} {'spawn->start':>13} {'spawn->token':>13} {'p90':>8} "
          f"{'own token':>10} {'overhead':>9}", file=out)
    for row in rows:
        print(f"{row['spares']:>6} {row['mode']:>7} {row['spawn_to_start_ms']:>10.2f} ms "
              f"{row['spawn_to_first_token_ms']:>10.2f} ms "
              f"{row['spawn_to_first_token_p90_ms']:>5.1f} ms "
              f"{row['own_first_token_ms']:>7.2f} ms {row['spawn_overhead_ms']:>6.2f} ms", file=out)
    if opts.json:
        print(json.dumps({"runs": opts.runs, "rows": rows}))


if __name__ == "__main__":
    main()
