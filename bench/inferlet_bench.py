"""Inferlets through Wasm vs the engine's own loop, on the real model.

    python bench/inferlet_bench.py [--tokens 64] [--repeats 3] [--widths 1 8 64] [--dtype auto]
                                   [--json]

Rows (medians of --repeats runs, wall time; the greedy rows' engine and wasm runs in alternated
pairs, their ratio the median of the pairs', after one untimed run of each side at that width:
a first run at a new width pays what a running server has paid already, the memories of the
instances it adds mapped fresh, ~30 ms of system time each on a VM with a balloon driver):
  greedy x1   text_completion (--ignore-eos, greedy; on host loops, or --step-by-step) vs
              Engine.generate_greedy, same prompt/tokens
  greedy x8   8 concurrent instances vs Engine.generate_greedy_batch of the 8 prompts
  greedy x64  the same with 64 (the 8 prompts, each numbered)
  forks x8    parallel_generation with 8 forks vs 8 independent text_completion instances
              (same prefix + suffixes): prefill tokens computed, tokens/s
  launch      launch-to-result of a cached component (--help, no model work); load of a
              compiled component from the disk cache in a fresh Runtime
The Wasm runs' runtime keeps as many instances of text_completion instantiated ahead as the
row's width (`Runtime.keep_spares`, `--spares N` to change, 0: none), made while nothing runs:
the bench waits for them before every timed run of either side, as a server between bursts.
The ratio column is wasm time / engine time (target: within 1.03). Beside it, "outside the
forwards": the time the Wasm run spends outside `engine.forward` (instance starts and ends, the
host between passes) less the engine loop's, as a fraction of the engine loop's wall; the
forwards' own drift between runs (+-10% here) cancels out of it. It is split into before the
first forward (instance starts), between forwards (the host's work per step) and after the
last (instance ends). `--json` prints one object:
wasm_vs_engine_8 / _64 (the greedy ratios), wasm_vs_engine_W_ci95 (a bootstrap 95% interval
of that median: [low, high]), wasm_forwards_vs_engine_W (the median pair's ratio of the time
inside the forwards alone: the machine's drift, plus any slowing of the forwards by the host),
wasm_outside_forwards_8 / _64 and its three parts' medians (wasm_outside_starts_W: before the
first forward, _steps_W: between, _ends_W: after the last), and runs only the greedy rows.
"""
from __future__ import annotations

import argparse
import json
import random
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
from host.scheduling.scheduler import SchedulerPolicy  # noqa: E402

PROMPTS = [f"Write a short story about a {animal} who learns to" for animal in
           ("cat", "dog", "fox", "owl", "bear", "wolf", "frog", "hare")]
WIDTHS = (1, 8, 64)
PREFIX = "Here is a list of eight short stories about animals, each one a single sentence.\n"


class ForwardClock:
    """Sums the time spent in `engine.forward` (both paths call it on the instance): what a run
    spends outside it is the loop's own (the engine's) or the host's and the guests' (Wasm)."""

    def __init__(self, engine) -> None:
        self.seconds = 0.0
        self.first_started: float | None = None   # since the last `restart`
        self.last_ended: float | None = None
        self._forward = engine.forward
        engine.forward = self._timed

    def restart(self) -> None:
        """Forget the first and last forward (a run begins)."""
        self.first_started = self.last_ended = None

    def _timed(self, batch):
        started = time.perf_counter()
        if self.first_started is None:
            self.first_started = started
        try:
            return self._forward(batch)
        finally:
            self.last_ended = time.perf_counter()
            self.seconds += self.last_ended - started


def timed_run(run, clock: ForwardClock) -> tuple[float, tuple[float, float, float]]:
    """(wall s, (s before its first forward, s between forwards, s after its last)) of one
    call of `run`."""
    forward_s = clock.seconds
    clock.restart()
    started = time.perf_counter()
    run()
    ended = time.perf_counter()
    wall = ended - started
    before = (clock.first_started or ended) - started
    after = ended - (clock.last_ended or ended)
    return wall, (before, wall - (clock.seconds - forward_s) - before - after, after)


def median_ci(values: list[float], level: float = 0.95, num_resamples: int = 2000
              ) -> tuple[float, float]:
    """A percentile-bootstrap interval for the median of `values` (resampled with replacement,
    a fixed seed: the same values give the same interval). With 15 pairs whose ratios spread
    by +-10% (this VM's drift between two runs), it is about +-4% wide: a median above 1.03
    whose interval reaches well below it does not show a host slower than the goal."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(num_resamples))
    tail = (1 - level) / 2
    return medians[int(tail * num_resamples)], medians[int((1 - tail) * num_resamples) - 1]


def wall_seconds(run) -> float:
    """The wall time of one call of `run`."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def median_time(fn, repeats: int) -> float:
    return statistics.median(wall_seconds(fn) for _ in range(repeats))


def run_all(runtime: Runtime, program, arg_lists: list[list[str]]) -> list[str]:
    """Launch every instance at once, wait for all; returns their results."""
    ids = [runtime.launch(program, args) for args in arg_lists]
    outcomes = [runtime.wait(i, timeout=600) for i in ids]
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        raise SystemExit(f"an instance failed: {bad[0]}")
    return [o.value for o in outcomes]


def completion_args(prompt: str, num_tokens: int, step_by_step: bool = False) -> list[str]:
    return (["--prompt", prompt, "--max-tokens", str(num_tokens), "--ignore-eos", "--json"]
            + (["--step-by-step"] if step_by_step else []))


def prompts_of(width: int) -> list[str]:
    """`width` prompts: the 8 of PROMPTS, numbered once there are more than 8."""
    if width <= len(PROMPTS):
        return PROMPTS[:width]
    return [f"{PROMPTS[i % len(PROMPTS)]} (story {i + 1})" for i in range(width)]


def paired_times(engine_run, wasm_run, repeats: int, clock: ForwardClock, settle=lambda: None
                 ) -> tuple[float, float, list[float], list[float], list[float], list[float]]:
    """(engine s, wasm s, each pair's wasm / engine, each pair's outside share, the medians of
    that share's three parts, each pair's wasm / engine time inside the forwards): medians of
    the times over `repeats` pairs, the two runs of a pair back to back and their order
    alternated, so that both sides of each ratio see the same phase of the machine (its speed
    drifts by 20-30% over tens of seconds here: timing all engine runs, then all wasm runs,
    moved the 64-instance ratio between 0.8 and 1.2). A pair's outside share is (wasm's time
    outside the forwards - the engine loop's) / the engine loop's wall: what the host and the
    guests add, free of the forwards' own drift (it misses forwards made slower by host work
    beside them, which the ratio counts). Its parts: before the first forward (instance starts),
    between forwards, after the last (instance ends). `settle()` is called before every timed
    run, either side (the runtime's spares made)."""
    engine_times, wasm_times = [], []
    parts: dict[str, list[tuple[float, float, float]]] = {"engine": [], "wasm": []}
    pair = [(engine_run, engine_times, "engine"), (wasm_run, wasm_times, "wasm")]
    for repeat in range(repeats):
        for run, times, side in (pair if repeat % 2 == 0 else pair[::-1]):
            settle()
            wall, split = timed_run(run, clock)
            times.append(wall)
            parts[side].append(split)
    pair_ratios = [w / e for w, e in zip(wasm_times, engine_times)]
    part_shares = [[(w - e) / engine for w, e in zip(wasm_split, engine_split)]
                   for wasm_split, engine_split, engine in
                   zip(parts["wasm"], parts["engine"], engine_times)]
    outside_shares = [sum(shares) for shares in part_shares]
    part_medians = [statistics.median(column) for column in zip(*part_shares)]
    forward_ratios = [(w - sum(w_split)) / (e - sum(e_split)) for w, e, w_split, e_split
                      in zip(wasm_times, engine_times, parts["wasm"], parts["engine"])]
    return (statistics.median(engine_times), statistics.median(wasm_times), pair_ratios,
            outside_shares, part_medians, forward_ratios)


def bench_greedy(runtime, engine, program, num_tokens: int, repeats: int, clock: ForwardClock,
                 out=sys.stdout, step_by_step: bool = False, spares: int | None = None,
                 widths: tuple[int, ...] = WIDTHS) -> dict[str, float]:
    """Greedy completion through Wasm vs the engine's batched loop; {wasm_vs_engine_W: the
    median of paired runs' ratios, wasm_outside_forwards_W: the median outside share,
    wasm_outside_{starts,steps,ends}_W: its parts' medians, the interval and the forwards'
    ratio} for the widths 8 and 64 of `widths` (the rows run). The inferlets decode on host
    loops (the SDK's default), or `step_by_step`. The runtime keeps `spares` instances of the
    program instantiated ahead (None: as many as the width), made between the runs
    (`Runtime.wait_spares` before each timed run, engine or Wasm)."""
    encode = engine.tokenizer.encode
    figures = {}
    for width in widths:
        prompts = prompts_of(width)
        arg_lists = [completion_args(p, num_tokens, step_by_step) for p in prompts]
        wasm_counts = {"requests": 0, "batches": 0}

        def wasm_run() -> None:
            before = runtime.statistics().engine
            run_all(runtime, program, arg_lists)
            after = runtime.statistics().engine
            wasm_counts["requests"] += after.num_requests - before.num_requests
            wasm_counts["batches"] += after.num_batches - before.num_batches

        def engine_run() -> list[list[int]]:
            return engine.generate_greedy_batch([encode(p) for p in prompts], num_tokens)

        runtime.keep_spares(program, width if spares is None else spares)
        runtime.wait_spares(60)
        run_all(runtime, program, arg_lists)           # untimed: the width's first run
        engine_run()
        engine_s, wasm_s, pair_ratios, outside_shares, parts, forward_ratios = paired_times(
            engine_run, wasm_run, repeats, clock, lambda: runtime.wait_spares(60))
        ratio, outside = statistics.median(pair_ratios), statistics.median(outside_shares)
        ci_low, ci_high = median_ci(pair_ratios)
        forwards = statistics.median(forward_ratios)
        mean_batch = wasm_counts["requests"] / max(1, wasm_counts["batches"])
        results = run_all(runtime, program, arg_lists)
        same = [json.loads(r)["token_ids"] for r in results] == engine_run()
        total = width * num_tokens
        if width in (8, 64):
            figures[f"wasm_vs_engine_{width}"] = round(ratio, 4)
            figures[f"wasm_vs_engine_{width}_ci95"] = [round(ci_low, 4), round(ci_high, 4)]
            figures[f"wasm_forwards_vs_engine_{width}"] = round(forwards, 4)
            figures[f"wasm_outside_forwards_{width}"] = round(outside, 4)
            for name, part in zip(("starts", "steps", "ends"), parts):
                figures[f"wasm_outside_{name}_{width}"] = round(part, 4)
        print(f"greedy x{width:<3} engine {engine_s:7.3f} s ({total / engine_s:7.1f} tok/s)   "
              f"wasm {wasm_s:7.3f} s ({total / wasm_s:7.1f} tok/s)   ratio {ratio:5.3f} (95% CI "
              f"{ci_low:.3f}-{ci_high:.3f}; pairs "
              f"{', '.join(f'{r:.3f}' for r in pair_ratios)})   outside the forwards "
              f"{outside:+.3f} (pairs {', '.join(f'{r:+.3f}' for r in outside_shares)}; "
              f"the forwards' own ratio {forwards:.3f}; "
              f"before the first {parts[0]:+.3f}, between {parts[1]:+.3f}, after the last "
              f"{parts[2]:+.3f})   "
              f"same tokens: {same}   wasm mean batch {mean_batch:.2f}", file=out)
    return figures


def bench_forks(runtime, engine, parallel, completion, num_tokens: int, repeats: int) -> None:
    suffixes = [f"Story {i + 1}:" for i in range(8)]
    fork_args = ["--prefix", PREFIX, "--max-tokens", str(num_tokens)]
    for suffix in suffixes:
        fork_args += ["--suffix", suffix]
    separate_args = [completion_args(PREFIX + s, num_tokens) for s in suffixes]

    def measure(program, arg_lists):
        before = runtime.statistics().engine.num_input_tokens
        seconds = median_time(lambda: run_all(runtime, program, arg_lists), repeats)
        computed = (runtime.statistics().engine.num_input_tokens - before) // repeats
        return seconds, computed

    fork_s, fork_tokens = measure(parallel, [fork_args])
    sep_s, sep_tokens = measure(completion, separate_args)
    prefix_len = len(engine.tokenizer.encode(PREFIX))
    total = 8 * num_tokens
    print(f"forks x8    8 forks {fork_s:7.3f} s ({total / fork_s:7.1f} tok/s, {fork_tokens} tokens "
          f"computed)   8 instances {sep_s:7.3f} s ({total / sep_s:7.1f} tok/s, {sep_tokens} "
          f"computed)   prefill saved {sep_tokens - fork_tokens} tokens (prefix {prefix_len} x 7 = "
          f"{prefix_len * 7})   speed-up {sep_s / fork_s:5.2f}")
    print("            (forks stop at stop tokens, instances use --ignore-eos: token counts are "
          "upper bounds for the forks)")


def bench_launch(runtime, engine, wasm_path: Path, program, repeats: int) -> None:
    launch_s = median_time(lambda: run_all(runtime, program, [["--help"]]), max(repeats, 5))
    with Runtime(engine, runtime.config) as fresh:
        wasm_bytes = wasm_path.read_bytes()
        start = time.perf_counter()
        fresh.load_program(wasm_bytes)
        load_s = time.perf_counter() - start
    print(f"launch      cached component launch-to-result {launch_s * 1e3:7.1f} ms   "
          f"load from the disk cache (fresh Runtime) {load_s * 1e3:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS),
                        choices=WIDTHS, help="the greedy rows to run (e.g. --widths 8: that "
                        "row alone, its pairs cheap enough to repeat 60 times)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--json", action="store_true",
                        help="greedy rows only; print {wasm_vs_engine_8 / _64, "
                             "wasm_outside_forwards_8 / _64 and its parts}")
    parser.add_argument("--policy", default="adaptive", choices=("adaptive", "k-or-t"),
                        help="the scheduler policy of the Wasm path (k-or-t: k=8, t=--t-ms)")
    parser.add_argument("--t-ms", type=float, default=2.0)
    parser.add_argument("--no-run-on-waiter", action="store_true",
                        help="adaptive: every batch on the engine thread (the old behaviour)")
    parser.add_argument("--max-hold-ms", type=float, default=SchedulerPolicy.max_hold_ms,
                        help="adaptive: the longest hold after a batch")
    parser.add_argument("--hold-fraction", type=float, default=SchedulerPolicy.hold_fraction,
                        help="adaptive: the hold's bound as a fraction of the batch's engine time")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval for this process (GIL hand-off latency)")
    parser.add_argument("--overlap", choices=("on", "off"), default=None,
                        help="overlapped batches (SchedulerPolicy.overlap; default: the "
                             "runtime's choice for the engine)")
    parser.add_argument("--chain-steps", type=int, default=None,
                        help="engine steps a batch of host loops' passes runs before the host "
                             "resolves it (SchedulerPolicy.chain_steps; default: the runtime's "
                             "choice, 4 on a CPU)")
    parser.add_argument("--start-hold-ms", type=float, default=None,
                        help="adaptive: the longest wait of launched instances' first passes for "
                             "the others starting (0: none; default: the runtime's choice)")
    parser.add_argument("--memory-pool-mb", type=int, default=RuntimeConfig.memory_pool_mb,
                        help="counted memories: ended instances' memories kept for reuse "
                             "(RuntimeConfig.memory_pool_mb; 0: none)")
    parser.add_argument("--memories", choices=("counted", "wasmtime"), default="counted",
                        help="linear memories counted by the host (RuntimeConfig."
                             "count_linear_memory, as `pie run` and `pie serve`) or Wasmtime's own")
    parser.add_argument("--start-slots", type=int, default=None,
                        help="instances starting at once (RuntimeConfig.start_slots; default "
                             "twice the cores, 0: no gate)")
    parser.add_argument("--freeze-heap", choices=("on", "off"), default="on",
                        help="RuntimeConfig.freeze_heap, as `pie serve` and `pie run` set it")
    parser.add_argument("--spares", type=int, default=None,
                        help="instances of the program the runtime keeps instantiated ahead "
                             "(Runtime.keep_spares; default: the width of each row, 0: none)")
    parser.add_argument("--step-by-step", action="store_true",
                        help="the inferlets decode one forward.submit per token, not on host loops")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "pie-bench")
    opts = parser.parse_args()
    if opts.switch_interval_ms is not None:
        sys.setswitchinterval(opts.switch_interval_ms / 1000)
    builds = opts.cache_dir / "builds"
    completion_path, _ = build_cached(REPO / "inferlets/examples/text_completion.py", builds)
    parallel_path, _ = build_cached(REPO / "inferlets/examples/parallel_generation.py", builds)
    engine = load_default_engine(progress=False, dtype=opts.dtype)
    policy = SchedulerPolicy(opts.policy, k=8, t_ms=opts.t_ms, max_hold_ms=opts.max_hold_ms,
                             hold_fraction=opts.hold_fraction,
                             run_on_waiter=not opts.no_run_on_waiter,
                             overlap=None if opts.overlap is None else opts.overlap == "on",
                             start_hold_ms=opts.start_hold_ms, chain_steps=opts.chain_steps)
    out = sys.stderr if opts.json else sys.stdout       # --json: stdout holds the object alone
    config = RuntimeConfig(cache_dir=opts.cache_dir, scheduler=policy,
                           count_linear_memory=opts.memories == "counted",
                           memory_pool_mb=opts.memory_pool_mb,
                           freeze_heap=opts.freeze_heap == "on", start_slots=opts.start_slots)
    with Runtime(engine, config) as runtime:
        print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
              f"{torch.get_num_threads()} torch threads; model {engine.model_name}, dtype "
              f"{opts.dtype}, {opts.tokens} new tokens, median of {opts.repeats}, scheduler "
              f"{runtime.scheduler.policy}, "
              f"{'step by step' if opts.step_by_step else 'host loops'}, {opts.memories} memories"
              f"{f' (pool {opts.memory_pool_mb} MiB)' if opts.memories == 'counted' else ''}"
              f", heap frozen: {opts.freeze_heap}, spares "
              f"{'the width' if opts.spares is None else opts.spares}, start slots "
              f"{getattr(runtime.services.guests.start_gate, 'num_slots', 0)}", file=out)
        completion = runtime.load_program(completion_path.read_bytes())
        parallel = runtime.load_program(parallel_path.read_bytes())
        run_all(runtime, completion, [completion_args("warm up", 4)])   # first-call costs
        engine.generate_greedy(engine.tokenizer.encode("warm up"), 4)
        figures = bench_greedy(runtime, engine, completion, opts.tokens, opts.repeats,
                               ForwardClock(engine), out, opts.step_by_step, opts.spares,
                               tuple(opts.widths))
        runtime.keep_spares(completion, 0)          # the rows below: every start as it comes
        if opts.json:
            print(json.dumps(figures))
            return
        bench_forks(runtime, engine, parallel, completion, opts.tokens, opts.repeats)
        bench_launch(runtime, engine, completion_path, completion, opts.repeats)


if __name__ == "__main__":
    main()
