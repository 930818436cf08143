"""`DecodeLoop`: a decode loop the host runs for a guest (`forward.submit-decode`).

A guest's per-token decode step costs a round trip through the sandbox (submit, wake, get, lower,
and the guest's own code between them); here the host chains the passes itself: when a pass has
run, the thread that resolved it (the engine thread, usually) keeps the output for the guest and
submits the next pass on the same queue at once, so the next batch carries it without waiting
for the guest. The guest reads the outputs as they come, one or many at a time (`take`).
The look-ahead (host/scheduling/lookahead.py) may ask a loop for its next pass before the output
is in (`prepare_next`, its input token fed by the engine) or, at depth N, for several steps in
one batch's run (`chain_step`): the loop then keeps several outputs at once.

Every later pass is prepared by the instance's page table without reclaim (`DecodePages`: it also
gives the sequence a new page of the instance when the last one is full): the quota reached, or
a pool too short for that page or a copy-on-write, ends the loop quietly, and the guest goes on
with a new one (whose own allocation reclaims or traps, as a step would). A later pass the
guest's own calls made invalid (its sequence destroyed meanwhile) traps the instance at its
next read.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Hashable, Literal, Protocol, Sequence

from engine.batch import ForwardResult, SamplerSpec, output_token_id
from engine.paging import kv_len as paged_kv_len
from host.errors import TrapError
from host.scheduling.work import PreparedForward

if TYPE_CHECKING:
    from host.scheduling.scheduler import BatchScheduler

__all__ = ["DecodeLoop", "DecodePages", "MAX_MIN_OUTPUTS", "MAX_UNREAD_OUTPUTS"]

_CALL = "forward.submit-decode"   # the WIT call a later pass's trap names
MAX_MIN_OUTPUTS = 64          # the most outputs one read waits for
MAX_UNREAD_OUTPUTS = 2 * MAX_MIN_OUTPUTS   # a loop runs at most this many outputs ahead of its
# reader: twice what it waits for, so a reader taking them in bulk never holds the loop up


class DecodePages(Protocol):
    """What a decode loop needs of its instance's page table (host/kv)."""

    page_size: int

    def prepare(self, sequence_id: int, token_ids: Sequence[int], positions: Sequence[int],
                last_page_len: int, output_indices: Sequence[int],
                samplers: Sequence[SamplerSpec], *, call: str, reclaim: Literal[False],
                grow: bool, general: bool, pinned: bool, fed: bool = False
                ) -> tuple[PreparedForward, int | None] | None:
        """The loop's next pass, without reclaim (`grow`: a new page first; `fed`: its token is
        fed from the pass before it): (the pass, the new page's local id or None), or None when
        it cannot be had now."""

    def undo_grow(self, sequence_id: int, page_id: int) -> None:
        """Give back the page a pass prepared ahead added, when its output does not count."""


class DecodeLoop:
    """One loop's state. The pass chain runs on the threads that resolve its passes; the guest
    reads with `take`. `stop` makes it submit nothing more (taken under the same lock as a
    submission, so none follows it)."""

    def __init__(self, pages: DecodePages, scheduler: BatchScheduler, queue_key: Hashable, priority: str,
                 sequence_id: int, sampler: SamplerSpec, max_tokens: int,
                 stop_token_ids: frozenset[int]) -> None:
        self._pages, self._scheduler = pages, scheduler
        self._page_size = pages.page_size
        self._queue_key, self._priority = queue_key, priority
        self._sequence_id, self._sampler = sequence_id, sampler
        self._max_tokens, self._stop_token_ids = max_tokens, stop_token_ids
        self.added_page_ids: list[int] = []  # pages the loop appended, in order
        self._lock = threading.Lock()
        self._outputs: list = []            # produced, not yet taken by the guest
        self._num_outputs = 0
        self._ended = self._stopped = False
        self._error: str | None = None      # the engine failed a pass: next's err, once
        self._trap: str | None = None       # the guest's calls broke a later pass
        self._waiter: Future | None = None  # the guest's next(), blocked ...
        self._wake_at = 1                   # ... until this many outputs (or the end)
        self._num_in_flight = 0             # passes submitted, not resolved (2: one ahead)
        self._paused_token: int | None = None   # the next pass's input, held for the reader
        self._position = self._kv_len = self._num_pages = 0
        self._ahead_page_id: int | None = None  # the page the pass ahead added, while it may drop
        self._num_chained = 0               # steps chained after the pass in flight (lookahead.py)

    def start(self, prepared: PreparedForward, position: int) -> None:
        """Submit the first pass (prepared on the guest's thread); `position`: its last token's."""
        request = prepared.request
        self._position = position
        self._num_pages = len(request.page_ids)
        self._kv_len = paged_kv_len(self._num_pages, request.last_page_len, self._page_size)
        with self._lock:
            self._num_in_flight = 1
            future = self._scheduler.submit_forward(self._queue_key, self._priority, prepared,
                                                    self.prepare_next)
        future.add_done_callback(self._on_first_pass)

    def stop(self) -> None:
        """Submit no further pass; `take` ends once the one in flight (if any) has run."""
        with self._lock:
            self._stopped = True

    def take(self, min_outputs: int = 1) -> tuple[list, bool, Future | None]:
        """(outputs not taken yet, ended, a future to wait on): the outputs once there are
        `min_outputs` (1..MAX_MIN_OUTPUTS), or any once the loop is over or broken; else a
        future that resolves when there are. After the last output, one more call returns the
        engine's error as the err text (TrapError for a broken pass). Taking resumes a loop
        held for its reader."""
        with self._lock:
            over = (self._ended or self._stopped) and not self._num_in_flight
            if not self._outputs or (len(self._outputs) < min_outputs and not over
                                     and self._trap is None):
                return self._nothing_to_take(min_outputs, over)
            outputs, self._outputs = self._outputs, []
            self._resume()
        return outputs, False, None

    def _nothing_to_take(self, min_outputs: int, over: bool) -> tuple[list, bool, Future | None]:
        """Under the lock: the end (err text once), a trap, or a future to wait on."""
        if self._trap is not None:
            raise TrapError(self._trap)
        if over:
            error, self._error = self._error, None
            return ([error] if error else []), True, None
        self._waiter, self._wake_at = Future(), min_outputs
        return [], False, self._waiter

    def _on_first_pass(self, future: Future) -> None:
        try:
            outcome = future.result()
        except Exception as exc:  # noqa: BLE001 -- the engine failed the batch, or cancelled
            outcome = exc
        self._on_pass(outcome)

    def prepare_next(self) -> tuple[PreparedForward, Callable[[object], None]] | None:
        """The look-ahead at depth 1 (host/scheduling/lookahead.py), while this loop's one pass in flight runs: the
        pass after it, its input token to be fed from that pass's output (ForwardBatch.fed_from),
        and the callback of its outcome.
        None, with nothing changed, unless it surely follows whatever that output is (no stop,
        the max-tokens and unread bounds not reached after it) and the common decode route
        prepares it (a new page of the instance when the last is full: given back if the pass
        does not count); else the loop chains it once the output is in."""
        with self._lock:
            kv_len = self._kv_len + 1
            if (self._ended or self._stopped or self._trap is not None
                    or self._num_in_flight != 1 or self._paused_token is not None
                    or self._num_outputs + 2 > self._max_tokens
                    or len(self._outputs) + 2 > MAX_UNREAD_OUTPUTS):
                return None
            try:
                step = self._prepare_step(0, kv_len, general=False, fed=True)
            except TrapError:
                return None                       # the chained pass traps, in order
            if step is None:
                return None
            self._ahead_page_id = step[1]
            self._num_in_flight += 1
            return step[0], self._on_pass

    def chain_step(self, result: ForwardResult) -> PreparedForward | None:
        """The look-ahead at depth N (host/scheduling/lookahead.py), on the thread running this loop's pass:
        the pass after the one whose output is `result` (the pass submitted, or a step chained
        after it), prepared as the loop would once that output is kept (the common decode
        route only; a new page of the instance when the last is full), the loop's position
        and pages moved on. None, with nothing changed, unless it surely follows: no stop
        token, max_tokens and the unread bound not reached, not stopped, the route taken, and
        no reader woken by the outputs so far (a streaming reader gets each as it comes)."""
        token_id = output_token_id(result)
        if token_id in self._stop_token_ids:
            return None
        with self._lock:
            num_unread = len(self._outputs) + self._num_chained + 1    # `result`'s counted
            if (self._ended or self._stopped or self._trap is not None
                    or self._num_in_flight != 1
                    or self._num_outputs + self._num_chained + 1 >= self._max_tokens
                    or num_unread >= MAX_UNREAD_OUTPUTS
                    or self._waiter is not None and num_unread >= self._wake_at):
                return None
            try:
                step = self._prepare_step(token_id, self._kv_len + 1, general=False,
                                          pinned=False)   # the chain's first pass pins
            except TrapError:
                return None                       # the loop's next pass meets it again
            if step is None:
                return None
            self._num_chained += 1
            return step[0]

    def _prepare_step(self, token_id: int, kv_len: int, general: bool = True,
                      pinned: bool = True, fed: bool = False
                      ) -> tuple[PreparedForward, int | None] | None:
        """Under the lock: the pass of `token_id` that makes the KV `kv_len` long (a new page
        first when the last is full); the loop's position and pages advance. None: no page
        without reclaim, or (general False) the common route declined; TrapError. `pinned`,
        `fed` (the token a placeholder the engine feeds): as DecodePages.prepare."""
        grow = kv_len > self._num_pages * self._page_size
        last_page_len = kv_len - (self._num_pages - (not grow)) * self._page_size
        step = self._pages.prepare(self._sequence_id, (token_id,), (self._position + 1,),
                                   last_page_len, (0,), (self._sampler,), call=_CALL,
                                   reclaim=False, grow=grow, general=general, pinned=pinned,
                                   fed=fed)
        if step is None:
            return None
        if step[1] is not None:
            self.added_page_ids.append(step[1])
            self._num_pages += 1
        self._kv_len, self._position = kv_len, self._position + 1
        return step

    def _on_pass(self, outcome: object) -> None:
        """A pass resolved (on the thread that resolved it; a tuple: the results of the steps
        chained after it too, first first): keep its outputs, submit the next pass (chained: no
        future) or end. A pass prepared ahead that resolves after the loop ended (at the pass
        before it) is dropped."""
        results = outcome if isinstance(outcome, tuple) else (outcome,)
        if not isinstance(results[-1], ForwardResult):      # the pass, or a chained step, failed
            if len(results) > 1:
                with self._lock:
                    self._keep_chained(results[:-1])
            self._end(error=f"engine failed the batch: {results[-1]}")
            return
        last = results[-1]
        with self._lock:
            self._num_in_flight -= 1
            waiter = None
            if not self._ended:
                if len(results) > 1:              # each step before the last had a successor
                    self._keep_chained(results[:-1])
                waiter = self._keep(last.outputs[0], output_token_id(last))
                if not self._ended:
                    self._ahead_page_id = None    # the pass ahead (if any) counts
            else:                                 # a pass ahead of the loop's end: dropped
                self._undo_ahead_page()
                if not self._num_in_flight:
                    waiter, self._waiter = self._waiter, None
        if waiter is not None and not self._scheduler.defer_wake(lambda: waiter.set_result(None)):
            waiter.set_result(None)

    def _keep_chained(self, results: tuple[ForwardResult, ...]) -> None:
        """Under the lock: keep the outputs of the steps that chained steps followed (no end
        among them: chain_step checked; the position and pages moved on when it prepared)."""
        self._outputs.extend(result.outputs[0] for result in results)
        self._num_outputs += len(results)
        self._num_chained = 0

    def _keep(self, output: object, token_id: int) -> Future | None:
        """Under the lock: keep a pass's output and go on; the waiter to wake, if any."""
        self._outputs.append(output)
        self._num_outputs += 1
        if (self._stopped or self._num_outputs >= self._max_tokens
                or token_id in self._stop_token_ids):
            self._ended = True
        elif not self._num_in_flight:             # else the next pass runs already (ahead)
            if len(self._outputs) >= MAX_UNREAD_OUTPUTS:
                self._paused_token = token_id  # the reader's next take resumes it
            else:
                self._submit_next(token_id)
        if len(self._outputs) >= self._wake_at or (self._ended and not self._num_in_flight):
            waiter, self._waiter = self._waiter, None
            return waiter
        return None

    def _resume(self) -> None:
        """Under the lock: submit the pass held for the reader, if any (and not stopped)."""
        token_id, self._paused_token = self._paused_token, None
        if token_id is not None and self._stopped:
            self._ended = True
        elif token_id is not None:
            self._submit_next(token_id)

    def _submit_next(self, token_id: int) -> None:
        """Under the lock: submit the next pass, or end the loop."""
        try:
            step = self._prepare_step(token_id, self._kv_len + 1)
        except TrapError as exc:
            self._ended, self._trap = True, str(exc)
            return
        if step is None:
            self._ended = True            # no page without reclaim: the guest goes on
            return
        queued = self._scheduler.submit_chained(self._queue_key, self._priority, step[0],
                                                self._on_pass, self.prepare_next,
                                                self.chain_step)
        self._num_in_flight += queued
        self._ended = not queued                       # refused: the scheduler is closed

    def _undo_ahead_page(self) -> None:
        """Under the lock: give back the page the pass ahead added (its output does not count)."""
        page_id, self._ahead_page_id = self._ahead_page_id, None
        if page_id is not None:
            if self.added_page_ids and self.added_page_ids[-1] == page_id:
                self.added_page_ids.pop()
                self._num_pages -= 1
            self._pages.undo_grow(self._sequence_id, page_id)

    def _end(self, error: str) -> None:
        """A pass failed or was cancelled. Its error is the loop's unless the loop had ended
        well before it (a pass prepared ahead, dropped); a later failure replaces an earlier."""
        with self._lock:
            self._num_in_flight -= 1
            if self._ended or self._num_in_flight:    # a pass ahead: ran after the end, or not
                self._undo_ahead_page()
            if not self._ended or self._error is not None:
                self._error = error
            self._ended = True
            if self._num_in_flight:
                return
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set_result(None)
