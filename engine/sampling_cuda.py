"""Sampling for logits that live on a CUDA device, with the contract of `engine.sampling.Sampler`.

What runs where (the reference `Sampler` builds its helper tensors on the CPU, so rows it handles
are copied to the host first; only the rows it needs, never the whole batch by default):
- greedy rows (and temperature 0): argmax on the device, only the token ids cross to the host;
- "sample" rows with no seed and min_p == 0: FlashInfer's fused rejection sampler
  `top_k_top_p_sampling_from_probs` (top-k first, then top-p on the renormalized mass: the
  reference's filter order) on the device, drawing from this sampler's own CUDA generator;
- seeded rows, min_p rows and distributions: the reference `Sampler` on host copies of those rows,
  so a seeded row gives the same token as on the CPU path for the same logits.
Without flashinfer (or `use_flashinfer=False`) every "sample" row goes to the reference.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Sequence

import torch

from engine.batch import Distribution, SamplerSpec
from engine.device import FlashInferUnavailable, import_flashinfer
from engine.sampling import Sampler

__all__ = ["CudaSampler", "make_sampler", "uses_fused_sampling"]


def uses_fused_sampling(spec: SamplerSpec) -> bool:
    """True when FlashInfer's fused top-k/top-p sampler handles this row (see module docstring)."""
    return (spec.kind == "sample" and spec.temperature > 0 and spec.seed is None
            and spec.min_p == 0.0 and _unprocessed(spec))


def _unprocessed(spec: SamplerSpec) -> bool:
    """No logit processing, log-probabilities or generation state (the CPU sampler does those)."""
    return not spec.processed and spec.num_logprobs is None and spec.state is None


def _is_greedy(spec: SamplerSpec) -> bool:
    return _unprocessed(spec) and (spec.kind == "greedy"
                                    or (spec.kind == "sample" and spec.temperature == 0))


class CudaSampler:
    """`Sampler.sample(logits, specs)` for device-resident logits (see the module docstring)."""

    def __init__(self, device: str | torch.device, seed: int | None = None,
                 use_flashinfer: bool = True) -> None:
        self.device = torch.device(device)
        self._reference = Sampler(seed)
        self._flashinfer: ModuleType | None = None
        if use_flashinfer:
            try:
                self._flashinfer = import_flashinfer()
            except FlashInferUnavailable:
                self._flashinfer = None
        entropy_seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._generator = torch.Generator(device=self.device).manual_seed(entropy_seed)

    @property
    def uses_flashinfer(self) -> bool:
        return self._flashinfer is not None

    def sample(self, logits: torch.Tensor, specs: Sequence[SamplerSpec],
               positions: Sequence[int] | None = None) -> list[int | Distribution]:
        """logits: [R, vocab] float32 (any device), one SamplerSpec per row -> one output per row;
        `positions` as Sampler.sample's (seeded rows run there)."""
        if logits.shape[0] != len(specs):
            raise ValueError(f"{logits.shape[0]} logit rows but {len(specs)} samplers")
        outputs: list[int | Distribution | None] = [None] * len(specs)
        greedy_rows = [r for r, s in enumerate(specs) if _is_greedy(s)]
        fused_rows = ([r for r, s in enumerate(specs) if uses_fused_sampling(s)]
                      if self._flashinfer is not None else [])
        taken = set(greedy_rows) | set(fused_rows)
        reference_rows = [r for r in range(len(specs)) if r not in taken]
        if greedy_rows:
            self._place(outputs, greedy_rows, logits[greedy_rows].argmax(dim=-1).tolist())
        if fused_rows:
            self._place(outputs, fused_rows, self._fused(logits[fused_rows],
                                                         [specs[r] for r in fused_rows]))
        if reference_rows:
            host_logits = logits[reference_rows].float().cpu()              # [Rr, vocab]
            self._place(outputs, reference_rows, self._reference.sample(
                host_logits, [specs[r] for r in reference_rows],
                None if positions is None else [positions[r] for r in reference_rows]))
        return outputs  # type: ignore[return-value]

    def _fused(self, logits: torch.Tensor, specs: list[SamplerSpec]) -> list[int]:
        """FlashInfer top-k/top-p sampling of [Rf, vocab] logits on their device."""
        vocab = logits.shape[1]
        device = logits.device
        temperatures = torch.tensor([s.temperature for s in specs], device=device).unsqueeze(1)
        probs = torch.softmax(logits.float() / temperatures, dim=-1)        # [Rf, vocab] float32
        top_k = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs],
                             dtype=torch.int32, device=device)
        top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device)
        tokens = self._flashinfer.sampling.top_k_top_p_sampling_from_probs(
            probs, top_k, top_p, filter_apply_order="top_k_first", generator=self._generator)
        return tokens.tolist()

    def verify(self, logits: torch.Tensor, spec: SamplerSpec, draft_ids: Sequence[int],
               position: int = 0):
        """Sampler.verify on the CPU (drafts are verified row by row)."""
        return self._reference.verify(logits.float().cpu(), spec, draft_ids, position)

    @staticmethod
    def _place(outputs: list, rows: list[int], values: Sequence) -> None:
        for row, value in zip(rows, values):
            outputs[row] = value


def make_sampler(device: torch.device, seed: int | None = None) -> Sampler | CudaSampler:
    """The reference `Sampler` on the CPU, a `CudaSampler` on CUDA."""
    if device.type == "cuda":
        return CudaSampler(device, seed)
    return Sampler(seed)
