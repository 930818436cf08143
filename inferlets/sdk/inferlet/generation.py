"""One generation on a context: the decode loop, stop rules and streamed text.

A step is one pass: submit the pending tokens (the prompt on the first step, the last sampled
token afterwards) with one sampled output, then `get` it. A generation ends at `max_tokens`, at
one of the stop tokens (the model's, unless given), or at a stop string (cut from the text).
The stop token, when there is one, stays in the context (pending) but not in the text.

Constraints (host side, in the same pass as the sampling): `schema` (a JSON schema, dict or
text), `regex` or `grammar` (Lark) make every token match the grammar; the sampler's penalties
count the tokens of this generation; with `sampler.logprobs` every token's log-probability is
kept in `logprobs`. `drafter` (inferlet.drafting) verifies drafted tokens in one pass each.

`run()` and `steps()` run on host decode loops (inferlet.host_loop: the host chains the passes,
the guest reads the tokens as they come) unless a drafter or a stop string needs the guest
between tokens, more than 64 stop token ids are given, or `host_loop=False`; `step()` is always
one pass. Both give the same tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

from inferlet._wit import Err, forward
from inferlet.errors import InferletError
from inferlet.host_loop import MAX_READ_AHEAD, HostLoop
from inferlet.model import decode
from inferlet.sampling import Sampler
from inferlet.text import TextStream

__all__ = ["Generation", "TokenLogprob", "generate_parallel", "wait_outputs", "host_grammar"]

_GREEDY = Sampler()
MAX_LOOP_TOKENS = 65536   # forward.submit-decode's bounds: max-tokens, stop-token-ids
MAX_LOOP_STOP_IDS = 64


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, and the most likely tokens' [(id, logprob), ...]."""

    token_id: int
    logprob: float
    top: list


def wait_outputs(future: forward.ForwardFuture, sampled: bool = False) -> list:
    """Block until a submitted pass has run; its outputs (the future is dropped). `sampled`:
    read every kind (forward.Sampled: token, distribution, token-logprobs, entropy, verified).

    An engine failure becomes InferletError("forward pass failed: ...")."""
    try:
        return future.get_sampled() if sampled else future.get()
    except Err as err:
        raise InferletError(f"forward pass failed: {err.value}") from None
    finally:
        future.__exit__(None, None, None)


class Generation:
    """A generation in progress on `ctx` (see the module docstring for the rules)."""

    def __init__(self, ctx, max_tokens: int, sampler: Sampler | None = None, *,
                 stop: tuple[str, ...] | list[str] | str = (), stop_token_ids=None,
                 stream_text: bool = False, schema=None, regex: str | None = None,
                 grammar: str | None = None, drafter=None, host_loop: bool = True) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.ctx = ctx
        self.max_tokens = max_tokens
        self.sampler = sampler or _GREEDY
        if self.sampler.kind == "distribution":
            raise ValueError("generate needs a token sampler, not a distribution (see beam_search)")
        stop_strings = (stop,) if isinstance(stop, str) else tuple(stop)
        self.stop_token_ids = ctx.stop_token_ids if stop_token_ids is None else frozenset(stop_token_ids)
        self.token_ids: list[int] = []          # generated, the stop token excluded
        self.finish_reason: str | None = None   # "length" | "stop_token" | "stop_string"
        self._stop_token: list[int] = []
        self._text = TextStream(stop_strings) if stop_strings or stream_text else None
        self.logprobs: list[TokenLogprob] = []   # with sampler.logprobs: one per token
        self.drafter = drafter
        self.host_loop = (host_loop and drafter is None and not stop_strings
                          and len(self.stop_token_ids) <= MAX_LOOP_STOP_IDS)
        self.num_drafted = self.num_accepted = self.num_verify_passes = 0
        self.generation_id = _create_host_generation(self.sampler, schema, regex, grammar)
        self._sampled = self.sampler.extended or self.generation_id is not None
        ctx.fill_generation_prompt()
        if not ctx.pending_token_ids:
            if not ctx.token_ids:
                raise InferletError("generate: nothing to start from; fill the context first")
            ctx.reopen_last_token()   # e.g. a fresh fork: recompute its last token

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The generated text (without a stop token or stop string)."""
        return self._text.text if self._text is not None else decode(self.token_ids)

    @property
    def options(self) -> forward.SamplerOptions | None:
        """The sampler-options of this generation's passes (None: a plain submit)."""
        return self.sampler.options_wit(self.generation_id) if self._sampled else None

    def submit(self) -> forward.ForwardFuture:
        """Submit this step's pass."""
        return self.ctx.submit(self.ctx.take_pending(), self.sampler, self.options)

    def receive(self, future: forward.ForwardFuture) -> str:
        """Wait for the step's pass, take its token; returns the new final text ("" if none)."""
        output = wait_outputs(future, self._sampled)[0].value
        self.ctx.passes_done()
        return self._take(output)

    def _take(self, output) -> str:
        """Accept a pass's output (a token id, or token-logprobs); the new final text."""
        if isinstance(output, int):
            return self.accept(output)
        self.logprobs.append(TokenLogprob(output.token_id, output.logprob,
                                          list(zip(output.top_token_ids, output.top_logprobs))))
        return self.accept(output.token_id)

    def step(self) -> str:
        """One step (a verify pass when the drafter has a guess); the new final text."""
        if self.drafter is not None:
            from inferlet.speculative import draft_step
            return draft_step(self)
        return self.receive(self.submit())

    def accept(self, token_id: int, computed: bool = False) -> str:
        """Apply the stop rules to a sampled token; returns the new final text. `computed`: its
        KV is already in the context (an accepted draft), so it is not made pending."""
        if computed:
            self.ctx.token_ids.append(token_id)
        else:
            self.ctx.accept(token_id)
        if token_id in self.stop_token_ids:
            self._stop_token.append(token_id)
            return self._finish("stop_token")
        self.token_ids.append(token_id)
        delta = self._text.push(token_id) if self._text is not None else ""
        if self._text is not None and self._text.stopped:
            return delta + self._finish("stop_string")
        if len(self.token_ids) >= self.max_tokens:
            return delta + self._finish("length")
        return delta

    def _finish(self, reason: str) -> str:
        self.finish_reason = reason
        if self.generation_id is not None:
            forward.destroy_generation(self.generation_id)
            self.generation_id = None
        if self.ctx.in_chat:
            self.ctx.record_assistant_turn(self.text, self.token_ids + self._stop_token)
        return self._text.finish() if self._text is not None else ""

    def steps(self) -> Iterator[str]:
        """Run to the end, yielding each non-empty text delta."""
        deltas = self._loop_deltas(min_outputs=1) if self.host_loop else self._step_deltas()
        try:
            for delta in deltas:
                if delta:
                    yield delta
        finally:
            deltas.close()          # read no further: a host loop brings the context up to date

    def run(self) -> "Generation":
        """Run to the end (on host loops, reading the tokens in bulk)."""
        for _ in (self._loop_deltas(min_outputs=MAX_READ_AHEAD) if self.host_loop
                  else self._step_deltas()):
            pass
        return self

    def _step_deltas(self) -> Iterator[str]:
        while not self.done:
            yield self.step()

    def _start_loop(self) -> HostLoop:
        return HostLoop(self.ctx, min(self.max_tokens - len(self.token_ids), MAX_LOOP_TOKENS),
                        self.sampler, self.sampler.options_wit(self.generation_id),
                        self.stop_token_ids)

    def _loop_deltas(self, loop: HostLoop | None = None, *,
                     min_outputs: int = 1) -> Iterator[str]:
        """The text deltas of host decode loops (`loop` first, when started already), one loop
        after another until done (a loop also ends when it cannot get a page); the tokens
        read `min_outputs` at a time (HostLoop.outputs)."""
        while not self.done:
            loop = loop or self._start_loop()
            try:
                outputs = (loop.outputs(min_outputs) if self.sampler.logprobs is not None
                           else loop.token_ids(min_outputs))
                for output in outputs:
                    yield self._take(output if isinstance(output, int) else output.value)
                    if self.done:
                        break
            finally:
                loop.close()
            loop = None

    @property
    def mean_logprob(self) -> float:
        """Mean log-probability of the generated tokens (needs sampler.logprobs)."""
        if not self.logprobs:
            raise InferletError("mean_logprob needs a sampler with logprobs=0 or more")
        return sum(t.logprob for t in self.logprobs) / len(self.logprobs)


def host_grammar(schema=None, regex: str | None = None, grammar: str | None = None):
    """The forward.Grammar of at most one of schema (dict or JSON text) / regex / Lark grammar."""
    given = [g for g in (schema, regex, grammar) if g is not None]
    if len(given) > 1:
        raise ValueError("give at most one of schema, regex and grammar")
    if schema is not None:
        return forward.Grammar_JsonSchema(schema if isinstance(schema, str) else json.dumps(schema))
    if regex is not None:
        return forward.Grammar_Regex(regex)
    return None if grammar is None else forward.Grammar_Lark(grammar)


def _create_host_generation(sampler: Sampler, schema, regex, grammar) -> int | None:
    """A host generation when a grammar or a penalty needs one."""
    wit_grammar = host_grammar(schema, regex, grammar)
    if wit_grammar is None and not sampler.penalized:
        return None
    try:
        return forward.create_generation(wit_grammar)
    except Err as err:
        raise InferletError(f"grammar: {err.value}") from None


def generate_parallel(contexts: list, max_tokens: int, sampler: Sampler | list[Sampler] | None = None,
                      *, stop: tuple[str, ...] | str = (), on_text=None,
                      **options) -> list[Generation]:
    """Generate on several contexts (typically forks) at once, each on its own queue, all in
    flight together: on host loops (see Generation), else every step submits one pass per
    unfinished context, then collects them.

    `sampler` is one for all or one per context; `on_text(index, delta)` streams text;
    `options` (schema=, regex=, grammar=) constrain every generation (no drafter here).
    Returns the finished Generations, in the order of `contexts`.
    """
    samplers = sampler if isinstance(sampler, list) else [sampler] * len(contexts)
    if len(samplers) != len(contexts):
        raise ValueError(f"{len(samplers)} samplers for {len(contexts)} contexts")
    generations = [Generation(ctx, max_tokens, s, stop=stop, stream_text=on_text is not None,
                              **options) for ctx, s in zip(contexts, samplers)]
    if all(gen.host_loop for gen in generations):
        _read_loops_in_turn(generations, on_text)
        return generations
    active = list(enumerate(generations))
    while active:
        in_flight = [(index, gen, gen.submit()) for index, gen in active]
        for index, gen, future in in_flight:
            delta = gen.receive(future)
            if delta and on_text is not None:
                on_text(index, delta)
        active = [(index, gen) for index, gen in active if not gen.done]
    return generations


def _read_loops_in_turn(generations: list[Generation], on_text) -> None:
    """Every generation on its own host loops, all running at once; read one token of each in
    turn (a loop's tokens wait on the host meanwhile). Every loop starts before any is read,
    so their first passes share a batch."""
    min_outputs = 1 if on_text is not None else MAX_READ_AHEAD
    active = [(index, gen, gen._loop_deltas(gen._start_loop(), min_outputs=min_outputs))
              for index, gen in enumerate(generations)]
    while active:
        still_active = []
        for index, gen, deltas in active:
            delta = next(deltas, None)
            if delta is None:
                continue
            if delta and on_text is not None:
                on_text(index, delta)
            still_active.append((index, gen, deltas))
        active = still_active
