"""One decode step's block matmuls alone: the default model's shapes, per kernel level, same run.

Random interleaved blocks of SmolLM2-135M's shapes (30 layers of Q4_1: fused Q/K/V 960 x 576,
output 576 x 576, fused gate/up 3072 x 576, down 576 x 1536; the Q8_0 output layer 49152 x 576),
about 96 MB, so every step streams its weights from DRAM as a real decode step does. Each step runs
the 120 layer matmuls and the head at `m` activation rows through the extension's matmul call
(activation quantization included, Python's per-call cost too: a few microseconds of a step of
milliseconds), on each kernel level this CPU runs and each thread count asked for; the figure is
the best of `--repeats` steps (a loaded machine's slow steps say nothing of the kernels), with
the weight bytes over that time. Levels are compared in one run; commits are compared by running
this file in two worktrees side by side.

    .venv/bin/python bench/decode_matmuls.py                       # table
    .venv/bin/python bench/decode_matmuls.py --rows 1,8 --threads 1,2 --json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from engine.quant import QuantizedTensor, kernels

NUM_LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 30, 576, 1536, 49152
LAYER_SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
BLOCK_BYTES = {Q.Q4_1: 20, Q.Q8_0: 34}          # per 32 values
SCALE_OFFSETS = {Q.Q4_1: (0, 2), Q.Q8_0: (0,)}  # float16 fields of a block


def random_weight(qtype: Q, num_rows: int, num_cols: int, rng: np.random.Generator) -> QuantizedTensor:
    """Interleaved random blocks with finite float16 scales."""
    num_blocks = num_rows * num_cols // 32
    blocks = rng.integers(0, 256, size=(num_blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=num_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    weight = QuantizedTensor(torch.from_numpy(blocks.reshape(num_rows, -1)), qtype, num_cols)
    return kernels.interleave(weight)


class Step:
    """The weights of one decode step and the buffers of its calls at m activation rows."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.layers = [random_weight(Q.Q4_1, rows, cols, rng)
                       for _ in range(NUM_LAYERS) for rows, cols in LAYER_SHAPES]
        self.head = random_weight(Q.Q8_0, VOCAB, HIDDEN, rng)

    def weight_bytes(self) -> tuple[int, int]:
        """(the layers' bytes, the head's bytes)."""
        return sum(w.blocks.numel() for w in self.layers), self.head.blocks.numel()

    def time(self, m: int, level: str, num_threads: int, repeats: int) -> tuple[float, float]:
        """(best layers s, best head s) over `repeats` steps, after one untimed step."""
        call, level_id = kernels.require().matmul, kernels.level_index(level)
        inputs = {cols: torch.randn(m, cols) for cols in (HIDDEN, INTERMEDIATE)}
        outputs = {w.num_rows: torch.empty(m, w.num_rows) for w in self.layers + [self.head]}
        calls = [(w.kernel_qtype, w.blocks.data_ptr(), w.num_rows, w.num_cols,
                  inputs[w.num_cols].data_ptr(), outputs[w.num_rows].data_ptr())
                 for w in self.layers + [self.head]]

        def run(part: list) -> float:
            start = time.perf_counter()
            for qtype, w, n, k, x, y in part:
                call(qtype, level_id, w, n, k, x, m, y, num_threads)
            return time.perf_counter() - start

        best_layers = best_head = float("inf")
        for index in range(repeats + 1):
            layers_s, head_s = run(calls[:-1]), run(calls[-1:])
            if index:
                best_layers, best_head = min(best_layers, layers_s), min(best_head, head_s)
        return best_layers, best_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8", help="activation rows per step, comma list")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma list")
    parser.add_argument("--levels", default="", help="kernel levels (default: every one but scalar)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    levels = [lv for lv in args.levels.split(",") if lv] or [
        lv for lv in kernels.levels() if lv != "scalar"]
    step = Step()
    layer_bytes, head_bytes = step.weight_bytes()
    results = []
    for m in (int(v) for v in args.rows.split(",")):
        for num_threads in (int(v) for v in args.threads.split(",")):
            for level in levels:
                layers_s, head_s = step.time(m, level, num_threads, args.repeats)
                results.append({"m": m, "threads": num_threads, "level": level,
                                "layers_ms": layers_s * 1e3, "head_ms": head_s * 1e3,
                                "step_ms": (layers_s + head_s) * 1e3,
                                "layers_gb_s": layer_bytes / layers_s / 1e9,
                                "head_gb_s": head_bytes / head_s / 1e9})
    if args.json:
        print(json.dumps({"repeats": args.repeats, "layer_mb": layer_bytes / 2**20,
                          "head_mb": head_bytes / 2**20, "results": results}))
        return
    print(f"weights: layers {layer_bytes / 2**20:.1f} MiB, head {head_bytes / 2**20:.1f} MiB; "
          f"best of {args.repeats} steps")
    print(f"{'m':>3}{'threads':>8}{'level':>13}{'layers ms':>11}{'GB/s':>7}{'head ms':>9}"
          f"{'GB/s':>7}{'step ms':>9}")
    for r in results:
        print(f"{r['m']:>3}{r['threads']:>8}{r['level']:>13}{r['layers_ms']:>11.3f}"
              f"{r['layers_gb_s']:>7.1f}{r['head_ms']:>9.3f}{r['head_gb_s']:>7.1f}"
              f"{r['step_ms']:>9.3f}")


if __name__ == "__main__":
    main()
