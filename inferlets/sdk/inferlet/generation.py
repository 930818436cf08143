"""One generation on a context: the decode loop, stop rules and streamed text.

A step is one pass: submit the pending tokens (the prompt on the first step, the last sampled
token afterwards) with one sampled output, then `get` it. A generation ends at `max_tokens`, at
one of the stop tokens (the model's, unless given), or at a stop string (cut from the text).
The stop token, when there is one, stays in the context (pending) but not in the text.
"""
from __future__ import annotations

from typing import Iterator

from inferlet._wit import Err, forward
from inferlet.errors import InferletError
from inferlet.model import decode
from inferlet.sampling import Sampler
from inferlet.text import TextStream

__all__ = ["Generation", "generate_parallel", "wait_outputs"]

_GREEDY = Sampler()


def wait_outputs(future: forward.ForwardFuture) -> list:
    """Block until a submitted pass has run; its outputs (the future is dropped).

    An engine failure becomes InferletError("forward pass failed: ...")."""
    try:
        return future.get()
    except Err as err:
        raise InferletError(f"forward pass failed: {err.value}") from None
    finally:
        future.__exit__(None, None, None)


class Generation:
    """A generation in progress on `ctx` (see the module docstring for the rules)."""

    def __init__(self, ctx, max_tokens: int, sampler: Sampler | None = None, *,
                 stop: tuple[str, ...] | list[str] | str = (), stop_token_ids=None,
                 stream_text: bool = False) -> None:
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

    def submit(self) -> forward.ForwardFuture:
        """Submit this step's pass."""
        return self.ctx.submit(self.ctx.take_pending(), self.sampler)

    def receive(self, future: forward.ForwardFuture) -> str:
        """Wait for the step's pass, take its token; returns the new final text ("" if none)."""
        outputs = wait_outputs(future)
        self.ctx.passes_done()
        return self.accept(outputs[0].value)

    def accept(self, token_id: int) -> str:
        """Apply the stop rules to a sampled token; returns the new final text."""
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
        if self.ctx.in_chat:
            self.ctx.record_assistant_turn(self.text, self.token_ids + self._stop_token)
        return self._text.finish() if self._text is not None else ""

    def steps(self) -> Iterator[str]:
        """Run to the end, yielding each non-empty text delta."""
        while not self.done:
            delta = self.receive(self.submit())
            if delta:
                yield delta

    def run(self) -> "Generation":
        """Run to the end."""
        while not self.done:
            self.receive(self.submit())
        return self


def generate_parallel(contexts: list, max_tokens: int, sampler: Sampler | list[Sampler] | None = None,
                      *, stop: tuple[str, ...] | str = (), on_text=None) -> list[Generation]:
    """Generate on several contexts (typically forks) at once: every step submits one pass per
    unfinished context, each on its own queue, all in flight together, then collects them.

    `sampler` is one for all or one per context; `on_text(index, delta)` streams text.
    Returns the finished Generations, in the order of `contexts`.
    """
    samplers = sampler if isinstance(sampler, list) else [sampler] * len(contexts)
    if len(samplers) != len(contexts):
        raise ValueError(f"{len(samplers)} samplers for {len(contexts)} contexts")
    generations = [Generation(ctx, max_tokens, s, stop=stop, stream_text=on_text is not None)
                   for ctx, s in zip(contexts, samplers)]
    active = list(enumerate(generations))
    while active:
        in_flight = [(index, gen, gen.submit()) for index, gen in active]
        for index, gen, future in in_flight:
            delta = gen.receive(future)
            if delta and on_text is not None:
                on_text(index, delta)
        active = [(index, gen) for index, gen in active if not gen.done]
    return generations
