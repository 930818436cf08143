"""Samplers: how each output position turns logits into a token (all sampling runs on the host)."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from inferlet._wit import forward

__all__ = ["Sampler", "greedy", "temperature", "top_k", "top_p", "min_p", "distribution",
           "entropy", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20
_KINDS = {"greedy": forward.SamplerKind.GREEDY, "sample": forward.SamplerKind.SAMPLE,
          "distribution": forward.SamplerKind.DISTRIBUTION, "entropy": forward.SamplerKind.ENTROPY}


@dataclass(frozen=True)
class Sampler:
    """What one output position returns. Validated here (ValueError), before any host call.

    kind "greedy": the argmax; "sample": a draw after temperature, top_k (0 = off), top_p
    (1.0 = off), min_p (0.0 = off), reproducible with `seed`; "distribution": the `num_top`
    most likely tokens and their probabilities (after temperature); "entropy": a probe, the
    entropy (nats) of the position's distribution.

    Logit processing (host side, before any kind): `repetition_penalty` (1.0 = off),
    `frequency_penalty` and `presence_penalty` (in [-2, 2]) over the tokens the generation
    produced so far, `logit_bias` {token id: bias in [-100, 100]}, `allowed_token_ids` (None =
    all). `logprobs` (None = off): each token also returns its log-probability and the
    `logprobs` most likely tokens' (0..20).
    """

    kind: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_top: int = 0
    logprobs: int | None = None
    logit_bias: tuple = ()                 # ((token id, bias), ...); a dict is accepted too
    allowed_token_ids: tuple | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Sampler.kind must be one of {tuple(_KINDS)}, got {self.kind!r}")
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
        self._check_options()

    def _check_options(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
            if not self.allowed_token_ids:
                raise ValueError("Sampler.allowed_token_ids must not be empty (None allows all)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"Sampler.logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"Sampler.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"Sampler.repetition_penalty must be in (0, 10], got "
                             f"{self.repetition_penalty}")
        for token_id, bias in self.logit_bias:
            if not (isinstance(token_id, int) and token_id >= 0 and -100 <= bias <= 100):
                raise ValueError(f"Sampler.logit_bias: ({token_id!r}, {bias!r}) needs a token id "
                                 f">= 0 and a bias in [-100, 100]")

    @property
    def penalized(self) -> bool:
        """True when a penalty is on (the generation then keeps a history on the host)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def extended(self) -> bool:
        """True when the sampler needs sampler-options (forward.submit-with)."""
        return bool(self.penalized or self.logit_bias or self.allowed_token_ids is not None
                    or self.logprobs is not None)

    def with_seed(self, seed: int | None) -> "Sampler":
        """The same sampler with another seed (e.g. one per fork)."""
        return dataclasses.replace(self, seed=seed)

    def options_wit(self, generation_id: int | None = None) -> forward.SamplerOptions:
        """The WIT sampler-options, attached to a host generation when given."""
        return forward.SamplerOptions(
            logprobs=self.logprobs, logit_bias=[(int(t), float(b)) for t, b in self.logit_bias],
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty), generation=generation_id)

    def to_wit(self) -> forward.Sampler:
        """The WIT record (built once per sampler; do not mutate it)."""
        return self._wit

    @functools.cached_property
    def _wit(self) -> forward.Sampler:
        return forward.Sampler(kind=_KINDS[self.kind], temperature=float(self.temperature), top_k=self.top_k,
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


def entropy(t: float = 1.0) -> Sampler:
    """A probe: the entropy (nats) of the position's distribution at temperature `t`."""
    return Sampler("entropy", temperature=t)
