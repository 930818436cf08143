"""One sandboxed instance: its thread, its Wasmtime Store, its limits and its lifecycle.

Sandbox: a Store per instance with store limits on its total (memory_mb over at most
max_memories linear memories, a number of tables of bounded size, a number of core instances)
and an empty WasiConfig (no filesystem, network or environment; clocks and random only); the
guest's stdout / stderr go to the instance's log (bounded). Idle limit: every host call stamps
`last_host_exit`; an epoch-deadline callback, run by Wasmtime every few ticks of the engine epoch
while the guest computes, traps the guest once it has computed for `max_idle_s` without a host
call, or once it was terminated. Time blocked inside the host never counts. Blocking host calls
wait through `wait_future` / `blocking_timeout`, which `terminate` wakes.

A terminated instance still running 0.5 s later outside the host's bindings (blocked in a WASI
call Wasmtime cannot interrupt) is abandoned: its end is reported and its resources returned,
its thread finishes by itself later.

After a trap the Store is poisoned: it is dropped, and the runtime's `on_finish` releases every
page reference, pending submission and channel of the instance.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from wasmtime import Engine, Store, WasiConfig, WasmtimeError
from wasmtime import _bindings, _ffi as ffi
from wasmtime.component import Linker, Variant

from engine.protocol import EngineLike
from host.errors import Cancelled, TrapError
from host.messages.hub import InstanceChannel, MessageHub
from host.runtime_config import InstanceLimits
from host.sandbox.events import InstanceOutcome
from host.sandbox.programs import Program
from host.sandbox.tables import InstanceTables
from host.sandbox.traps import classify_trap
from host.scheduling.scheduler import BatchScheduler
from host.scheduling.types import SubmissionFuture

__all__ = ["Instance", "HostServices", "ModelInfo"]

_log = logging.getLogger("pie.instance")
_MAX_LOG_LINES = 2000
_MAX_LOG_LINE_CHARS = 8192       # a longer line is cut, saying how much was cut
_ABANDON_AFTER_S = 0.5          # a terminated instance still running then is abandoned
_MAX_CHECK_TICKS = 5            # the deadline callback runs at least every 5 epoch ticks
_DEADLINE_CONTINUE = 0          # WASMTIME_UPDATE_DEADLINE_CONTINUE
# The exact ctypes function types wasmtime-py declared for wasmtime_store_epoch_deadline_callback.
_DeadlineCallback = _bindings._wasmtime_store_epoch_deadline_callback.argtypes[1]
_NO_FINALIZER = ctypes.cast(0, _bindings._wasmtime_store_epoch_deadline_callback.argtypes[3])


@dataclass(frozen=True)
class ModelInfo:
    """The model as every instance sees it (runtime.get-model-info, less the per-instance quota)."""

    name: str
    page_size: int
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    chat_template: str
    max_batch_tokens: int


@dataclass(frozen=True)
class HostServices:
    """What the bindings of every instance of one runtime share. `current` holds, per thread,
    the Instance whose guest runs on that thread (each instance has its own thread)."""

    wasm_engine: Engine              # epoch interruption on
    linker: Linker
    scheduler: BatchScheduler
    hub: MessageHub
    engine: EngineLike
    model_info: ModelInfo
    version: str
    epoch_tick_ms: int
    current: threading.local
    counts_memory: bool = False      # LinearMemories creates and counts every linear memory


class Instance:
    """A launched inferlet. Created by the runtime, started with `start()`; ends exactly once,
    calling `on_finish(instance, outcome)` on its own thread after its Store is dropped."""

    def __init__(self, *, instance_id: str, tenant: str, program: Program, args: tuple[str, ...],
                 limits: InstanceLimits, services: HostServices, tables: InstanceTables,
                 channel: InstanceChannel,
                 launch_index: int, on_finish: Callable[["Instance", InstanceOutcome], None]) -> None:
        self.instance_id = instance_id
        self.tenant = tenant
        self.program = program
        self.args = args
        self.limits = limits
        self.services = services
        self.tables = tables
        self.channel = channel
        self.launch_index = launch_index
        self.started_at = time.time()
        self.outcome: InstanceOutcome | None = None
        self.trap_cause: str | None = None
        self.last_host_exit = time.monotonic()
        self._on_finish = on_finish
        self._log_lines: collections.deque[str] = collections.deque()
        self._num_log_chars = 0
        self._log_lock = threading.Lock()
        self._partial_output = {"stdout": b"", "stderr": b""}
        self._lock = threading.Lock()
        self._cancel_reason: str | None = None
        # The waker of the instance thread's blocking waits: a lock used as a binary semaphore
        # (held = not signalled); released by a future's done-callback or by terminate. Only the
        # instance thread waits on it, one wait at a time.
        self._waker = threading.Lock()
        self._waker.acquire()
        self._done = threading.Event()
        self._finish_started = False     # under _lock: _finish_once ran (thread end or abandon)
        self.num_host_calls_active = 0   # > 0 while the thread is inside a pie binding
        self.memory_limit_bytes = limits.memory_mb << 20   # charged by LinearMemories
        self.num_memory_bytes = 0
        self.memory_limit_hit = False
        self._deadline_callback = _DeadlineCallback(self._on_deadline)
        self._check_ticks = max(1, min(_MAX_CHECK_TICKS, math.ceil(
            limits.max_idle_s * 1000 / services.epoch_tick_ms)))
        self._thread = threading.Thread(target=self._main, name=f"pie-{instance_id}", daemon=True)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def terminate(self, reason: str) -> bool:
        """Ask the instance to end: blocked host calls wake with Cancelled, a computing guest
        traps at its next epoch check. A guest blocked in a WASI call (a sleep) cannot be
        interrupted: if it has not ended _ABANDON_AFTER_S later it is abandoned (every page,
        pass and channel returned, its end reported); its thread ends by itself later, trapping
        at its next host call or epoch check. False when it had already ended or been asked."""
        with self._lock:
            if self._done.is_set() or self._cancel_reason is not None:
                return False
            self._cancel_reason = reason
        self._wake()
        self.channel.close(f"instance {self.instance_id} terminated: {reason}")
        self.services.scheduler.cancel_owner(self.instance_id)
        self._arm_abandon()
        return True

    def _arm_abandon(self) -> None:
        timer = threading.Timer(_ABANDON_AFTER_S, self._abandon_if_stuck)
        timer.name = f"pie-{self.instance_id}-abandon"
        timer.daemon = True
        timer.start()

    def _abandon_if_stuck(self) -> None:
        """Finish a terminated instance whose thread is stuck outside the host's bindings (in a
        WASI call). Inside a binding it will wake on its own (every blocking binding wakes on
        terminate): look again later."""
        if self._done.is_set():
            return
        if self.num_host_calls_active > 0:
            self._arm_abandon()
            return
        self.log(f"host: abandoned {_ABANDON_AFTER_S:g} s after terminate (blocked in a WASI "
                 f"call); its thread ends by itself")
        self._finish_once(InstanceOutcome("terminated", self._cancel_reason or "terminated"))

    def wait(self, timeout: float | None = None) -> InstanceOutcome | None:
        """The outcome once the instance has ended (None when `timeout` passes first)."""
        self._done.wait(timeout)
        return self.outcome

    @property
    def is_running(self) -> bool:
        return not self._done.is_set()

    @property
    def cancel_reason(self) -> str | None:
        return self._cancel_reason

    def log_lines(self) -> tuple[str, ...]:
        with self._log_lock:
            return tuple(self._log_lines)

    @property
    def num_log_chars(self) -> int:
        return self._num_log_chars

    def log(self, line: str) -> None:
        """Append a line (cut at 8,192 characters); the oldest lines go once the log passes
        limits.max_log_chars or 2,000 lines. Ignored once the instance has finished (the thread
        of an abandoned instance may still write)."""
        if self._finish_started:
            return
        if len(line) > _MAX_LOG_LINE_CHARS:
            line = f"{line[:_MAX_LOG_LINE_CHARS]}... ({len(line) - _MAX_LOG_LINE_CHARS} more " \
                   f"characters cut)"
        with self._log_lock:
            self._log_lines.append(line)
            self._num_log_chars += len(line)
            self._trim_log(self.limits.max_log_chars, _MAX_LOG_LINES)
        _log.debug("[%s] %s", self.instance_id, line)

    def trim_log(self, max_chars: int) -> None:
        """Keep only the newest lines holding at most max_chars characters (an ended instance)."""
        with self._log_lock:
            self._trim_log(max_chars, _MAX_LOG_LINES)

    def _trim_log(self, max_chars: int, max_lines: int) -> None:
        while self._log_lines and (self._num_log_chars > max_chars
                                   or len(self._log_lines) > max_lines):
            self._num_log_chars -= len(self._log_lines.popleft())

    # ------------------------------------------------------ blocking helpers
    def blocking_timeout(self) -> float | None:
        return self.limits.max_blocking_s

    def wait_future(self, future: Future, call: str) -> Any:
        """Block until `future` resolves, `terminate` is called, or max_blocking_s passes.
        Returns its result; raises Cancelled / TrapError otherwise (the future's own exception
        is re-raised as is). A scheduler submission is told first (`wait_started`: the adaptive
        policy's hold after a batch waits for instances until they block again)."""
        if isinstance(future, SubmissionFuture):
            future.wait_started()
        if not future.done():
            self._waker.acquire(blocking=False)        # forget a stale signal
            self.check_not_cancelled(call)             # terminate signals after setting this
            future.add_done_callback(self._wake)
            timeout = self.limits.max_blocking_s
            deadline = None if timeout is None else time.monotonic() + timeout
            while not future.done() and self._cancel_reason is None:
                remaining = -1 if deadline is None else deadline - time.monotonic()
                if deadline is not None and remaining <= 0:
                    break
                self._waker.acquire(timeout=remaining)
            self.check_not_cancelled(call)
            if not future.done():
                raise TrapError(f"{call}: no answer within {timeout:g} s")
        return future.result()

    def _wake(self, _future: Any = None) -> None:
        """Signal the instance thread's blocking wait (a future resolved, or terminate)."""
        try:
            self._waker.release()
        except RuntimeError:     # already signalled
            pass

    def check_not_cancelled(self, call: str) -> None:
        reason = self._cancel_reason
        if reason is not None:
            raise Cancelled(f"{call}: instance {self.instance_id} terminated: {reason}")

    # -------------------------------------------------------------- thread
    def _main(self) -> None:
        self.services.current.instance = self
        try:
            outcome = self._execute()
            self._flush_output()
            self._finish_once(outcome)
        finally:
            self.services.current.instance = None

    def _finish_once(self, outcome: InstanceOutcome) -> None:
        """Record the outcome and call on_finish, once: on the instance's thread when it ends,
        or on the abandon timer's thread for a thread stuck in a WASI call."""
        with self._lock:
            if self._finish_started:
                return
            self._finish_started = True
        self.outcome = outcome
        try:
            self._on_finish(self, outcome)
        finally:
            self._done.set()

    def _execute(self) -> InstanceOutcome:
        store = None
        try:
            store = self._make_store()
            guest = self.services.linker.instantiate(store, self.program.component)
            run = guest.get_func(store, "run")
            if run is None:
                return InstanceOutcome("trap", "the component has no `run` export")
            value = run(store)
            return self._outcome_of_result(value)
        except WasmtimeError as exc:
            return self._outcome_of_trap(str(exc))
        except Exception as exc:   # noqa: BLE001 -- a host bug must not kill the thread silently
            _log.exception("instance %s: host error", self.instance_id)
            return self._outcome_of_trap(f"host error: {exc!r}", host_error=True)
        finally:
            del store   # drop the (possibly poisoned) Store: nothing may call into it again

    def _make_store(self) -> Store:
        store = Store(self.services.wasm_engine)
        limits = self.limits   # the instance's total: memories, tables and instances together
        # Counted: no per-memory bound here, LinearMemories enforces the total and must see every
        # refused growth to record it. Else each of max_memories memories gets an equal share.
        store.set_limits(memory_size=-1 if self.services.counts_memory
                         else (limits.memory_mb << 20) // limits.max_memories,
                         table_elements=limits.max_table_elements,
                         instances=limits.max_core_instances, tables=limits.max_tables,
                         memories=limits.max_memories)
        wasi = WasiConfig()   # no args, env, preopened dirs or network; clocks and random only
        wasi.stdout_custom = lambda data: self._write_output("stdout", data)
        wasi.stderr_custom = lambda data: self._write_output("stderr", data)
        store.set_wasi(wasi)
        ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), self._deadline_callback, None,
                                                   _NO_FINALIZER)
        self.last_host_exit = time.monotonic()
        store.set_epoch_deadline(self._check_ticks)   # before instantiation, or it traps
        return store

    def _on_deadline(self, _context: Any, _data: Any, delta_out: Any, kind_out: Any) -> int:
        """Wasmtime's epoch-deadline callback: trap (return an error) or continue."""
        try:
            cause = self._deadline_cause()
            if cause is None:
                delta_out[0] = self._check_ticks
                kind_out[0] = _DEADLINE_CONTINUE
                return 0
            if self.trap_cause is None:
                self.trap_cause = cause
            error = WasmtimeError(f"instance {self.instance_id}: {cause}")
            return ctypes.cast(error._consume(), ctypes.c_void_p).value or 0
        except BaseException:   # noqa: BLE001 -- never let Python unwind through Wasmtime
            delta_out[0] = 1
            kind_out[0] = _DEADLINE_CONTINUE
            return 0

    def _deadline_cause(self) -> str | None:
        if self._cancel_reason is not None:
            return f"terminated: {self._cancel_reason}"
        if time.monotonic() - self.last_host_exit >= self.limits.max_idle_s:
            return f"no host call for {self.limits.max_idle_s:g} s"
        return None

    def _outcome_of_result(self, value: Any) -> InstanceOutcome:
        if isinstance(value, Variant) and isinstance(value.payload, str):
            limit = self.limits.max_result_chars
            if len(value.payload) > limit:
                return InstanceOutcome("trap", f"`run` returned {value.tag} with a string of "
                                       f"{len(value.payload)} characters, more than the limit "
                                       f"of {limit} (max_result_chars)")
            if value.tag != "ok" and self.memory_limit_hit:
                return InstanceOutcome("error", f"{self._memory_limit_cause()}; the inferlet "
                                       f"then failed with: {value.payload}")
            return InstanceOutcome("ok" if value.tag == "ok" else "error", value.payload)
        return InstanceOutcome("trap", f"`run` returned {value!r}, not result<string, string>")

    def _outcome_of_trap(self, message: str, host_error: bool = False) -> InstanceOutcome:
        if self._cancel_reason is not None:
            return InstanceOutcome("terminated", self._cancel_reason)
        if self.trap_cause is not None:
            return InstanceOutcome("trap", self.trap_cause)
        if host_error:
            return InstanceOutcome("trap", message)
        cause = classify_trap(message, self.limits, self.log_lines())
        if self.memory_limit_hit and not cause.startswith("memory limit"):
            cause = f"{self._memory_limit_cause()}; then {cause}"
        return InstanceOutcome("trap", cause)

    def _memory_limit_cause(self) -> str:
        return f"memory limit {self.limits.memory_mb} MiB reached"

    # -------------------------------------------------------------- output
    def _write_output(self, stream: str, data: bytes) -> None:
        buffered = self._partial_output[stream] + data
        *lines, rest = buffered.split(b"\n")
        for line in lines:
            self.log(f"{stream}: {line.decode('utf-8', errors='replace')}")
        if len(rest) > 4096:   # a guest writing without newlines still reaches the log
            self.log(f"{stream}: {rest.decode('utf-8', errors='replace')}")
            rest = b""
        self._partial_output[stream] = rest

    def _flush_output(self) -> None:
        for stream, rest in self._partial_output.items():
            if rest:
                self.log(f"{stream}: {rest.decode('utf-8', errors='replace')}")
        self._partial_output = {"stdout": b"", "stderr": b""}
