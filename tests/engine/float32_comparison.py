"""Judging a low-precision path by a float32 run of the same batches, row by row.

A bfloat16 path (FlashInfer on CUDA, say) cannot be held to a fixed tolerance against another
bfloat16 path: how far two bfloat16 runs drift apart depends on the weights (the random-weight
twin of the default model drifts ~10x more than the trained one), not on the kernels. What does
not depend on the weights is how far each path is from a float32 run of the same batches. So:

- `candidate`: the path under test (FlashInfer bf16); `baseline`: the trusted path in the same
  dtype (the torch backend bf16); `reference`: a float32 run of the same batches (torch float32);
- each output row's error is the root mean square of (logits - reference logits) over the
  vocabulary; the candidate's must be within `error_factor` of the baseline's on every row (plus
  a floor of `error_floor` x the reference row's RMS, for rows where the baseline is exact);
- greedy tokens must equal the reference's on every row where the float32 margin (top-1 minus
  top-2 logit) is decisive: larger than `decisive_factor` x the baseline's row error, where a
  path as accurate as the baseline cannot flip the argmax (the difference of two token errors
  would have to exceed ~4 standard deviations).

The same batches (`mixed_batches`) serve the CUDA tests and the CPU test of this module: a
40-token prefill and a masked 20-token prefill; then a decode, a 3-token fork sharing two full
pages of the first request, a masked decode and a 17-token prefill; then a pure decode batch.
Prefills return logits at every position (more rows, every causal context length).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.batch import ForwardBatch, ForwardRequest, SamplerSpec
from engine.engine_config import ModelConfig

__all__ = ["PAGE_SIZE", "NUM_PAGES", "GQA4_HEAD128", "mixed_batches", "RowComparison",
           "compare_rows", "run_batches", "check_against_float32", "print_summaries"]

PAGE_SIZE = 16
NUM_PAGES = 32              # the batches use pages 0..21

# The second shape the CUDA tests cover: a GQA group of 4, head_dim 128 (Llama-3's head shape;
# the default model's is a group of 3, head_dim 64), random weights.
GQA4_HEAD128 = ModelConfig(name="tiny-gqa4-d128", vocab_size=512, hidden_size=256,
                           intermediate_size=512, num_layers=2, num_heads=8, num_kv_heads=2,
                           head_dim=128, max_position=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=True)


def _skip_rows(kv_len: int, every: int) -> tuple[int, ...]:
    """A run-length mask row over kv_len skipping every `every`-th slot (never the last)."""
    flags = [(slot % every != 1) or slot == kv_len - 1 for slot in range(kv_len)]
    runs, current, count = [], True, 0
    for flag in flags:
        if flag == current:
            count += 1
        else:
            runs.append(count)
            current, count = flag, 1
    runs.append(count)
    return tuple(runs)


def _request(q_len: int, page_ids: tuple[int, ...], last_page_len: int, first_token: int,
             vocab_size: int, mask: tuple[tuple[int, ...], ...] | None = None,
             all_outputs: bool = False) -> ForwardRequest:
    kv_len = (len(page_ids) - 1) * PAGE_SIZE + last_page_len
    outputs = tuple(range(q_len)) if all_outputs else (q_len - 1,)
    return ForwardRequest(
        token_ids=tuple((first_token + 7 * i) % vocab_size for i in range(q_len)),
        positions=tuple(range(kv_len - q_len, kv_len)), page_ids=page_ids,
        last_page_len=last_page_len, output_indices=outputs,
        samplers=(SamplerSpec(),) * len(outputs), mask=mask)


def mixed_batches(vocab_size: int) -> dict[str, ForwardBatch]:
    """The three batches, in the order they must run (later ones read the K/V earlier ones
    wrote), by name. A: 40-token prefill on pages 0-2; C: a masked 20-token prefill on 10-11.
    Then A decodes; B forks A's two full pages and adds 3 tokens on page 5; C decodes masked; D
    prefills 17 tokens on 20-21. Then A, B, C, D decode together."""
    r = _request
    return {
        "prefill + masked prefill": ForwardBatch((
            r(40, (0, 1, 2), 8, 200, vocab_size, all_outputs=True),
            r(20, (10, 11), 4, 300, vocab_size, all_outputs=True,
              mask=tuple(_skip_rows(20, 3) for _ in range(20))))),
        "mixed: decode, shared-page fork, masked decode, prefill": ForwardBatch((
            r(1, (0, 1, 2), 9, 400, vocab_size),
            r(3, (0, 1, 5), 3, 500, vocab_size, all_outputs=True),
            r(1, (10, 11), 5, 600, vocab_size, mask=(_skip_rows(21, 4),)),
            r(17, (20, 21), 1, 700, vocab_size, all_outputs=True))),
        "pure decode": ForwardBatch((
            r(1, (0, 1, 2), 10, 800, vocab_size), r(1, (0, 1, 5), 4, 900, vocab_size),
            r(1, (10, 11), 6, 1000, vocab_size), r(1, (20, 21), 2, 1100, vocab_size))),
    }


def run_batches(logits_of: Callable[[ForwardBatch], torch.Tensor],
                batches: dict[str, ForwardBatch]) -> dict[str, torch.Tensor]:
    """Each batch's float32 logits [num_outputs, vocab] on the CPU, in order, by name
    (`logits_of` is an engine's `logits`)."""
    return {name: logits_of(batch).float().cpu() for name, batch in batches.items()}


def _row_rms(difference: torch.Tensor) -> torch.Tensor:
    return difference.double().pow(2).mean(dim=-1).sqrt()                  # [R] float64


@dataclass(frozen=True)
class RowComparison:
    """One batch's rows: the candidate and the baseline against the float32 reference."""

    name: str
    candidate_error: torch.Tensor   # [R] RMS over the vocabulary of candidate - reference
    baseline_error: torch.Tensor    # [R] the same for the baseline
    reference_scale: torch.Tensor   # [R] RMS of the reference logits
    margin: torch.Tensor            # [R] reference top-1 minus top-2 logit
    decisive: torch.Tensor          # [R] bool: margin > decisive_factor * baseline_error
    tokens_agree: torch.Tensor      # [R] bool: candidate argmax == reference argmax

    @property
    def num_rows(self) -> int:
        return int(self.margin.shape[0])

    @property
    def num_decisive(self) -> int:
        return int(self.decisive.sum())

    def error_ratio(self, error_floor: float) -> torch.Tensor:
        """[R] candidate error / (baseline error + floor)."""
        return self.candidate_error / (self.baseline_error + error_floor * self.reference_scale)

    def failing(self, error_factor: float, error_floor: float) -> torch.Tensor:
        """[R] bool: the rows that fail either check."""
        return ((self.error_ratio(error_floor) > error_factor)
                | (self.decisive & ~self.tokens_agree))

    def problems(self, error_factor: float, error_floor: float) -> list[str]:
        """Each failing row, one line each (empty: the batch passes)."""
        lines = []
        ratio = self.error_ratio(error_floor)
        for row in (ratio > error_factor).nonzero().flatten().tolist():
            lines.append(f"{self.name}: row {row}: error {float(self.candidate_error[row]):.4g} "
                         f"vs the baseline's {float(self.baseline_error[row]):.4g} "
                         f"({float(ratio[row]):.2f}x > {error_factor}x)")
        for row in (self.decisive & ~self.tokens_agree).nonzero().flatten().tolist():
            lines.append(f"{self.name}: row {row}: greedy token differs from float32's although "
                         f"its margin {float(self.margin[row]):.3g} is decisive (baseline error "
                         f"{float(self.baseline_error[row]):.3g})")
        return lines

    def summary(self, error_floor: float) -> str:
        ratio = self.error_ratio(error_floor)
        return (f"{self.name}: {self.num_rows} rows; RMS error vs float32: candidate median "
                f"{float(self.candidate_error.median()):.4g}, baseline median "
                f"{float(self.baseline_error.median()):.4g}; ratio median "
                f"{float(ratio.median()):.2f}, max {float(ratio.max()):.2f}; "
                f"{self.num_decisive} decisive rows, greedy equal on "
                f"{int((self.decisive & self.tokens_agree).sum())}")


def compare_rows(name: str, candidate: torch.Tensor, baseline: torch.Tensor,
                 reference: torch.Tensor, decisive_factor: float = 6.0) -> RowComparison:
    """Compare logits [R, vocab] of two paths with the float32 reference's, row by row."""
    if not candidate.shape == baseline.shape == reference.shape:
        raise ValueError(f"{name}: shapes differ: candidate {tuple(candidate.shape)}, baseline "
                         f"{tuple(baseline.shape)}, reference {tuple(reference.shape)}")
    reference = reference.float()
    top2 = reference.topk(2, dim=-1).values                                # [R, 2]
    margin = (top2[:, 0] - top2[:, 1]).double()                            # [R]
    baseline_error = _row_rms(baseline.float() - reference)
    return RowComparison(
        name=name,
        candidate_error=_row_rms(candidate.float() - reference),
        baseline_error=baseline_error,
        reference_scale=_row_rms(reference),
        margin=margin,
        decisive=margin > decisive_factor * baseline_error,
        tokens_agree=candidate.float().argmax(-1) == reference.argmax(-1))


def check_against_float32(candidate: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor],
                          reference: dict[str, torch.Tensor], *, error_factor: float = 2.0,
                          error_floor: float = 1e-3, decisive_factor: float = 6.0,
                          min_decisive_fraction: float = 0.1) -> list[RowComparison]:
    """Compare every batch (dicts of logits by batch name, as `run_batches` gives them); raise
    AssertionError listing every failing row, or when fewer than `min_decisive_fraction` of all
    rows are decisive (the greedy check would then say little). Returns the comparisons."""
    comparisons = [compare_rows(name, candidate[name], baseline[name], reference[name],
                                decisive_factor) for name in reference]
    problems = [line for c in comparisons for line in c.problems(error_factor, error_floor)]
    num_rows = sum(c.num_rows for c in comparisons)
    num_decisive = sum(c.num_decisive for c in comparisons)
    if num_decisive < min_decisive_fraction * num_rows:
        problems.append(f"only {num_decisive} of {num_rows} rows have a decisive float32 margin")
    if problems:
        summaries = [c.summary(error_floor) for c in comparisons]
        raise AssertionError("\n".join(problems + summaries))
    return comparisons


def print_summaries(label: str, comparisons: Sequence[RowComparison],
                    error_floor: float = 1e-3) -> None:
    """One line per batch (pytest -rA shows them for a passing test)."""
    for comparison in comparisons:
        print(f"{label}: {comparison.summary(error_floor)}")
