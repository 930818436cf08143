"""What crosses from the host into the engine: a ragged batch of forward requests, and results.

This is the engine's whole input contract. Page ids are *physical* ids of the engine's page pool;
the host has already translated and checked ownership. The engine validates shapes and ranges
(`Engine.forward` raises ValueError naming the request index and field) but knows nothing of
instances, queues or ownership.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SAMPLER_KINDS = ("greedy", "sample", "distribution")


@dataclass(frozen=True)
class SamplerSpec:
    """What to return for one output position.

    kind="greedy":        the argmax token.
    kind="sample":        a token drawn after temperature, then top_k (0 = off), top_p (1.0 = off),
                          min_p (0.0 = off); `seed` makes the draw reproducible (None: fresh entropy).
    kind="distribution":  the `num_top` most likely tokens and their probabilities after temperature.
    """

    kind: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_top: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SAMPLER_KINDS:
            raise ValueError(f"sampler kind must be one of {SAMPLER_KINDS}, got {self.kind!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.kind == "distribution" and self.num_top <= 0:
            raise ValueError(f"a distribution sampler needs num_top > 0, got {self.num_top}")


GREEDY = SamplerSpec()


@dataclass(frozen=True)
class ForwardRequest:
    """One sequence's slice of a forward pass.

    token_ids:      new input tokens, [num_tokens]
    positions:      their RoPE positions, [num_tokens]
    page_ids:       physical pages holding the context, in order; the new tokens' K/V are written
                    at the tail: the sequence's KV length after the pass is
                    (len(page_ids) - 1) * page_size + last_page_len, and the new tokens occupy its
                    last num_tokens slots.
    last_page_len:  tokens in the last page after the pass, 1..page_size.
    mask:           optional custom attention mask, one row per input token, each a run-length
                    encoding over the kv length: run lengths alternate attend / skip, starting
                    with attend (a first run of 0 means "starts with skip"); each row sums to the
                    kv length. It is ANDed with the causal mask. None: causal only.
    output_indices: indices into token_ids whose logits produce an output, [num_outputs]
    samplers:       one SamplerSpec per output index.
    """

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    page_ids: tuple[int, ...]
    last_page_len: int
    output_indices: tuple[int, ...] = ()
    samplers: tuple[SamplerSpec, ...] = ()
    mask: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class ForwardBatch:
    """A ragged list of requests run in one forward pass."""

    requests: tuple[ForwardRequest, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclass(frozen=True)
class Distribution:
    """The top tokens of one output position and their probabilities (descending)."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class ForwardResult:
    """Per request: one entry per output index, an int token or a Distribution."""

    outputs: tuple[int | Distribution, ...] = field(default=())


@dataclass(frozen=True)
class TokenCopy:
    """Copy `num_tokens` token slots of K/V from one page to another (all layers).

    Used for copy-on-write of a shared last page and for the guest's kv copy call.
    """

    src_page_id: int
    dst_page_id: int
    src_offset: int
    dst_offset: int
    num_tokens: int
