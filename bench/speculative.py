"""Speculative decoding with prompt lookup vs plain decoding, through Wasm on the real model.

    python bench/speculative.py [--tokens 96] [--repeats 3] [--num-drafts 6] [--json]

The task copies from its prompt (inferlets/examples/speculative.py: "repeat this text exactly"),
where an n-gram drafter guesses well. Both rows run the same example, greedy, side by side in
this run: --no-draft (one token per pass) and with PromptLookupDrafter (one verify pass per
step). Rows: tokens/s (median of --repeats, wall time), forward passes, mean accepted drafts
per verify pass and mean tokens per pass; "same tokens" checks greedy equality.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.engine import load_default_engine  # noqa: E402
from host.sandbox.programs.build import build_cached  # noqa: E402
from host.runtime_config import RuntimeConfig  # noqa: E402
from host.runtime import Runtime  # noqa: E402

TEXT = ("Pie is a programmable serving system: small programs called inferlets run in "
        "WebAssembly and decide, token by token, how a language model generates. The host "
        "batches the forward passes of every inferlet onto one engine, keeps the KV cache in "
        "pages and lets programs share, fork and export them.")


def run_once(runtime: Runtime, program, args: list[str]) -> tuple[dict, float, int]:
    """(the example's JSON result, wall seconds, engine passes) of one instance."""
    before = runtime.statistics().engine.num_requests
    start = time.perf_counter()
    instance_id = runtime.launch(program, args)
    outcome = runtime.wait(instance_id, timeout=900)
    seconds = time.perf_counter() - start
    if outcome.status != "ok":
        raise SystemExit(f"the instance failed: {outcome.value}")
    return json.loads(outcome.value), seconds, runtime.statistics().engine.num_requests - before


def measure(runtime: Runtime, program, args: list[str], repeats: int) -> dict:
    runs = [run_once(runtime, program, args) for _ in range(repeats)]
    result, _, passes = runs[0]
    seconds = statistics.median(s for _, s, _ in runs)
    num_tokens = len(result["token_ids"])
    verify = result["num_verify_passes"]
    return {"token_ids": result["token_ids"], "num_tokens": num_tokens, "seconds": seconds,
            "tokens_per_s": num_tokens / seconds, "num_passes": passes,
            "tokens_per_pass": num_tokens / passes,
            "mean_accepted": result["num_accepted"] / verify if verify else 0.0,
            "num_verify_passes": verify}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-drafts", type=int, default=6)
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "pie-bench")
    opts = parser.parse_args()
    path, _ = build_cached(REPO / "inferlets/examples/speculative.py", opts.cache_dir / "builds")
    engine = load_default_engine(progress=False, dtype=opts.dtype)
    header = {"cpu": platform.processor() or platform.machine(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "model": engine.model_name,
              "dtype": opts.dtype, "max_tokens": opts.tokens, "repeats": opts.repeats,
              "num_drafts": opts.num_drafts}
    common = ["--json", "--text", TEXT, "--max-tokens", str(opts.tokens)]
    with Runtime(engine, RuntimeConfig(cache_dir=opts.cache_dir)) as runtime:
        program = runtime.load_program(path.read_bytes())
        run_once(runtime, program, common[:3] + ["--max-tokens", "4"])          # warm up
        plain = measure(runtime, program, common + ["--no-draft"], opts.repeats)
        drafted = measure(runtime, program, common + ["--num-drafts", str(opts.num_drafts)],
                          opts.repeats)
    figures = {**header, "plain": plain, "drafted": drafted,
               "same_tokens": plain["token_ids"] == drafted["token_ids"],
               "speedup": drafted["tokens_per_s"] / plain["tokens_per_s"]}
    if opts.json:
        print(json.dumps({k: v for k, v in figures.items()}, default=str))
        return
    print(" ".join(f"{k} {v}" for k, v in header.items()))
    for name in ("plain", "drafted"):
        row = figures[name]
        print(f"{name:8} {row['num_tokens']:4d} tokens  {row['seconds']:7.3f} s  "
              f"{row['tokens_per_s']:7.1f} tok/s  {row['num_passes']:4d} passes  "
              f"{row['tokens_per_pass']:5.2f} tok/pass  mean accepted {row['mean_accepted']:.2f}")
    print(f"speedup {figures['speedup']:.2f}x   same tokens: {figures['same_tokens']}")


if __name__ == "__main__":
    main()
