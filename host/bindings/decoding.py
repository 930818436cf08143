"""`forward.submit-decode` and its `decode-stream` resource: the WIT side of a host-run decode loop.

The loop itself (chaining each pass's successor on the thread that resolves it, preparing ahead,
chained steps) is host/scheduling/decode_loop.py. Here: the checks of `submit-decode`, the first
pass prepared on the guest's thread (it may reclaim pages, like a forward.submit), the per-instance
table of loops (`DecodeLoopTable`, bounded; the instance's end stops every loop before its queued
passes are cancelled, so no pass is submitted for an ended instance), and the reads.
"""
from __future__ import annotations

import threading
from typing import Any

from wasmtime.component import Record

from engine.batch import sampled_token_id
from host.bindings.context import BindingContext
from host.bindings.samplers import lower_sampled, sampler_spec
from host.errors import TrapError
from host.sandbox.wasm.wit_codec import HostResource
from host.scheduling.decode_loop import MAX_MIN_OUTPUTS, DecodeLoop

__all__ = ["DecodeLoopTable", "submit_decode", "next_outputs", "next_token_ids", "added_pages",
           "stop", "drop", "DECODE_STREAM_TYPE", "MAX_DECODE_TOKENS", "MAX_STOP_TOKEN_IDS",
           "MAX_LIVE_DECODE_LOOPS"]

DECODE_STREAM_TYPE = 2
MAX_DECODE_TOKENS = 65536     # outputs of one loop
MAX_STOP_TOKEN_IDS = 64
MAX_LIVE_DECODE_LOOPS = 1024  # per instance: decode-stream resources not dropped


class DecodeLoopTable:
    """decode-stream resource reps (never reused, from 1) -> decode loops. Thread-safe:
    `stop_all` runs on whichever thread ends the instance."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loops: dict[int, DecodeLoop] = {}
        self._next_rep = 1
        self._stopped = False

    def __len__(self) -> int:
        return len(self._loops)

    def add(self, call: str, loop: DecodeLoop) -> int:
        """Keep `loop` under a new rep; after `stop_all` the loop is stopped at once."""
        with self._lock:
            if len(self._loops) >= MAX_LIVE_DECODE_LOOPS:
                raise TrapError(f"{call}: {MAX_LIVE_DECODE_LOOPS} decode-streams alive; drop "
                                f"some first")
            rep = self._next_rep
            self._next_rep += 1
            self._loops[rep] = loop
            stopped = self._stopped
        if stopped:
            loop.stop()
        return rep

    def get(self, call: str, rep: int) -> DecodeLoop:
        with self._lock:
            loop = self._loops.get(rep)
        if loop is None:
            raise TrapError(f"{call}: unknown decode-stream {rep}")
        return loop

    def drop(self, rep: int) -> None:
        with self._lock:
            loop = self._loops.pop(rep, None)
        if loop is not None:
            loop.stop()

    def stop_all(self) -> None:
        """Stop every loop, now and any added later (the instance is ending)."""
        with self._lock:
            self._stopped = True
            loops = list(self._loops.values())
        for loop in loops:
            loop.stop()

    def clear(self) -> None:
        self.stop_all()
        with self._lock:
            self._loops.clear()




def submit_decode(ctx: BindingContext, queue_id: int, sequence_id: int, token_ids: list[int],
                  positions: list[int], last_page_len: int, sampler: Record, options: Record,
                  max_tokens: int, stop_token_ids: list[int]) -> HostResource:
    call = "forward.submit-decode"
    priority = ctx.tables.queues.priority(call, queue_id)
    vocab_size = ctx.services.model_info.vocab_size
    if not 1 <= max_tokens <= MAX_DECODE_TOKENS:
        raise TrapError(f"{call}: max-tokens {max_tokens} outside 1..{MAX_DECODE_TOKENS}")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t >= vocab_size for t in stop_token_ids):
        raise TrapError(f"{call}: at most {MAX_STOP_TOKEN_IDS} stop-token-ids, each below "
                        f"{vocab_size}")
    spec = sampler_spec(ctx, call, 0, sampler, options)
    if spec.kind not in ("greedy", "sample"):
        raise TrapError(f"{call}: the sampler must be greedy or sample, not {spec.kind}")
    pages = ctx.tables.pages
    prepared = pages.prepare(sequence_id, token_ids, positions, last_page_len,
                             [len(token_ids) - 1] if token_ids else [], [spec], call=call)
    loop = DecodeLoop(pages, ctx.services.scheduler, (ctx.instance_id, queue_id), priority,
                      sequence_id, spec, max_tokens, frozenset(stop_token_ids))
    rep = ctx.tables.decode_loops.add(call, loop)
    loop.start(prepared, positions[-1])
    return HostResource(rep, DECODE_STREAM_TYPE)


def next_outputs(ctx: BindingContext, store: Any, rep: int, min_outputs: int) -> list | str:
    """result<list<sampled>>: the outputs since the last call (once there are min-outputs,
    clamped to 1..MAX_MIN_OUTPUTS, or the loop is over); [] once the loop has ended."""
    outputs = _take_outputs(ctx, "decode-stream.next", rep, min_outputs)
    return outputs if isinstance(outputs, str) else [lower_sampled(o) for o in outputs]


def next_token_ids(ctx: BindingContext, store: Any, rep: int, min_outputs: int) -> list | str:
    """result<list<u32>>: next_outputs' outputs as the token each sampled."""
    outputs = _take_outputs(ctx, "decode-stream.next-tokens", rep, min_outputs)
    return outputs if isinstance(outputs, str) else [sampled_token_id(o) for o in outputs]


def _take_outputs(ctx: BindingContext, call: str, rep: int, min_outputs: int) -> list | str:
    """The loop's outputs since the last take (waiting for min-outputs, clamped), or the
    engine's error text."""
    loop: DecodeLoop = ctx.tables.decode_loops.get(call, rep)
    min_outputs = min(max(min_outputs, 1), MAX_MIN_OUTPUTS)
    while True:
        outputs, ended, waiter = loop.take(min_outputs)
        if waiter is None:
            return outputs[0] if ended and outputs else outputs
        ctx.wait_future(waiter, call)


def added_pages(ctx: BindingContext, store: Any, rep: int) -> list[int]:
    """The pages the loop appended to the sequence so far, in order."""
    return list(ctx.tables.decode_loops.get("decode-stream.added-pages", rep).added_page_ids)


def stop(ctx: BindingContext, store: Any, rep: int) -> None:
    ctx.tables.decode_loops.get("decode-stream.stop", rep).stop()


def drop(ctx: BindingContext, rep: int) -> None:
    ctx.tables.decode_loops.drop(rep)
