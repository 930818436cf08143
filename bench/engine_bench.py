"""Engine throughput vs transformers (float32, use_cache) and llama.cpp, same prompts, same run.

The header names the CPU, its SIMD flags, torch's capability and our kernels. llama.cpp runs
through llama-cpp-python's low-level batch API (bench/llama_cpp_baseline.py: B sequences decoded
in one batch per step; in a process of its own, with your environment's OpenMP wait policy, while
ours, and transformers beside it, run with the PASSIVE one `import engine` sets) with 2 threads
(`--threads N`: N for every side); `pip install 'pie-serve[bench]'` installs it.

Rows: prefill_512 (one 512-token prompt, tok/s), decode_b1 / decode_b8 / decode_b32 (greedy decode
of `--new-tokens` tokens after 32-token prompts, aggregate tok/s over the batch, timed from the end
of the prefill to the last step for ours and llama.cpp), decode_b1_ctx1024 (the same after one
1024-token prompt: attention over a long context); plus our load time and peak RSS (measured before
any baseline is loaded). Each figure is the median of `--repeats` runs.

    .venv/bin/python bench/engine_bench.py                   # table
    .venv/bin/python bench/engine_bench.py --json            # one JSON object
    .venv/bin/python bench/engine_bench.py --rows decode_b1 --new-tokens 16 --no-hf   # quick
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
import json
import resource
import statistics
import time

USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")     # before `import engine` sets it

sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench/llama_cpp_baseline.py
from llama_cpp_baseline import DEFAULT_THREADS, bench_in_child, median_seconds  # noqa: E402
from engine.loaders import default_gguf_path  # noqa: E402

ROWS = ("prefill_512", "decode_b1", "decode_b8", "decode_b32", "decode_b1_ctx1024")
PROMPT_LEN, PREFILL_LEN = 32, 512


def make_prompts(vocab_size: int, batch: int, length: int) -> list[list[int]]:
    """Deterministic, distinct prompts of ordinary token ids."""
    return [[(1000 + 7919 * (b * length + i)) % (vocab_size - 1000) + 500 for i in range(length)]
            for b in range(batch)]


def decode_shape(row: str) -> tuple[int, int]:
    """(batch, prompt length) of a decode row: decode_bN -> (N, PROMPT_LEN); decode_bN_ctxL ->
    (N, L)."""
    batch, _, context = row.removeprefix("decode_b").partition("_ctx")
    return int(batch), int(context) if context else PROMPT_LEN


# ---- ours -------------------------------------------------------------------------------------
def prompts_for(row: str, vocab: int) -> list[list[int]]:
    """The prompts of a row (the same for every engine)."""
    if row == "prefill_512":
        return make_prompts(vocab, 1, PREFILL_LEN)
    return make_prompts(vocab, *decode_shape(row))


def bench_ours(rows: list[str], new_tokens: int, repeats: int,
               dtype: str) -> tuple[dict, float, float, int, str]:
    from engine import load_default_engine

    start = time.perf_counter()
    engine = load_default_engine(dtype=dtype, progress=False, seed=0)
    load_s = time.perf_counter() - start
    vocab = engine.model_config.vocab_size
    results = {}
    for row in rows:
        if row == "prefill_512":
            prompt = prompts_for(row, vocab)[0]
            seconds = median_seconds(lambda: engine.prompt_logits(prompt), repeats)
            results[row] = PREFILL_LEN / seconds
        else:
            results[row] = decode_tok_s(engine, prompts_for(row, vocab), new_tokens, repeats)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results, load_s, peak_rss_mb, vocab, engine.kernel_summary


def decode_tok_s(engine, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """Aggregate tok/s of `new_tokens` greedy decode steps after the prompts' prefill: timed from
    the end of the prefill's forward to the end of the last step's (median of `repeats`)."""
    forward, ends = engine.forward, []

    def timed_forward(batch):
        result = forward(batch)
        ends.append(time.perf_counter())
        return result

    engine.forward = timed_forward          # the instance attribute shadows the method
    try:
        rates = []
        for _ in range(repeats + 1):        # the first is a warm-up
            ends.clear()
            engine.generate_greedy_batch(prompts, new_tokens + 1)
            rates.append(len(prompts) * new_tokens / (ends[-1] - ends[0]))
    finally:
        del engine.forward
    return statistics.median(rates[1:])


# ---- transformers -----------------------------------------------------------------------------
def bench_hf(rows: list[str], new_tokens: int, repeats: int, vocab: int) -> dict:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return {}
    from engine.loaders import default_gguf_path

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    results = {}
    with torch.inference_mode():
        for row in rows:
            if row == "prefill_512":
                ids = torch.tensor(make_prompts(vocab, 1, PREFILL_LEN))
                results[row] = PREFILL_LEN / median_seconds(lambda: model(ids), repeats)
                continue
            ids = torch.tensor(make_prompts(vocab, *decode_shape(row)))
            mask = torch.ones_like(ids)

            def generate(n: int) -> object:
                return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, use_cache=True)

            prefill = median_seconds(lambda: generate(1), repeats)
            full = median_seconds(lambda: generate(new_tokens + 1), repeats)
            results[row] = ids.shape[0] * new_tokens / max(full - prefill, 1e-9)
    return results


# ---- machine -----------------------------------------------------------------------------------
def cpu_description() -> dict:
    """What the numbers depend on: CPU model, SIMD flags, torch's capability, our kernel level."""
    import torch
    from engine.quant import kernels

    flags, model = set(), "unknown"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                        "amx_bf16", "amx_int8") if f in flags]
    return {"cpu": model, "simd": simd, "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "kernel_levels": list(kernels.levels())}


# ---- report -----------------------------------------------------------------------------------
def ratio(ours: float | None, base: float | None) -> str:
    return f"{ours / base:5.2f}x" if ours and base else "   -  "


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def print_table(report: dict) -> None:
    machine = report["machine"]
    print(f"CPU {machine['cpu']}; SIMD {' '.join(machine['simd']) or 'none'}; torch capability "
          f"{machine['torch_capability']}; our kernel levels {', '.join(machine['kernel_levels']) or 'none'}")
    print(f"ours: {report['kernels']}")
    print(f"load {report['load_s']:.2f} s, peak RSS {report['peak_rss_mb']:.0f} MB "
          f"(ours, dtype {report['dtype']}, before baselines); threads: ours {report['threads']}, "
          f"llama.cpp {report['llama_cpp_threads']}; OpenMP wait policy: ours "
          f"{report['omp_wait_policy']}, llama.cpp {report['llama_cpp_omp_wait_policy']}")
    print(f"{'row':<13}{'ours tok/s':>11}{'hf tok/s':>10}{'ours/hf':>9}{'llama.cpp':>11}"
          f"{'ours/llama':>12}")
    for row in report["rows"]:
        ours, hf, cpp = row["ours_tok_s"], row["hf_tok_s"], row["llama_cpp_tok_s"]
        fmt = lambda v: f"{v:.1f}" if v else "-"
        print(f"{row['name']:<13}{fmt(ours):>11}{fmt(hf):>10}{ratio(ours, hf):>9}{fmt(cpp):>11}"
              f"{ratio(ours, cpp):>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "quantized"))
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp baseline")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for ours, transformers and llama.cpp (default: torch's "
                             "choice for ours and transformers, 2 for llama.cpp)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {ROWS}")
    ours, load_s, peak_rss_mb, vocab, kernel_summary = bench_ours(rows, args.new_tokens,
                                                                  args.repeats, args.dtype)
    hf = {} if args.no_hf else bench_hf(rows, args.new_tokens, args.repeats, vocab)
    cpp = {} if args.no_llama_cpp else bench_in_child(
        str(default_gguf_path()), {row: prompts_for(row, vocab) for row in rows}, args.new_tokens,
        args.repeats, args.threads or DEFAULT_THREADS, USER_OMP_WAIT_POLICY)
    report = {
        "rows": [{"name": r, "ours_tok_s": ours.get(r), "hf_tok_s": hf.get(r),
                  "llama_cpp_tok_s": cpp.get(r)} for r in rows],
        "load_s": load_s, "peak_rss_mb": peak_rss_mb, "dtype": args.dtype,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": torch_threads(),
        "llama_cpp_threads": args.threads or DEFAULT_THREADS,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "llama_cpp_omp_wait_policy": USER_OMP_WAIT_POLICY or "default",
        "machine": cpu_description(), "kernels": kernel_summary,
    }
    for row in report["rows"]:
        ours_tok_s = row["ours_tok_s"]
        row["ours_over_hf"] = ours_tok_s / row["hf_tok_s"] if ours_tok_s and row["hf_tok_s"] else None
        row["ours_over_llama_cpp"] = (ours_tok_s / row["llama_cpp_tok_s"]
                                      if ours_tok_s and row["llama_cpp_tok_s"] else None)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
