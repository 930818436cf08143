"""LoRA adapters in the engine: a batch mixing adapters against the same batch without any.

Rows:
- decode_base_32 / decode_mix_32: greedy decode tok/s (aggregate) of a batch of 32 sequences
  after 32-token prompts, without adapters, then with 8 different rank-16 adapters (4 sequences
  each; targets `--targets`, default every projection), timed over `--steps` decode steps after
  the prefill; `adapter_mix_vs_base_32` is their ratio (goal >= 0.8). On the CPU's GGUF-block
  kernels both run every layer in one C call (engine/quant/decoder.c, the adapters' products in
  engine/quant/lora.c); decode_mix_32_per_layer is the mixed batch on the per-layer path
  (engine/adapters/apply.py) in the same run, for comparison;
- adapter_load_ms: the median time of an adapter's first load (files read, laid out per fused
  projection) once registered; adapter_register_ms: checking its files against the model;
- adapter_resident_mib: what one resident adapter holds; stacked_mib_per_adapter: the stacks of
  the batch's set of 8 (engine.adapters.apply), per adapter.

The header names the CPU (lscpu's model name), torch's CPU capability and the engine's kernels.

    .venv/bin/python bench/adapters.py            # table
    .venv/bin/python bench/adapters.py --json     # one JSON object on the last line
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from engine import load_default_engine       # before torch: it sets OMP_WAIT_POLICY (engine/)
from engine.adapters.peft import TARGET_MODULES, projection_shapes, save_adapter
from engine.batch import GREEDY, ForwardBatch, ForwardRequest
from engine.paging import last_page_len, num_pages_needed

import torch  # noqa: E402

BATCH, PROMPT_LEN, NUM_ADAPTERS, RANK = 32, 32, 8, 16


def cpu_model() -> str:
    """lscpu's model name, else /proc/cpuinfo's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else "unknown CPU"


def write_adapters(directory: Path, config, targets: tuple[str, ...], count: int) -> list[Path]:
    """`count` random rank-RANK adapters in the PEFT layout."""
    shapes = projection_shapes(config)
    paths = []
    for k in range(count):
        generator = torch.Generator().manual_seed(k)
        tensors = {}
        for layer in range(config.num_layers):
            for module in targets:
                out_dim, in_dim = shapes[module]
                tensors[(layer, module)] = (
                    torch.randn(RANK, in_dim, generator=generator) / math.sqrt(in_dim),
                    torch.randn(out_dim, RANK, generator=generator) * 0.01)
        paths.append(save_adapter(directory / f"bench-{k}", RANK, 2 * RANK, tensors))
    return paths


def decode_tok_s(engine, prompts: list[list[int]], adapters: list[str | None], steps: int) -> float:
    """Prefill the prompts in one batch, then `steps` batched greedy decode steps: tok/s of the
    decode steps."""
    page_size = engine.page_size
    length = len(prompts[0])
    pages_each = num_pages_needed(length + steps + 1, page_size)
    page_ids = [tuple(range(b * pages_each, (b + 1) * pages_each)) for b in range(len(prompts))]

    def batch(tokens: list[list[int]], start: int) -> ForwardBatch:
        end = start + len(tokens[0])
        return ForwardBatch(tuple(
            ForwardRequest(tuple(t), tuple(range(start, end)),
                           pages[:num_pages_needed(end, page_size)], last_page_len(end, page_size),
                           (len(t) - 1,), (GREEDY,), adapter=adapter)
            for t, pages, adapter in zip(tokens, page_ids, adapters)))

    results = engine.forward(batch(prompts, 0))
    tokens = [[r.outputs[0]] for r in results]
    begin = time.perf_counter()
    for step in range(steps):
        results = engine.forward(batch(tokens, length + step))
        tokens = [[r.outputs[0]] for r in results]
    return len(prompts) * steps / (time.perf_counter() - begin)


def per_layer_tok_s(engine, prompts: list[list[int]], adapters: list[str | None],
                    steps: int) -> float | None:
    """decode_tok_s with the model's fused C decoder set aside (None when it has none)."""
    fused = engine.model.fused_decoder
    if fused is None:
        return None
    engine.model.fused_decoder = None
    try:
        return decode_tok_s(engine, prompts, adapters, steps)
    finally:
        engine.model.fused_decoder = fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (default auto)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    parser.add_argument("--targets", default=",".join(TARGET_MODULES),
                        help="comma-separated target modules of the adapters")
    opts = parser.parse_args()
    targets = tuple(t for t in opts.targets.split(",") if t)

    engine = load_default_engine(dtype=opts.dtype, device=opts.device, progress=False, seed=0,
                                 num_pages=BATCH * 8)
    print(f"adapters: {cpu_model()}, torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"engine: {engine.kernel_summary}", flush=True)
    vocab = engine.model_config.vocab_size
    prompts = [[(1000 + 7919 * (b * PROMPT_LEN + i)) % (vocab - 1000) + 500
                for i in range(PROMPT_LEN)] for b in range(BATCH)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(Path(tmp), engine.model_config, targets, NUM_ADAPTERS)
        register_s, load_s = [], []
        for k, path in enumerate(paths):
            begin = time.perf_counter()
            info = engine.adapters.register(f"bench-{k}", path)
            register_s.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            engine.adapters.load(f"bench-{k}")
            load_s.append(time.perf_counter() - begin)
        names = [f"bench-{b % NUM_ADAPTERS}" for b in range(BATCH)]
        decode_tok_s(engine, prompts, [None] * BATCH, 2)          # warm both paths
        decode_tok_s(engine, prompts, names, 2)
        base, mix, per_layer = [], [], []
        for _ in range(opts.repeats):
            base.append(decode_tok_s(engine, prompts, [None] * BATCH, opts.steps))
            mix.append(decode_tok_s(engine, prompts, names, opts.steps))
            per_layer.append(per_layer_tok_s(engine, prompts, names, opts.steps))
        summary = {
            "decode_base_32_tok_s": round(statistics.median(base), 1),
            "decode_mix_32_tok_s": round(statistics.median(mix), 1),
            "adapter_mix_vs_base_32": round(statistics.median(mix) / statistics.median(base), 3),
            "decode_mix_32_per_layer_tok_s": (round(statistics.median(per_layer), 1)
                                              if all(per_layer) else None),
            "adapter_register_ms": round(1e3 * statistics.median(register_s), 2),
            "adapter_load_ms": round(1e3 * statistics.median(load_s), 2),
            "adapter_resident_mib": round(info.resident_bytes / 2**20, 2),
            "stacked_mib_per_adapter": round(engine.adapters.stacked_bytes / NUM_ADAPTERS / 2**20,
                                             2),
            "num_adapters": NUM_ADAPTERS, "rank": RANK, "targets": list(targets),
            "batch": BATCH, "steps": opts.steps, "repeats": opts.repeats,
            "cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device),
        }
    for key, value in summary.items():
        if not isinstance(value, (list, str)):
            print(f"{key:<26} {value}")
    if opts.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
