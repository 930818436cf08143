"""Engine throughput vs transformers (float32, use_cache) and llama.cpp, same prompts, same run.

The header names the CPU (lscpu's model, family and model number), its SIMD flags, torch's
capability, our kernel level and why (PIE_KERNEL_LEVEL=avx2 measures the AVX2 kernels on an
AVX-512 machine), and the CPU features llama.cpp reports; where the CPU has AMX, the llama.cpp
baseline must be a build without it (ggml's native AMX path dies with SIGILL on some such CPUs:
install llama-cpp-python with CMAKE_ARGS="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8
-mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"), and the header
says which it found. llama.cpp runs
through llama-cpp-python's low-level batch API (bench/llama_cpp_baseline.py: B sequences decoded
in one batch per step; in a process of its own, with your environment's OpenMP wait policy, while
ours, and transformers beside it, run with the PASSIVE one `import engine` sets) with 2 threads
(`--threads N`: N for every side); `pip install 'pie-serve[bench]'` installs it.

Rows: prefill_512 (one 512-token prompt, tok/s), decode_b1 / decode_b8 / decode_b32 (greedy decode
of `--new-tokens` tokens after 32-token prompts, aggregate tok/s over the batch, timed from the end
of the prefill to the last step for ours and llama.cpp), decode_b1_ctx1024 (the same after one
1024-token prompt: attention over a long context); plus our load time and peak RSS: the bench
process's ru_maxrss read after our rows and before transformers is loaded, in a process that has
run nothing but our engine (llama.cpp always runs in processes of its own, whose peak RSS is shown
beside ours). Each figure is the median of `--repeats` runs. Each row is also run on 1
thread, ours and llama.cpp's, and the table shows each side's 1 -> N thread speed-up, so a second
core that does not pay is visible (`--no-scaling` skips the 1-thread runs).

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
import subprocess
import time

USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")     # before `import engine` sets it

sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench/llama_cpp_baseline.py
from llama_cpp_baseline import (DEFAULT_THREADS, bench_in_child, median_seconds,  # noqa: E402
                                system_info_in_child)
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


def bench_ours(rows: list[str], new_tokens: int, repeats: int, dtype: str,
               thread_counts: list[int], act8: bool = False,
               model: Path | None = None) -> tuple[dict, float, float, int, str]:
    """({threads: {row: tok/s}}, load s, peak RSS MB, vocab size, kernel line): one engine of
    `model` (a GGUF; default the embedded model), the rows run on each of thread_counts threads
    in turn (torch's count, which the kernels use)."""
    import torch
    from engine.engine import load_engine

    start = time.perf_counter()
    engine = load_engine(model or default_gguf_path(), dtype=dtype, progress=False, seed=0,
                         act8=act8)
    load_s = time.perf_counter() - start
    vocab = engine.model_config.vocab_size
    results, before = {}, torch.get_num_threads()
    for num_threads in thread_counts:
        torch.set_num_threads(num_threads)
        results[num_threads] = {}
        for row in rows:
            if row == "prefill_512":
                prompt = prompts_for(row, vocab)[0]
                seconds = median_seconds(lambda: engine.prompt_logits(prompt), repeats)
                results[num_threads][row] = PREFILL_LEN / seconds
            else:
                results[num_threads][row] = decode_tok_s(engine, prompts_for(row, vocab),
                                                         new_tokens, repeats)
    torch.set_num_threads(before)
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
def bench_hf(rows: list[str], new_tokens: int, repeats: int, vocab: int,
             path: Path) -> dict:
    """{row: tok/s} of transformers on the GGUF at `path` (dequantized to float32); {} without
    transformers."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return {}

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
def lscpu_model() -> str:
    """lscpu's model name with its CPU family and model number ('' without lscpu)."""
    try:
        run = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    fields = dict(line.split(":", 1) for line in run.stdout.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    name = fields.get("Model name", "")
    if "CPU family" in fields and "Model" in fields:
        name += f" (family {fields['CPU family']} model {fields['Model']})"
    return name


def llama_cpp_amx_note(simd: list[str], system_info: str) -> str:
    """Whether the llama.cpp baseline can be trusted on this CPU's AMX (see the module doc)."""
    cpu_amx = any(flag.startswith("amx") for flag in simd)
    built_amx = any(f"{name} = 1" in system_info for name in ("AMX_INT8", "AMX_BF16", "AMX_TILE"))
    if not system_info:
        return "llama.cpp not installed"
    if not cpu_amx:
        return "the CPU has no AMX, so llama.cpp runs no AMX path"
    if built_amx:
        return "WARNING: the CPU has AMX and this llama.cpp build uses it (may die with SIGILL)"
    return "the CPU has AMX; this llama.cpp build has none (built without AMX)"


def cpu_description() -> dict:
    """What the numbers depend on: CPU model, SIMD flags, torch's capability, our kernel level
    and why, llama.cpp's build features."""
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
    system_info = system_info_in_child()
    available = kernels.available()
    return {"cpu": lscpu_model() or model, "simd": simd,
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "kernel_levels": list(kernels.levels()),
            "kernel_level": kernels.best_level() if available else None,
            "kernel_level_reason": kernels.level_reason() if available else kernels.unavailable_reason(),
            "llama_cpp_system_info": system_info,
            "llama_cpp_amx": llama_cpp_amx_note(simd, system_info)}


# ---- report -----------------------------------------------------------------------------------
def ratio(ours: float | None, base: float | None) -> str:
    return f"{ours / base:5.2f}x" if ours and base else "   -  "


def speedup(row: dict, side: str) -> float | None:
    """A side's N-thread tok/s over its 1-thread tok/s in one row (None when either is missing)."""
    one, many = row.get(f"{side}_1t_tok_s"), row.get(f"{side}_tok_s")
    return many / one if one and many else None


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def print_table(report: dict) -> None:
    machine = report["machine"]
    print(f"CPU {machine['cpu']}; SIMD {' '.join(machine['simd']) or 'none'}; torch capability "
          f"{machine['torch_capability']}")
    print(f"our kernel level {machine['kernel_level']} ({machine['kernel_level_reason']}); levels "
          f"here {', '.join(machine['kernel_levels']) or 'none'}")
    print(f"llama.cpp: {machine['llama_cpp_amx']}; {machine['llama_cpp_system_info'] or '-'}")
    print(f"ours: {report['kernels']}")
    cpp_rss = report["llama_cpp_peak_rss_mb"]
    print(f"load {report['load_s']:.2f} s, peak RSS {report['peak_rss_mb']:.0f} MB "
          f"(ours: ru_maxrss of a process that ran only our engine, dtype {report['dtype']}; "
          f"llama.cpp's own process {f'{cpp_rss:.0f} MB' if cpp_rss else '-'}); "
          f"threads: ours {report['threads']}, "
          f"llama.cpp {report['llama_cpp_threads']}; OpenMP wait policy: ours "
          f"{report['omp_wait_policy']}, llama.cpp {report['llama_cpp_omp_wait_policy']}")
    threads = report["threads"]
    print(f"{'row':<18}{'ours tok/s':>11}{'hf tok/s':>10}{'ours/hf':>9}{'llama.cpp':>11}"
          f"{'ours/llama':>12}{f'ours 1->{threads}t':>13}{f'llama 1->{threads}t':>14}")
    for row in report["rows"]:
        ours, hf, cpp = row["ours_tok_s"], row["hf_tok_s"], row["llama_cpp_tok_s"]
        fmt = lambda v: f"{v:.1f}" if v else "-"
        scale = lambda v: f"{v:.2f}x" if v else "-"
        print(f"{row['name']:<18}{fmt(ours):>11}{fmt(hf):>10}{ratio(ours, hf):>9}{fmt(cpp):>11}"
              f"{ratio(ours, cpp):>12}{scale(row['ours_speedup']):>13}"
              f"{scale(row['llama_cpp_speedup']):>14}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "quantized"))
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--act8", action=argparse.BooleanOptionalAction, default=True,
                        help="8-bit activation blocks where measured faster (EngineConfig.act8, "
                             "the default); --no-act8: 16-bit")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp baseline")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for ours, transformers and llama.cpp (default: torch's "
                             "choice for ours and transformers, 2 for llama.cpp)")
    parser.add_argument("--no-scaling", action="store_true",
                        help="skip the 1-thread runs (and the 1 -> N thread speed-ups)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", type=Path, default=None,
                        help="a GGUF for every side (default: the embedded SmolLM2-135M)")
    args = parser.parse_args()
    if args.model is not None and not args.model.is_file():
        parser.error(f"--model {args.model}: no such file")
    model = args.model or default_gguf_path()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {ROWS}")
    num_threads = torch_threads()
    scaling = not args.no_scaling and num_threads > 1
    ours_by_threads, load_s, peak_rss_mb, vocab, kernel_summary = bench_ours(
        rows, args.new_tokens, args.repeats, args.dtype,
        [1, num_threads] if scaling else [num_threads], act8=args.act8, model=model)
    ours, ours_1t = ours_by_threads[num_threads], ours_by_threads.get(1, {}) if scaling else {}
    hf = {} if args.no_hf else bench_hf(rows, args.new_tokens, args.repeats, vocab, model)
    cpp_threads = args.threads or DEFAULT_THREADS
    row_prompts = {row: prompts_for(row, vocab) for row in rows}
    cpp, cpp_rss_mb = ({}, None) if args.no_llama_cpp else bench_in_child(
        str(model), row_prompts, args.new_tokens, args.repeats, cpp_threads,
        USER_OMP_WAIT_POLICY)
    cpp_1t = {} if args.no_llama_cpp or not scaling or cpp_threads <= 1 or not cpp else bench_in_child(
        str(model), row_prompts, args.new_tokens, args.repeats, 1,
        USER_OMP_WAIT_POLICY)[0]
    report = {
        "rows": [{"name": r, "ours_tok_s": ours.get(r), "hf_tok_s": hf.get(r),
                  "llama_cpp_tok_s": cpp.get(r), "ours_1t_tok_s": ours_1t.get(r),
                  "llama_cpp_1t_tok_s": cpp_1t.get(r)} for r in rows],
        "load_s": load_s, "peak_rss_mb": peak_rss_mb, "llama_cpp_peak_rss_mb": cpp_rss_mb,
        "peak_rss_method": "ru_maxrss of the bench process after our rows only; llama.cpp's of "
                           "its own process", "dtype": args.dtype,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": torch_threads(),
        "llama_cpp_threads": args.threads or DEFAULT_THREADS,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "llama_cpp_omp_wait_policy": USER_OMP_WAIT_POLICY or "default",
        "machine": cpu_description(), "kernels": kernel_summary, "model": str(model),
    }
    for row in report["rows"]:
        ours_tok_s = row["ours_tok_s"]
        row["ours_over_hf"] = ours_tok_s / row["hf_tok_s"] if ours_tok_s and row["hf_tok_s"] else None
        row["ours_over_llama_cpp"] = (ours_tok_s / row["llama_cpp_tok_s"]
                                      if ours_tok_s and row["llama_cpp_tok_s"] else None)
        row["ours_speedup"], row["llama_cpp_speedup"] = speedup(row, "ours"), speedup(row, "llama_cpp")
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
