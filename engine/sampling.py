"""Batched sampling of output rows: greedy, temperature + top-k / top-p / min-p, distributions.

Rows are grouped by kind and each group is done with whole-tensor ops (greedy for any number of
rows is one argmax). Randomness is one uniform draw per sampled row, from a generator seeded with
the row's own seed, so a seeded row gives the same token whatever else is in the batch; rows with
seed None draw from the sampler's private generator (seeded from OS entropy).

Filter order for kind="sample": softmax(logits / temperature) -> top_k -> top_p (on the top-k
renormalized mass; the most likely token is always kept) -> min_p (keep p >= min_p * p_max).
Temperature 0 means greedy.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from engine.batch import Distribution, SamplerSpec

__all__ = ["Sampler"]


def _uniforms(seeds: list[int | None], entropy: torch.Generator) -> torch.Tensor:
    """[R] float64 uniforms in [0, 1): one per row, reproducible for a given seed."""
    draws = []
    for seed in seeds:
        generator = entropy if seed is None else torch.Generator().manual_seed(seed)
        draws.append(torch.rand(1, generator=generator, dtype=torch.float64))
    return torch.cat(draws)


def _filtered_sorted_probs(probs: torch.Tensor, specs: Sequence[SamplerSpec]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort probs [R, V] descending and zero what top_k / top_p / min_p remove.

    returns (kept probs [R, V] in sorted order, sorted token ids [R, V])
    """
    num_rows, vocab = probs.shape
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)                                 # [1, V]
    top_k = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs]).unsqueeze(1)
    top_p = torch.tensor([s.top_p for s in specs], dtype=probs.dtype).unsqueeze(1)
    min_p = torch.tensor([s.min_p for s in specs], dtype=probs.dtype).unsqueeze(1)
    kept = sorted_probs * (ranks < top_k)
    renormalized = kept / kept.sum(dim=-1, keepdim=True)
    mass_before = renormalized.cumsum(dim=-1) - renormalized                # mass of better tokens
    keep = (mass_before < top_p) & (sorted_probs >= min_p * sorted_probs[:, :1])
    keep[:, 0] = True
    return kept * keep, sorted_ids


class Sampler:
    """Turns logits of output rows into tokens or distributions, per their SamplerSpec."""

    def __init__(self, seed: int | None = None) -> None:
        entropy_seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._entropy = torch.Generator().manual_seed(entropy_seed)

    def sample(self, logits: torch.Tensor, specs: Sequence[SamplerSpec]) -> list[int | Distribution]:
        """logits: [R, vocab] float32, one SamplerSpec per row -> one output per row."""
        if logits.shape[0] != len(specs):
            raise ValueError(f"{logits.shape[0]} logit rows but {len(specs)} samplers")
        outputs: list[int | Distribution | None] = [None] * len(specs)
        greedy_rows, sample_rows, dist_rows = [], [], []
        for row, spec in enumerate(specs):
            if spec.kind == "distribution":
                dist_rows.append(row)
            elif spec.kind == "greedy" or spec.temperature == 0:
                greedy_rows.append(row)
            else:
                sample_rows.append(row)
        if len(greedy_rows) == len(specs):         # the common case: no row gather at all
            return logits.argmax(dim=-1).tolist()
        logits = logits.cpu()                      # seeded draws and filters run on the CPU
        if greedy_rows:
            tokens = logits[greedy_rows].argmax(dim=-1).tolist()
            for row, token in zip(greedy_rows, tokens):
                outputs[row] = token
        if sample_rows:
            tokens = self._sample_rows(logits[sample_rows], [specs[r] for r in sample_rows])
            for row, token in zip(sample_rows, tokens):
                outputs[row] = token
        if dist_rows:
            dists = self._distributions(logits[dist_rows], [specs[r] for r in dist_rows])
            for row, dist in zip(dist_rows, dists):
                outputs[row] = dist
        return outputs  # type: ignore[return-value]

    def _sample_rows(self, logits: torch.Tensor, specs: list[SamplerSpec]) -> list[int]:
        temperatures = torch.tensor([s.temperature for s in specs]).unsqueeze(1)
        probs = torch.softmax(logits.double() / temperatures, dim=-1)          # [R, V]
        kept, sorted_ids = _filtered_sorted_probs(probs, specs)
        cumulative = kept.cumsum(dim=-1)                                       # [R, V]
        targets = _uniforms([s.seed for s in specs], self._entropy) * cumulative[:, -1]
        picks = torch.searchsorted(cumulative, targets.unsqueeze(1), right=True)
        picks = picks.clamp(max=kept.shape[1] - 1)
        # never land on a removed token (float ties at the boundary): step back to a kept one
        last_kept = (kept > 0).sum(dim=-1, keepdim=True) - 1
        picks = torch.minimum(picks, last_kept)
        return sorted_ids.gather(1, picks).flatten().tolist()

    def _distributions(self, logits: torch.Tensor, specs: list[SamplerSpec]) -> list[Distribution]:
        temperatures = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in specs])
        probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)      # [R, V]
        cold = torch.tensor([s.temperature == 0 for s in specs])
        if bool(cold.any()):   # temperature 0: all mass on the argmax
            one_hot = torch.zeros_like(probs).scatter_(1, probs.argmax(-1, keepdim=True), 1.0)
            probs = torch.where(cold.unsqueeze(1), one_hot, probs)
        num_top = min(max(s.num_top for s in specs), probs.shape[1])
        top_probs, top_ids = probs.topk(num_top, dim=-1)
        top_probs, top_ids = top_probs.tolist(), top_ids.tolist()
        return [Distribution(tuple(ids[:spec.num_top]), tuple(p[:spec.num_top]))
                for ids, p, spec in zip(top_ids, top_probs, specs)]
