"""Batched sampling of output rows: greedy, temperature + top-k / top-p / min-p, distributions,
entropy probes, log-probabilities, and the verification of drafted tokens.

Logits are first processed per row (penalties, bias, allowed set, grammar mask:
engine/constrain/processing.py); log-probabilities are log_softmax of the raw float32 logits.
A row with a generation state advances it with the token it returns.

Rows are grouped by kind and each group is done with whole-tensor ops (greedy for any number of
rows is one argmax). Randomness is one uniform draw per sampled row, from a generator seeded with
the row's own seed mixed with the position of the token it produces (`draw_seed`), so a seeded row
gives the same token whatever else is in the batch, and a generation with one seed draws afresh at
every step; rows with seed None draw from the sampler's private generator (seeded from OS entropy).

Filter order for kind="sample": softmax(logits / temperature) -> top_k -> top_p (on the top-k
renormalized mass; the most likely token is always kept) -> min_p (keep p >= min_p * p_max).
Temperature 0 means greedy.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from engine.batch import (Distribution, ForwardBatch, ForwardResult, SamplerSpec, TokenLogprobs,
                          Verified)
from engine.constrain.processing import RowError, process_logits
from engine.errors import RequestError

__all__ = ["Sampler", "sample_batch", "greedy_tokens", "draw_seed"]

_WEYL = 0x9E3779B97F4A7C15          # 2**64 / golden ratio: spreads consecutive positions apart


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded row whose token goes at `position` (0 <= result < 2**64)."""
    return (seed + position * _WEYL) % (1 << 64)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of logits [R, V] (the first of equal maxima; a NaN counts as the
    maximum). On the CPU through numpy: torch's CPU argmax is not vectorized, numpy's is."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _draw_generator(seed: int | None, position: int,
                    entropy: torch.Generator) -> torch.Generator:
    """The generator of one seeded draw (`draw_seed`), or the sampler's own for seed None."""
    return entropy if seed is None else torch.Generator().manual_seed(draw_seed(seed, position))


def _uniforms(seeds: list[int | None], positions: Sequence[int],
              entropy: torch.Generator) -> torch.Tensor:
    """[R] float64 uniforms in [0, 1): one per row, reproducible for a given seed and position."""
    return torch.cat([torch.rand(1, generator=_draw_generator(seed, position, entropy),
                                 dtype=torch.float64)
                      for seed, position in zip(seeds, positions)])


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

    def sample(self, logits: torch.Tensor, specs: Sequence[SamplerSpec],
               positions: Sequence[int] | None = None) -> list:
        """logits: [R, vocab] float32, one SamplerSpec per row -> one output per row (an int,
        a TokenLogprobs, a Distribution or a float entropy). `positions`: where each row's
        token goes in its sequence (seeded draws depend on it; default 0 for every row).
        Raises RowError (nothing advanced) when a row's processing leaves no token."""
        if logits.shape[0] != len(specs):
            raise ValueError(f"{logits.shape[0]} logit rows but {len(specs)} samplers")
        positions = [0] * len(specs) if positions is None else positions
        if len(positions) != len(specs):
            raise ValueError(f"{len(positions)} positions for {len(specs)} samplers")
        plain = all(s.kind == "greedy" and not s.processed and s.num_logprobs is None
                    and s.state is None for s in specs)
        if plain:                                  # the common case: no row gather at all
            return greedy_tokens(logits)
        raw = logits.cpu()                         # seeded draws and filters run on the CPU
        outputs = self._choose(process_logits(raw, specs), specs, positions)
        for row, spec in enumerate(specs):
            if spec.kind not in ("greedy", "sample"):
                continue
            if spec.state is not None:
                spec.state.accept(outputs[row])
            if spec.num_logprobs is not None:
                outputs[row] = _token_logprobs(raw[row], outputs[row], spec.num_logprobs)
        return outputs

    def _choose(self, logits: torch.Tensor, specs: Sequence[SamplerSpec],
                positions: Sequence[int]) -> list:
        """One output per row of processed logits [R, V], by kind."""
        outputs: list = [None] * len(specs)
        greedy_rows, sample_rows, dist_rows = [], [], []
        for row, spec in enumerate(specs):
            if spec.kind == "distribution":
                dist_rows.append(row)
            elif spec.kind == "entropy":
                outputs[row] = _entropy(logits[row], spec.temperature)
            elif spec.kind == "greedy" or spec.temperature == 0:
                greedy_rows.append(row)
            else:
                sample_rows.append(row)
        if greedy_rows:
            tokens = greedy_tokens(logits[greedy_rows])
            for row, token in zip(greedy_rows, tokens):
                outputs[row] = token
        if sample_rows:
            tokens = self._sample_rows(logits[sample_rows], [specs[r] for r in sample_rows],
                                       [positions[r] for r in sample_rows])
            for row, token in zip(sample_rows, tokens):
                outputs[row] = token
        if dist_rows:
            dists = self._distributions(logits[dist_rows], [specs[r] for r in dist_rows])
            for row, dist in zip(dist_rows, dists):
                outputs[row] = dist
        return outputs

    def verify(self, logits: torch.Tensor, spec: SamplerSpec, draft_ids: Sequence[int],
               position: int = 0) -> Verified:
        """Verify drafts: logits [k + 1, V] at the position before each of the k drafts and
        after the last. Row i accepts draft i when greedy picks it, or (sampling) with
        probability p(draft) under the processed, filtered distribution; the first rejection
        draws from p with the draft removed (standard speculative sampling for a deterministic
        drafter, so the output has the distribution of plain sampling). Stops at the first
        rejection; all accepted gives one more token from the last row. Rows are processed one
        by one, so penalties and the grammar see the drafts accepted before them. `position`:
        where row 0's token goes (a seeded spec's draws depend on it)."""
        logits = logits.cpu()
        generator = _draw_generator(spec.seed, position, self._entropy)
        chosen: list[int] = []
        for row in range(len(draft_ids) + 1):
            processed = process_logits(logits[row:row + 1], [spec])[0]           # [V]
            draft = draft_ids[row] if row < len(draft_ids) else None
            if spec.kind == "greedy" or spec.temperature == 0:
                token = int(processed.argmax())
            else:
                token = _speculative_draw(self._filtered_probs(processed, spec), draft, generator)
            if spec.state is not None:
                spec.state.accept(token)
            chosen.append(token)
            if token != draft:
                break
        return Verified(tuple(chosen))

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, spec: SamplerSpec) -> torch.Tensor:
        """[V] logits -> [V] float64 probabilities after temperature and the filters."""
        probs = torch.softmax(logits.double() / spec.temperature, dim=-1).unsqueeze(0)
        kept, sorted_ids = _filtered_sorted_probs(probs, [spec])
        return torch.zeros_like(probs[0]).scatter_(0, sorted_ids[0], kept[0])


    def _sample_rows(self, logits: torch.Tensor, specs: list[SamplerSpec],
                     positions: list[int]) -> list[int]:
        temperatures = torch.tensor([s.temperature for s in specs]).unsqueeze(1)
        probs = torch.softmax(logits.double() / temperatures, dim=-1)          # [R, V]
        kept, sorted_ids = _filtered_sorted_probs(probs, specs)
        cumulative = kept.cumsum(dim=-1)                                       # [R, V]
        targets = _uniforms([s.seed for s in specs], positions, self._entropy) * cumulative[:, -1]
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


def _speculative_draw(probs: torch.Tensor, draft: int | None, generator: torch.Generator) -> int:
    """probs [V] (unnormalized): the draft when a uniform falls under its probability, else a
    draw from probs without the draft."""
    total = probs.sum()
    if draft is not None:
        if float(torch.rand(1, generator=generator, dtype=torch.float64)) * total < probs[draft]:
            return draft
        probs = probs.clone()
        probs[draft] = 0.0
        total = probs.sum()
    cumulative = probs.cumsum(dim=0)                                           # [V]
    target = torch.rand(1, generator=generator, dtype=torch.float64) * total
    pick = int(torch.searchsorted(cumulative, target, right=True).clamp(max=len(probs) - 1))
    while probs[pick] == 0 and pick > 0:          # float ties at the boundary: a kept token
        pick -= 1
    return pick


def _entropy(logits: torch.Tensor, temperature: float) -> float:
    """Entropy in nats of softmax(logits [V] / temperature) (temperature 0 counts as 1)."""
    log_probs = torch.log_softmax(logits.double() / (temperature or 1.0), dim=-1)
    probs = log_probs.exp()
    return float(-(probs * log_probs.nan_to_num(neginf=0.0)).sum())


def _token_logprobs(raw: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """raw [V] float32 logits -> the token's log_softmax and the num_top best."""
    log_probs = torch.log_softmax(raw.float(), dim=-1)                         # [V]
    top_values, top_ids = log_probs.topk(num_top) if num_top else (log_probs[:0], raw[:0].long())
    return TokenLogprobs(int(token_id), float(log_probs[token_id]), tuple(top_ids.tolist()),
                         tuple(top_values.tolist()))


def sample_batch(sampler: Sampler, logits: torch.Tensor, batch: ForwardBatch) -> list[ForwardResult]:
    """logits [num_outputs, V] of a batch, in request order -> one ForwardResult per request.
    Verify passes are verified one by one; a row whose processing leaves no token raises
    RequestError (that request alone fails, engine.errors) before any generation state advanced."""
    plain_rows, plain_specs, verify_starts, start = [], [], [], 0
    for request in batch.requests:
        num_outputs = len(request.output_indices)
        if request.num_drafted:
            verify_starts.append(start)
        else:
            plain_rows.extend(range(start, start + num_outputs))
            plain_specs.extend(request.samplers)
        start += num_outputs
    # only seeded draws read the positions: no per-row work for the common batch
    plain_positions = (_output_positions(batch) if any(s.seed is not None for s in plain_specs)
                       else None)
    plain_logits = logits if len(plain_rows) == len(logits) else logits[plain_rows]   # no copy
    try:
        plain = (sampler.sample(plain_logits, plain_specs, plain_positions) if plain_specs
                 else [])
    except RowError as error:
        raise RequestError(_request_of(batch, plain_rows[error.row]), "samplers",
                           error.reason) from None
    outputs = dict(zip(plain_rows, plain))
    for request, first in zip([r for r in batch.requests if r.num_drafted], verify_starts):
        rows = logits[first:first + request.num_drafted + 1]
        outputs[first] = sampler.verify(rows, request.samplers[0],
                                        request.token_ids[-request.num_drafted:],
                                        request.positions[-request.num_drafted - 1] + 1)
    results, start = [], 0
    for request in batch.requests:
        if request.num_drafted:
            results.append(ForwardResult((outputs[start],)))
        else:
            results.append(ForwardResult(tuple(outputs[start + i]
                                               for i in range(len(request.output_indices)))))
        start += len(request.output_indices)
    return results


def _output_positions(batch: ForwardBatch) -> list[int]:
    """Where the token of each output row of the batch's plain (not drafted) requests goes."""
    return [request.positions[i] + 1 for request in batch.requests if not request.num_drafted
            for i in request.output_indices]


def _request_of(batch: ForwardBatch, row: int) -> int:
    """The index of the request that output row `row` of the batch belongs to."""
    for index, request in enumerate(batch.requests):
        row -= len(request.output_indices)
        if row < 0:
            return index
    raise IndexError(row)
