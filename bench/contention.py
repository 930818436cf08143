"""Suspend and restore under an oversubscribed KV pool, on the real engine (issue 53).

64 instances of tests/host/wat/grower.wat (a prompt of about `--prompt-tokens` tokens, then
`--decode` greedy tokens, one pass each, a page allocated only when the sequence needs it) run
at once, on the embedded default model in float32:

- unconstrained: a pool with room for every instance at its peak (the reference outputs);
- 2x: a pool where each instance's peak is 1/32 of it (64 instances: twice the pool);
- 4x: each peak 1/16 of the pool;
- 4x recompute: the same, the suspended pages recomputed by a prefill on restore instead of
  copied (RuntimeConfig.restore "recompute"; the other rows take "auto", which swaps on a CPU);
- hoarding: two tenants; tenant "hog" holds pages it never uses (instances of holder.wat, 3/4
  of the pool in all), tenant "fair" runs 32 growers, its share (half the pool) 2x
  oversubscribed by them; and the same 32 alone on a pool of that share (their suspensions
  beside the hog, against those their share alone causes).

For each: completed_fraction, outputs_identical (to the unconstrained run's, prompt by prompt),
throughput_vs_unconstrained (decoded tokens per second over the unconstrained run's), latency
p50 / p99 (launch to end, s), the suspensions and restores, pages swapped and recomputed, and
the restore costs the runtime measured at start (host/restore_costs.py). One Runtime per run;
the engine is loaded once (its pool the largest; smaller pools are the same engine behind a
smaller `num_pages`).

Run from the repo root: .venv/bin/python bench/contention.py [--json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

import torch  # noqa: E402

from engine import load_default_engine  # noqa: E402
from host.runtime import Runtime  # noqa: E402
from host.runtime_config import InstanceLimits, RuntimeConfig  # noqa: E402
from tests.host.components import ComponentBuilder  # noqa: E402

PAGE_SIZE = 16
NUM_INSTANCES = 64


class SmallerPool:
    """The engine behind a pool of `num_pages` (page ids below it only): the runtime's
    allocator is sized from `num_pages`; everything else is the engine's."""

    def __init__(self, engine, num_pages: int) -> None:
        self._engine = engine
        self.num_pages = num_pages

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


def prompts(count: int, num_tokens: int) -> list[str]:
    """Distinct prompts of about `num_tokens` tokens each."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    return [" ".join([f"Case {i}:"] + [words[(i * 7 + k) % len(words)]
                                        for k in range(num_tokens - 3)])
            for i in range(count)]


def run_growers(runtime: Runtime, program, texts: list[str], decode: str,
                tenant: str = "default") -> dict:
    started = time.monotonic()
    ids = {text: (runtime.launch(program, [text, decode], tenant=tenant), time.monotonic())
           for text in texts}
    outcomes, latencies = {}, []
    for text, (instance_id, launched) in ids.items():
        outcome = runtime.wait(instance_id, timeout=1800)
        outcomes[text] = (outcome.status, outcome.value)
        latencies.append(time.monotonic() - launched)
    wall_s = time.monotonic() - started
    return {"outcomes": outcomes, "latencies": sorted(latencies), "wall_s": wall_s}


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(name: str, result: dict, reference: dict | None, num_decode: int,
              runtime: Runtime, reference_tps: float | None, peaks: dict[str, int],
              tenant: str | None = None) -> dict:
    outcomes = result["outcomes"]
    demand = sum(peaks[text] for text in outcomes)
    completed = [text for text, (status, _) in outcomes.items() if status == "ok"]
    tps = len(completed) * num_decode / result["wall_s"]
    stats = runtime.statistics().suspensions
    figures = {
        "scenario": name,
        "num_pages": runtime.page_allocator.num_pages,
        "instances": len(outcomes),
        "peak_demand_pages": demand,                 # every instance at its peak at once
        "oversubscription": round(demand / runtime.page_allocator.num_pages, 2),
        "completed_fraction": len(completed) / len(outcomes),
        "failures": sorted({value[:120] for status, value in outcomes.values() if status != "ok"}),
        "outputs_identical": (None if reference is None else
                              all(outcomes[t] == reference["outcomes"][t] for t in outcomes)),
        "wall_s": round(result["wall_s"], 2),
        "decoded_tokens_per_s": round(tps, 2),
        "throughput_vs_unconstrained": (None if reference_tps is None
                                        else round(tps / reference_tps, 3)),
        "latency_p50_s": round(quantile(result["latencies"], 0.5), 2),
        "latency_p99_s": round(quantile(result["latencies"], 0.99), 2),
        "suspensions": stats.num_suspensions,
        "restores": stats.num_restores,
        "swapped_pages": stats.num_swapped_pages,
        "recomputed_pages": stats.num_recomputed_pages,
        "restore_costs": runtime.restore_costs.describe(),
        "suspended_s_total": round(stats.suspended_s, 2),
        "suspensions_by_tenant": dict(stats.tenant_suspensions),
    }
    if tenant is not None:
        figures["tenant"] = tenant
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=12,
                        help="about this many prompt tokens (12: every peak is 3 pages)")
    parser.add_argument("--decode", type=int, default=20,
                        help="greedy tokens each instance decodes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    max_peak_pages = -(-(4 * args.prompt_tokens + args.decode) // PAGE_SIZE)
    engine = load_default_engine(progress=False, page_size=PAGE_SIZE,
                                 num_pages=NUM_INSTANCES * max_peak_pages, dtype="float32",
                                 max_batch_tokens=4096)
    texts = prompts(NUM_INSTANCES, args.prompt_tokens)
    # an instance's peak: its prompt's tokens and the decoded ones it feeds back (all but the
    # last), in whole pages
    peaks = {text: -(-(len(engine.tokenizer.encode(text)) + args.decode - 1) // PAGE_SIZE)
             for text in texts}
    peak_pages = max(peaks.values())
    if peak_pages > max_peak_pages:
        raise SystemExit(f"prompts of {peak_pages} pages at their peak: use fewer tokens")
    header = {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "model": engine.model_name, "dtype": "float32", "page_size": PAGE_SIZE,
              "instances": NUM_INSTANCES, "decode_tokens": args.decode,
              "prompt_tokens_about": args.prompt_tokens, "peak_pages": peak_pages,
              "peak_pages_min": min(peaks.values())}
    builder = ComponentBuilder()
    grower, holder = builder.component("grower"), builder.component("holder")
    decode = "d" * args.decode
    results = []
    with tempfile.TemporaryDirectory() as cache_dir:
        def runtime_for(num_pages: int, **config) -> Runtime:
            config.setdefault("restore", "auto")        # what `pie serve` runs
            return Runtime(SmallerPool(engine, num_pages), RuntimeConfig(
                cache_dir=Path(cache_dir), limits=InstanceLimits(max_idle_s=600.0), **config))

        with runtime_for(NUM_INSTANCES * peak_pages) as runtime:
            program = runtime.load_program(grower)
            run_growers(runtime, program, texts[:4], decode)                     # warm
            reference = run_growers(runtime, program, texts, decode)
            results.append(summarize("unconstrained", reference, None, args.decode, runtime,
                                     None, peaks))
        reference_tps = results[0]["decoded_tokens_per_s"]
        for factor, restore in ((2, "auto"), (4, "auto"), (4, "recompute")):
            with runtime_for(NUM_INSTANCES * peak_pages // factor, restore=restore) as runtime:
                program = runtime.load_program(grower)
                result = run_growers(runtime, program, texts, decode)
                name = f"{factor}x" + ("" if restore == "auto" else f" {restore}")
                results.append(summarize(name, result, reference, args.decode, runtime,
                                         reference_tps, peaks))
        # hoarding: the hog's holders take 3/4 of a pool sized for 32 growers' peaks at 2x
        num_pages = NUM_INSTANCES * peak_pages // 2
        with runtime_for(num_pages) as runtime:
            program = runtime.load_program(grower)
            hog_program = runtime.load_program(holder)
            hog_pages = num_pages * 3 // 4 // 4
            hogs = [runtime.launch(hog_program, ["x" * hog_pages], tenant="hog")
                    for _ in range(4)]
            time.sleep(1.0)
            fair_texts = texts[:NUM_INSTANCES // 2]
            result = run_growers(runtime, program, fair_texts, decode, tenant="fair")
            figures = summarize("hoarding", result,
                                {"outcomes": {t: reference["outcomes"][t] for t in fair_texts}},
                                args.decode, runtime, reference_tps, peaks, tenant="fair")
            for hog in hogs:
                runtime.send(hog, "")
            figures["hog_outcomes"] = sorted({runtime.wait(h, timeout=60).status for h in hogs})
            figures["hog_pages"] = 4 * hog_pages
            figures["fair_share_pages"] = num_pages // 2
            results.append(figures)
        # the same 32 growers alone on a pool of the fair tenant's share: its own suspensions
        with runtime_for(num_pages // 2) as runtime:
            program = runtime.load_program(grower)
            result = run_growers(runtime, program, fair_texts, decode, tenant="fair")
            results.append(summarize("fair alone on its share", result,
                                     {"outcomes": {t: reference["outcomes"][t]
                                                   for t in fair_texts}},
                                     args.decode, runtime, reference_tps, peaks, tenant="fair"))
    if args.json:
        print(json.dumps({"header": header, "results": results}, indent=2))
        return
    print("# " + ", ".join(f"{k} {v}" for k, v in header.items()))
    for figures in results:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
