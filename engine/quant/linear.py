"""A linear layer over GGUF blocks: block kernels for small batches, dequantize + GEMM for large.

Which one a batch of M rows uses is decided per weight shape by a one-time measurement
(`BatchPlanner.block_rows_limit`): the largest M of a ladder up to which the block kernel beat
dequantize-then-GEMM on this machine. Where a weight has 8-bit activation kernels (vpdpbusd) and
8-bit activations are on (EngineConfig.act8), a first measurement (`BatchPlanner.act8_min_rows`)
says whether they beat the 16-bit ones at ACT8_MEASURE_ROWS; if so, every batch of that weight
runs on them, at any M, and never on the GEMM: 8-bit rounding turns the last-bit differences of
two arithmetics into differences of ~1% of a row, so a choice by M would make a request's output
depend on the batch it ran in. Dequantizing goes through one scratch buffer shared by all layers
(at most SCRATCH_ELEMENTS floats, a slab of rows at a time), so no layer ever holds a dequantized
copy of its weight.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator

import torch
import torch.nn.functional as F

from engine.quant import kernels
from engine.quant.tensor import QuantizedTensor

__all__ = ["BatchPlanner", "QuantizedLinear"]

SCRATCH_ELEMENTS = 1 << 22              # 16 MB of float32: one slab of dequantized rows
# up to a 512-token prefill pass: the AVX-512 VNNI kernels beat dequantize + GEMM there too
CALIBRATION_LADDER = (4, 8, 16, 32, 64, 128, 256, 512)
CALIBRATION_MAX_ROWS = 2048             # time on a slice of a big weight: both paths scale with N
CALIBRATION_REPEATS = 3                 # timed runs of each path per round, alternated
CALIBRATION_ROUNDS = 3                  # rounds at most before the block kernel's loss counts
# 8-bit against 16-bit activations: timed at a decode batch's rows; the choice holds for all
ACT8_MEASURE_ROWS = 32
ANY_ROWS = 1 << 30       # block_rows_limit of a weight on 8-bit activations: no GEMM at any M


class BatchPlanner:
    """Owns the dequantization scratch buffer and the per-shape choice of kernel."""

    def __init__(self, fixed_block_rows: int | None = None,
                 fixed_act8_rows: int = 0, act8: bool = True) -> None:
        """fixed_block_rows: use this limit for every shape instead of measuring (tests), and
        then fixed_act8_rows as every act8_min_rows its weight's kernels allow (0: 16 bits);
        act8 False: 16-bit activations for every shape (EngineConfig.act8)."""
        self.act8 = act8
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.fixed_block_rows = fixed_block_rows
        self.fixed_act8_rows = fixed_act8_rows
        self.limits: dict[tuple[int, int, int], int] = {}     # (qtype, N, K) -> max block rows
        self.act8_limits: dict[tuple[int, int, int], int] = {}  # (qtype, N, K) -> 8-bit from
        self.num_kernel_threads: int | None = None   # set inside kernels_own_the_threads()

    def max_block_rows(self) -> int:
        """Batches of more rows run no weight on the block kernels (0: none measured yet)."""
        return max(self.limits.values(), default=0)

    @contextmanager
    def kernels_own_the_threads(self) -> Iterator[None]:
        """For a pass whose matmuls run on the block kernels, all or some (decode, short
        prefills): torch's own ops (norms, RoPE, attention, sampling, the GEMM of weights whose
        limit is lower: small at these sizes) run on one thread, and the kernels on torch's thread
        count. Two thread pools on the same cores otherwise fight: torch's OpenMP workers spin for
        milliseconds after each op while the kernels' workers wait for a core, so a decode step
        takes many times longer on a busy machine and longer even on an idle one. Restores
        torch's thread count on exit; re-entrant (an inner use keeps the outer one's count).
        Forward passes run one at a time, so no other torch work sees it."""
        num_threads = torch.get_num_threads()
        if num_threads <= 1 or self.num_kernel_threads is not None:
            yield
            return
        self.num_kernel_threads = num_threads
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(num_threads)
            self.num_kernel_threads = None

    def kernel_threads(self) -> int:
        """The thread count of the block kernels (and engine.quant's other C kernels) now:
        kernels_own_the_threads()'s, else torch's."""
        return self.num_kernel_threads or torch.get_num_threads()

    def threads_for(self, num_tokens: int) -> ContextManager[None]:
        """kernels_own_the_threads() for a pass of num_tokens rows short enough for some block
        kernel; a no-op context for a longer one (its GEMMs want torch's threads)."""
        if num_tokens <= self.max_block_rows():
            return self.kernels_own_the_threads()
        return nullcontext()

    def block_rows_limit(self, weight: QuantizedTensor) -> int:
        """Batches of at most this many rows use the block kernel for weights of this shape."""
        key = (weight.kernel_qtype, weight.num_rows, weight.num_cols)
        if key not in self.limits:
            if self.fixed_block_rows is not None:
                self.limits[key] = self.fixed_block_rows
            elif self.act8_min_rows(weight) == 1:
                self.limits[key] = ANY_ROWS        # one arithmetic at every M (module doc)
            else:
                self.limits[key] = self._measure(weight)
        return self.limits[key]

    def act8_min_rows(self, weight: QuantizedTensor) -> int:
        """Batches of at least this many rows quantize their activations to 8 bits for weights
        of this shape: 1 (every batch) or 0 (never: 8-bit activations off, no 8-bit kernels
        here, or the 16-bit ones were faster at ACT8_MEASURE_ROWS). With fixed_block_rows
        (tests), fixed_act8_rows."""
        key = (weight.kernel_qtype, weight.num_rows, weight.num_cols)
        if key not in self.act8_limits:
            if (not self.act8 or not kernels.act8_supported(weight)
                    or kernels.best_level() == "scalar"):
                self.act8_limits[key] = 0          # none, or only the slow reference
            elif self.fixed_block_rows is not None:
                self.act8_limits[key] = self.fixed_act8_rows
            else:
                self.act8_limits[key] = self._measure_act8(weight)
        return self.act8_limits[key]

    def activation_summary(self) -> str:
        """Which weight shapes quantize activations to 8 bits from how many rows, in a few
        words (for the engine's kernel line)."""
        eight = sorted({rows for rows in self.act8_limits.values() if rows})
        if not eight:
            return "activations in 16-bit blocks"
        num_eight = sum(1 for rows in self.act8_limits.values() if rows)
        shapes = f"on {num_eight} of {len(self.act8_limits)} weight shapes"
        if eight == [1]:
            rest = ", 16-bit on the rest" if num_eight < len(self.act8_limits) else ""
            return (f"activations in 8-bit blocks (vpdpbusd) in every batch {shapes} (measured "
                    f"at load){rest}")
        return (f"activations in 8-bit blocks (vpdpbusd) from {'/'.join(map(str, eight))} rows "
                f"{shapes}, 16-bit below")

    def scratch_for(self, num_elements: int) -> torch.Tensor:
        if self.scratch.numel() < num_elements:
            self.scratch = torch.empty(num_elements, dtype=torch.float32)
        return self.scratch[:num_elements]

    def dequantized_matmul(self, x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N], dequantizing slabs of W's rows into the scratch buffer."""
        num_rows, num_cols = weight.shape
        # whole 8-row groups
        slab_rows = max(8, min(num_rows, SCRATCH_ELEMENTS // num_cols // 8 * 8))
        if slab_rows == num_rows:
            dense = kernels.dequantize(weight, out=self.scratch_for(num_rows * num_cols)
                                       .view(num_rows, num_cols))
            return F.linear(x, dense)
        out = torch.empty(x.shape[0], num_rows, dtype=torch.float32)
        for start in range(0, num_rows, slab_rows):
            part = weight.row_slice(start, min(num_rows, start + slab_rows))
            dense = kernels.dequantize(part, out=self.scratch_for(part.num_rows * num_cols)
                                       .view(part.num_rows, num_cols))
            out[:, start:start + part.num_rows] = F.linear(x, dense)
        return out

    def _measure(self, weight: QuantizedTensor) -> int:
        """The largest ladder M up to which the block kernel is at least as fast (on a slice
        of the weight's rows: both paths scale with them)."""
        sample = weight.row_slice(0, min(weight.num_rows, CALIBRATION_MAX_ROWS))
        act8_from = self.act8_min_rows(weight)

        def time_pair(num_x_rows: int) -> tuple[float, float]:
            x = torch.randn(num_x_rows, weight.num_cols)
            act_bits = 8 if 0 < act8_from <= num_x_rows else 16
            return _best_times(lambda: kernels.matmul(x, sample, act_bits=act_bits),
                               lambda: self.dequantized_matmul(x, sample))
        try:
            return crossover_limit(time_pair)
        finally:
            # the scratch sized for the sample is not kept: a model whose passes all stay on the
            # block kernels (every decode pass, prompts up to the limit) never needs it, and it
            # would stay resident for the process's life
            self.scratch = torch.empty(0, dtype=torch.float32)


    def _measure_act8(self, weight: QuantizedTensor) -> int:
        """1 when the 8-bit kernel is at least as fast as the 16-bit one at ACT8_MEASURE_ROWS
        rows (on a slice of the weight's rows; a loss counts only if it holds over
        CALIBRATION_ROUNDS rounds), else 0."""
        sample = weight.row_slice(0, min(weight.num_rows, CALIBRATION_MAX_ROWS))

        def time_pair(num_x_rows: int) -> tuple[float, float]:
            x = torch.randn(num_x_rows, weight.num_cols)
            return _best_times(lambda: kernels.matmul(x, sample, act_bits=8),
                               lambda: kernels.matmul(x, sample, act_bits=16))
        return 1 if _first_holds(time_pair, ACT8_MEASURE_ROWS) else 0


def crossover_limit(time_pair: Callable[[int], tuple[float, float]]) -> int:
    """The largest ladder M up to which the block kernel is at least as fast as the GEMM, given
    `time_pair(M)`: one round's (block s, GEMM s). At each M a loss of the block kernel counts
    only if it holds for the best times over CALIBRATION_ROUNDS rounds: a round disturbed by
    another process (a core busy for a moment during load) must not cut the limit for the
    process's life (a limit cut that way keeps larger batches off the C decoder). 1 when the
    block kernel loses at once."""
    limit = 1
    for num_x_rows in CALIBRATION_LADDER:
        if not _first_holds(time_pair, num_x_rows):
            return limit
        limit = num_x_rows
    return limit


def _first_holds(time_pair: Callable[[int], tuple[float, float]], num_x_rows: int) -> bool:
    """Whether `time_pair(num_x_rows)`'s first path is at least as fast as its second, on the
    best times of up to CALIBRATION_ROUNDS rounds (stopping at the first round it holds)."""
    first_s = second_s = float("inf")
    for _ in range(CALIBRATION_ROUNDS):
        first_round, second_round = time_pair(num_x_rows)
        first_s, second_s = min(first_s, first_round), min(second_s, second_round)
        if first_s <= second_s:
            return True
    return False


def _best_times(block_run: Callable[[], object],
                gemm_run: Callable[[], object]) -> tuple[float, float]:
    """Each run's best time of CALIBRATION_REPEATS, the two alternated (so both see the same
    moments of the machine), after one untimed call of each."""
    block_run()
    gemm_run()
    block_s = gemm_s = float("inf")
    for _ in range(CALIBRATION_REPEATS):
        block_s = min(block_s, _seconds(block_run))
        gemm_s = min(gemm_s, _seconds(gemm_run))
    return block_s, gemm_s


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class QuantizedLinear:
    """y = x @ W^T for W kept as GGUF blocks; x and y float32."""

    def __init__(self, weight: QuantizedTensor, planner: BatchPlanner) -> None:
        self.weight = weight                               # [N, K] blocks
        self.planner = planner
        self.block_rows_limit = planner.block_rows_limit(weight)
        self.act8_min_rows = planner.act8_min_rows(weight)
        self.block_matmul = kernels.PreparedMatmul(weight, self.act8_min_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32 (M may be 0: a pass with no output rows asks the
        head for none, and dequantizing W for them would cost as much as a whole matmul)."""
        if x.shape[0] == 0:
            return x.new_empty((0, self.weight.num_rows))
        if x.shape[0] <= self.block_rows_limit:
            return self.block_matmul(x, self.planner.num_kernel_threads)
        return self.planner.dequantized_matmul(x, self.weight)
