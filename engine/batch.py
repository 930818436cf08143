"""What crosses from the host into the engine: a ragged batch of forward requests, and results.

This is the engine's whole input contract. Page ids are *physical* ids of the engine's page pool;
the host has already translated and checked ownership. The engine validates shapes and ranges
(`Engine.forward` raises ValueError naming the request index and field) but knows nothing of
instances, queues or ownership.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SAMPLER_KINDS = ("greedy", "sample", "distribution", "entropy")
MAX_LOGPROBS = 20          # top log-probabilities one output may return
MAX_SEED = (1 << 64) - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite int or float (NaN and +-inf are not: `nan < 0` is False, so range checks alone
    would let them through)."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def sampler_problem(spec: object, vocab_size: int | None = None) -> str | None:
    """What is wrong with a sampler's fields (None: nothing). Checks every field's type, that
    floats are finite and every value is in range; with `vocab_size`, top_k and num_top too.
    Used by SamplerSpec's constructor and again by the engine's validation, which may receive an
    object that never went through the constructor."""
    kind = getattr(spec, "kind", None)
    if kind not in SAMPLER_KINDS:
        return f"kind must be one of {SAMPLER_KINDS}, got {kind!r}"
    temperature = getattr(spec, "temperature", None)
    if not _is_real(temperature) or temperature < 0:
        return f"temperature must be a finite number >= 0, got {temperature!r}"
    for name, low in (("top_k", 0), ("num_top", 0)):
        value = getattr(spec, name, None)
        if not _is_int(value) or value < low:
            return f"{name} must be an integer >= {low}, got {value!r}"
        if vocab_size is not None and value > vocab_size:
            return f"{name} {value} is more than the vocabulary size {vocab_size}"
    top_p = getattr(spec, "top_p", None)
    if not _is_real(top_p) or not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p!r}"
    min_p = getattr(spec, "min_p", None)
    if not _is_real(min_p) or not 0.0 <= min_p < 1.0:
        return f"min_p must be in [0, 1), got {min_p!r}"
    seed = getattr(spec, "seed", None)
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        return f"seed must be None or an integer in [0, 2**64), got {seed!r}"
    num_top = getattr(spec, "num_top")
    if kind == "distribution" and num_top <= 0:
        return f"a distribution sampler needs num_top > 0, got {num_top}"
    return None


@dataclass(frozen=True)
class SamplerSpec:
    """What to return for one output position.

    kind="greedy":        the argmax token.
    kind="sample":        a token drawn after temperature, then top_k (0 = off), top_p (1.0 = off),
                          min_p (0.0 = off); `seed` makes the draw reproducible (with the position of the
                          token it produces: engine.sampling.draw_seed; None: fresh entropy).
    kind="distribution":  the `num_top` most likely tokens and their probabilities after temperature.
    kind="entropy":       a probe: the entropy (nats) of softmax(logits / temperature), a float.

    Logit processing, before any kind (in this order): repetition_penalty (1.0 = off; a produced
    token's positive logit is divided by it, a negative one multiplied), frequency_penalty times
    the token's count and presence_penalty once per produced token are subtracted, `logit_bias`
    pairs (token id, bias) are added, tokens outside `allowed_token_ids` (None = all) and tokens
    the grammar of `state` forbids get -inf. Penalties count the tokens produced by `state`.
    `state` (a GenerationState): the token this output returns advances it.
    num_logprobs (None = off): a token output becomes a TokenLogprobs with the token's log-
    probability and the `num_logprobs` best, from log_softmax of the raw float32 logits.
    """

    kind: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_top: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    num_logprobs: int | None = None
    state: Any = None          # engine.constrain.GenerationState

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """True when the logits are changed before sampling."""
        return bool(self.penalized or self.logit_bias or self.allowed_token_ids is not None
                    or (self.state is not None and self.state.constrained))

    def __post_init__(self) -> None:
        problem = sampler_problem(self)
        if problem is not None:
            raise ValueError(problem)
        self._check_processing()

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0 or math.isnan(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.penalized and self.state is None:
            raise ValueError("penalties need a generation state (the tokens produced so far)")
        if any(not math.isfinite(bias) or abs(bias) > 100 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be finite, in [-100, 100]")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if self.num_logprobs is not None and not 0 <= self.num_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"num_logprobs must be in [0, {MAX_LOGPROBS}], got {self.num_logprobs}")


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
    num_drafted:    > 0 makes this a verify pass: the last num_drafted input tokens are drafts,
                    output_indices are the last num_drafted + 1 positions (one sampler each, all
                    equal) and the result is one Verified output (see Sampler.verify).
    mask:           optional custom attention mask, one row per input token, each a run-length
                    encoding over the kv length: run lengths alternate attend / skip, starting
                    with attend (a first run of 0 means "starts with skip"); each row sums to the
                    kv length. It is ANDed with the causal mask. None: causal only.
    output_indices: indices into token_ids whose logits produce an output, [num_outputs]
    samplers:       one SamplerSpec per output index.
    adapter:        None, or the name of a LoRA adapter registered with the engine
                    (Engine.adapters) applied to this request's rows of every projection it
                    targets; other requests of the batch are unaffected.
    """

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    page_ids: tuple[int, ...]
    last_page_len: int
    output_indices: tuple[int, ...] = ()
    samplers: tuple[SamplerSpec, ...] = ()
    mask: tuple[tuple[int, ...], ...] | None = None
    num_drafted: int = 0
    adapter: str | None = None

    @classmethod
    def decode_step(cls, token_id: int, position: int, page_ids: tuple[int, ...],
                    last_page_len: int, sampler: SamplerSpec,
                    adapter: str | None = None) -> "ForwardRequest":
        """`ForwardRequest((token_id,), (position,), page_ids, last_page_len, (0,), (sampler,),
        adapter=adapter)`,
        made without the frozen dataclass's per-field __setattr__ (4x faster: the host makes
        one per decode step of every sequence). Equal to, and hashes as, the one __init__ makes."""
        request = _new_object(cls)
        fields = request.__dict__
        fields["token_ids"], fields["positions"] = (token_id,), (position,)
        fields["page_ids"], fields["last_page_len"] = page_ids, last_page_len
        fields["output_indices"], fields["samplers"] = (0,), (sampler,)
        fields["mask"], fields["num_drafted"], fields["adapter"] = None, 0, adapter
        return request

    def with_token(self, token_id: int) -> "ForwardRequest":
        """This request with the one input token `token_id` (as `replace(self, token_ids=
        (token_id,))`, 8x faster: an overlapped batch feeds one per decode pass)."""
        request = _new_object(ForwardRequest)
        fields = request.__dict__
        fields.update(self.__dict__)
        fields["token_ids"] = (token_id,)
        return request


_new_object = object.__new__


@dataclass(frozen=True)
class ForwardBatch:
    """A ragged list of requests run in one forward pass.

    fed_from: None, or one entry per request: None (the request's own token_ids), or the
    ForwardResult of a pass of the previous batch whose first output's token replaces the
    request's single input token (the host prepared the pass while that one ran: overlapped
    decode loops, host/scheduling/lookahead.py). Engines call `with_fed_tokens` before anything
    else reads the tokens.
    """

    requests: tuple[ForwardRequest, ...]
    fed_from: tuple[ForwardResult | None, ...] | None = None

    def with_fed_tokens(self) -> "ForwardBatch":
        """This batch with every fed input token in place (fed_from None)."""
        if self.fed_from is None:
            return self
        requests = tuple(request if source is None else request.with_token(output_token_id(source))
                         for request, source in zip(self.requests, self.fed_from))
        return ForwardBatch(requests)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclass(frozen=True)
class Distribution:
    """The top tokens of one output position and their probabilities (descending)."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token with its log-probability and the most likely tokens' (descending)."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Verified:
    """A verify pass's outcome: the accepted drafts, then one token sampled after them (the
    correction of the first rejected draft, or the next token when all were accepted)."""

    token_ids: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


Output = int | float | Distribution | TokenLogprobs | Verified


@dataclass(frozen=True)
class ForwardResult:
    """Per request: one entry per output index: an int token, a TokenLogprobs, a Distribution,
    a float entropy; a verify pass has exactly one, a Verified."""

    outputs: tuple[Output, ...] = field(default=())


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


def output_token_id(result: "ForwardResult") -> int:
    """The token a one-output pass sampled (an int, or a TokenLogprobs' token): what a decode
    loop keeps and feeds to its next pass."""
    return sampled_token_id(result.outputs[0])


def sampled_token_id(output: "int | TokenLogprobs") -> int:
    """The token of a token sampler's output (an int, or a TokenLogprobs' token)."""
    return output if isinstance(output, int) else output.token_id
