"""llama.cpp (through llama-cpp-python's low-level API) on the same GGUF and prompts as
bench/engine_bench.py: prefill of one prompt, and greedy decode of B sequences in one batch per
step (one llama_batch holding one token of each sequence, as a server would batch them).

It runs in a process of its own (`bench_in_child`: this file as a script, the job as JSON on
stdin, the results as JSON on stdout), with the OpenMP settings the user's environment had:
llama.cpp's CPU backend loads the libgomp torch loaded, and `import engine` sets
OMP_WAIT_POLICY=PASSIVE for ours, which made llama.cpp's decode ~35% slower in one process."""
from __future__ import annotations

import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np

DEFAULT_THREADS = 2
BATCH_TOKENS = 512          # one llama_batch's capacity (and n_batch)


def _call(module, *names: str) -> Callable:
    """The first of `names` the installed llama-cpp-python has (its API renames over versions)."""
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"llama_cpp has none of {names}")


class LlamaCppRunner:
    """One llama.cpp model and context sized for `max_sequences` sequences of `max_tokens`."""

    def __init__(self, path: str, max_sequences: int, max_tokens: int,
                 num_threads: int = DEFAULT_THREADS) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self._silence = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(self._silence, ctypes.c_void_p(0))     # no model dump on stderr
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = _call(llama_cpp, "llama_model_load_from_file", "llama_load_model_from_file")(
            path.encode(), model_params)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_sequences * max_tokens
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = max_sequences
        params.n_threads = params.n_threads_batch = num_threads
        if hasattr(params, "kv_unified"):
            params.kv_unified = True
        self.ctx = _call(llama_cpp, "llama_init_from_model", "llama_new_context_with_model")(
            self.model, params)
        vocab = llama_cpp.llama_model_get_vocab(self.model) if hasattr(
            llama_cpp, "llama_model_get_vocab") else self.model
        self.vocab_size = _call(llama_cpp, "llama_vocab_n_tokens", "llama_n_vocab")(vocab)
        self.batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, max_sequences)

    def clear(self) -> None:
        lib = self.lib
        if hasattr(lib, "llama_memory_clear"):
            lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        else:
            _call(lib, "llama_kv_self_clear", "llama_kv_cache_clear")(self.ctx)

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """tokens: (token id, position, sequence id, wants logits), at most BATCH_TOKENS."""
        batch = self.batch
        for i, (token, position, sequence, logits) in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = sequence
            batch.logits[i] = logits
        batch.n_tokens = len(tokens)
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(self, i: int) -> int:
        pointer = self.lib.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)),
                                         shape=(self.vocab_size,)).argmax())

    def feed_prompt(self, prompt: list[int], sequence: int) -> int:
        """Decode `prompt` into `sequence` in batches of BATCH_TOKENS, logits at its last token;
        returns that token's index in the last batch (for argmax)."""
        for start in range(0, len(prompt), BATCH_TOKENS):
            chunk = prompt[start:start + BATCH_TOKENS]
            self.decode([(t, start + i, sequence, start + i == len(prompt) - 1)
                         for i, t in enumerate(chunk)])
        return (len(prompt) - 1) % BATCH_TOKENS

    def prefill(self, prompt: list[int]) -> None:
        self.clear()
        self.feed_prompt(prompt, 0)

    def greedy(self, prompts: list[list[int]], num_new_tokens: int) -> None:
        """Prefill every prompt (one decode each), then num_new_tokens - 1 batched decode steps;
        `decode_started` is the perf_counter time the steps began."""
        self.clear()
        next_ids = []
        for s, prompt in enumerate(prompts):
            next_ids.append(self.argmax(self.feed_prompt(prompt, s)))
        self.decode_started = time.perf_counter()
        for step in range(num_new_tokens - 1):
            self.decode([(t, len(p) + step, s, True) for s, (t, p) in enumerate(zip(next_ids, prompts))])
            next_ids = [self.argmax(s) for s in range(len(prompts))]


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """The median wall time of `repeats` calls of `run`, after one untimed call."""
    run()                                                       # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_in_child(path: str, row_prompts: dict[str, list[list[int]]], new_tokens: int,
                   repeats: int, num_threads: int,
                   omp_wait_policy: str | None) -> tuple[dict, float | None]:
    """(bench_llama_cpp's results, that process's peak RSS MB) from a fresh process whose
    OMP_WAIT_POLICY is `omp_wait_policy` (None: unset, libgomp's default); ({}, None) without
    llama-cpp-python."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if omp_wait_policy is not None:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    job = {"path": path, "row_prompts": row_prompts, "new_tokens": new_tokens,
           "repeats": repeats, "num_threads": num_threads}
    run = subprocess.run([sys.executable, __file__], input=json.dumps(job), env=env,
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the llama.cpp baseline failed: {run.stderr[-2000:]}")
    answer = json.loads(run.stdout)
    return answer["rows"], answer["peak_rss_mb"] if answer["rows"] else None


def system_info_in_child() -> str:
    """llama.cpp's own line of the CPU features it was built for and runs with (e.g. "AVX512 = 1
    | AVX512_VNNI = 1 | AMX_INT8 = 0"), read in a process of its own; '' without
    llama-cpp-python."""
    run = subprocess.run([sys.executable, __file__], input=json.dumps({"system_info": True}),
                         capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else ""


def bench_llama_cpp(path: str, row_prompts: dict[str, list[list[int]]], new_tokens: int,
                    repeats: int, num_threads: int = DEFAULT_THREADS) -> dict:
    """tok/s per row (its prompts), as bench/engine_bench.py measures ours, on num_threads
    threads; {} without llama-cpp-python."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {}
    max_sequences = max(len(prompts) for prompts in row_prompts.values())
    longest = max(len(prompt) for prompts in row_prompts.values() for prompt in prompts)
    runner = LlamaCppRunner(path, max_sequences, max_tokens=max(640, longest + new_tokens + 8),
                            num_threads=num_threads)
    results = {}
    for row, prompts in row_prompts.items():
        if row == "prefill_512":
            results[row] = len(prompts[0]) / median_seconds(lambda: runner.prefill(prompts[0]), repeats)
            continue
        rates = []
        for _ in range(repeats + 1):                  # the first is a warm-up
            runner.greedy(prompts, new_tokens + 1)
            rates.append(len(prompts) * new_tokens / (time.perf_counter() - runner.decode_started))
        results[row] = statistics.median(rates[1:])
    return results


if __name__ == "__main__":
    job = json.load(sys.stdin)
    if job.get("system_info"):
        try:
            import llama_cpp
        except ImportError:
            sys.exit(0)
        info = llama_cpp.llama_print_system_info()
        print(info.decode() if isinstance(info, bytes) else str(info))
        sys.exit(0)
    rows = bench_llama_cpp(job["path"], job["row_prompts"], job["new_tokens"], job["repeats"],
                           job["num_threads"])
    print(json.dumps({"rows": rows,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
