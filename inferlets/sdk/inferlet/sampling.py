"""Samplers: how each output position turns logits into a token (all sampling runs on the host)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from inferlet._wit import forward

__all__ = ["Sampler", "greedy", "temperature", "top_k", "top_p", "min_p", "distribution"]


@dataclass(frozen=True)
class Sampler:
    """What one output position returns. Validated here (ValueError), before any host call.

    kind "greedy": the argmax; "sample": a draw after temperature, top_k (0 = off), top_p
    (1.0 = off), min_p (0.0 = off), reproducible with `seed`; "distribution": the `num_top`
    most likely tokens and their probabilities (after temperature).
    """

    kind: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_top: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("greedy", "sample", "distribution"):
            raise ValueError(f"Sampler.kind must be greedy, sample or distribution, got {self.kind!r}")
        if self.kind == "sample" and self.temperature <= 0:
            raise ValueError(f"Sampler.temperature must be > 0 to sample, got {self.temperature}")
        if self.temperature < 0:
            raise ValueError(f"Sampler.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"Sampler.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"Sampler.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"Sampler.min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"Sampler.seed must be a u64, got {self.seed}")
        if self.kind == "distribution" and self.num_top <= 0:
            raise ValueError(f"a distribution sampler needs num_top > 0, got {self.num_top}")

    def with_seed(self, seed: int | None) -> "Sampler":
        """The same sampler with another seed (e.g. one per fork)."""
        return Sampler(self.kind, self.temperature, self.top_k, self.top_p, self.min_p, seed,
                       self.num_top)

    def to_wit(self) -> forward.Sampler:
        """The WIT record (built once per sampler; do not mutate it)."""
        return self._wit

    @functools.cached_property
    def _wit(self) -> forward.Sampler:
        kind = {"greedy": forward.SamplerKind.GREEDY, "sample": forward.SamplerKind.SAMPLE,
                "distribution": forward.SamplerKind.DISTRIBUTION}[self.kind]
        return forward.Sampler(kind=kind, temperature=float(self.temperature), top_k=self.top_k,
                               top_p=float(self.top_p), min_p=float(self.min_p), seed=self.seed,
                               num_top=self.num_top)


def greedy() -> Sampler:
    """The most likely token."""
    return Sampler()


def temperature(t: float, *, seed: int | None = None) -> Sampler:
    """A draw at temperature `t`; `t == 0` means greedy."""
    return Sampler() if t == 0 else Sampler("sample", temperature=t, seed=seed)


def top_k(k: int, t: float = 1.0, *, seed: int | None = None) -> Sampler:
    """A draw among the `k` most likely tokens at temperature `t`."""
    return Sampler("sample", temperature=t, top_k=k, seed=seed)


def top_p(p: float, t: float = 1.0, *, seed: int | None = None) -> Sampler:
    """Nucleus sampling: a draw from the smallest set of tokens whose probability reaches `p`."""
    return Sampler("sample", temperature=t, top_p=p, seed=seed)


def min_p(p: float, t: float = 1.0, *, seed: int | None = None) -> Sampler:
    """A draw among the tokens whose probability is at least `p` times the top one's."""
    return Sampler("sample", temperature=t, min_p=p, seed=seed)


def distribution(num_top: int, t: float = 1.0) -> Sampler:
    """The `num_top` most likely tokens with their probabilities (for beam search, custom sampling)."""
    return Sampler("distribution", temperature=t, num_top=num_top)
