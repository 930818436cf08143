"""`HostLoop`: a context's decode loop run by the host (`forward.submit-decode`).

The host chains the passes (each inputs the token the previous one sampled), so a generation
costs the guest one `next` call per handful of tokens instead of a submit and a get per token.
The context is brought up to date in `close`: after n outputs read, the KV holds the prompt's
pending tokens and the first n - 1 outputs (the last one stays pending, as after a step), and
the pages the host added for those slots join the context; pages it added past them are freed.
"""
from __future__ import annotations

from typing import Iterator

from inferlet._wit import Err, forward, kv
from inferlet.errors import InferletError

__all__ = ["HostLoop", "MAX_READ_AHEAD"]

# The most outputs one `next` waits for (its min-outputs' bound). The host runs a loop up to
# twice that ahead of its reader, so a reader taking this many at a time never holds it up.
MAX_READ_AHEAD = 64


class HostLoop:
    """One `forward.submit-decode` on `ctx` from its pending tokens; read `outputs()` (each a
    forward.Sampled) or `token_ids()` (the tokens alone, cheaper to pass), then `close()` (also
    when stopping early: the tokens the host computed past the last output read are cut off the
    context's KV)."""

    def __init__(self, ctx, max_tokens: int, sampler, options: forward.SamplerOptions,
                 stop_token_ids) -> None:
        self.ctx = ctx
        ctx.settle()
        token_ids = ctx.take_pending()
        if not token_ids:
            raise InferletError("a decode loop needs a pending token to start from")
        num_head = len(token_ids) - ((len(token_ids) - 1) % ctx.max_batch_tokens + 1)
        if num_head:
            ctx.submit(token_ids[:num_head])            # a long prompt: all but its last pass
        tail = token_ids[num_head:]
        positions = list(range(ctx.next_position, ctx.next_position + len(tail)))
        ctx.reserve(len(tail))
        self._num_pages_before = len(ctx.page_ids)
        self._kv_len_before = ctx.kv_len
        self._stream = forward.submit_decode(
            ctx.queue_id, ctx.sequence_id, tail, positions, ctx.last_page_len, sampler.to_wit(),
            options, max_tokens, sorted(stop_token_ids))
        self._max_tokens = max_tokens
        ctx.next_position += len(tail)
        ctx.note_submitted()
        ctx.open_loop = self
        self.num_read = 0          # outputs handed out by outputs()
        self._num_produced = 0     # outputs the host returned
        self._ended = False

    def outputs(self, min_outputs: int = 1) -> Iterator:
        """The loop's outputs as they come, read `min_outputs` (1..64) at a time when the loop
        goes on that long (1: as each token is sampled; more: fewer wake-ups); ends with the
        loop. An engine failure raises InferletError("forward pass failed: ...")."""
        return self._read(self._stream.next, min_outputs)

    def token_ids(self, min_outputs: int = 1) -> Iterator[int]:
        """`outputs`, each as the token it sampled (`decode-stream.next-tokens`)."""
        return self._read(self._stream.next_tokens, min_outputs)

    def _read(self, next_call, min_outputs: int) -> Iterator:
        while not self._ended and self.ctx.open_loop is self:     # closed by a settle: over
            for output in self._next(next_call, min_outputs):
                self.num_read += 1
                yield output

    def _next(self, next_call, min_outputs: int = 1) -> list:
        try:
            outputs = next_call(min_outputs)
        except Err as err:
            self._ended = True
            raise InferletError(f"forward pass failed: {err.value}") from None
        self._num_produced += len(outputs)
        # after max-tokens outputs no pass is in flight (submit-decode): the end, unread
        self._ended = not outputs or self._num_produced >= self._max_tokens
        return outputs

    def close(self) -> None:
        """Stop the loop (when it runs on), drop the stream, and make the context's pages and
        pending tokens match the outputs read. Idempotent."""
        if self.ctx.open_loop is not self:
            return
        self.ctx.open_loop = None
        if not self._ended:
            self._stream.stop()
            while not self._ended:
                self._next(self._stream.next_tokens)
        added_page_ids = list(self._stream.added_pages())
        self._stream.__exit__(None, None, None)
        ctx = self.ctx
        num_computed = max(0, self.num_read - 1)
        kept_len = self._kv_len_before + num_computed
        num_kept = max(0, -(-kept_len // ctx.page_size) - self._num_pages_before)
        ctx.adopt_pages(added_page_ids[:num_kept], kept_len)
        if len(added_page_ids) > num_kept:       # the host computed past the last output read:
            kv.free_pages(added_page_ids[num_kept:])   # also off the sequence
        del ctx.pending_token_ids[:num_computed]
        ctx.next_position += num_computed
        ctx.passes_done()
