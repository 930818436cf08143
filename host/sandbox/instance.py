"""One sandboxed instance: its thread, its Wasmtime Store, its limits and its lifecycle.

Sandbox: a Store per instance with store limits on its total (memory_mb over at most
max_memories linear memories, a number of tables of bounded size, a number of core instances)
and an empty WasiConfig (no filesystem, network or environment; clocks and random only); the
guest's stdout / stderr go to the instance's log (bounded). Idle limit: every host call stamps
`last_host_exit`; an epoch-deadline callback, run by Wasmtime every few ticks of the engine epoch
while the guest computes, traps the guest once it has computed for `max_idle_s` without a host
call, or once it was terminated. Time blocked inside the host never counts. Blocking host calls
wait through `wait_future` / `blocking_timeout`, which `terminate` wakes. Time blocked in a WASI
call (a sleep) counts like computing, but no deadline callback runs there: the runtime's ticker
asks `end_if_idle_in_wasi` instead, which ends such an instance with the same idle trap.

A terminated instance still running 0.5 s later outside the host's bindings (in a WASI call
Wasmtime cannot interrupt, or waiting for a start slot: host/sandbox/start_gate.py) is abandoned:
its end reported, its resources returned, its thread ending by itself (past the idle limit in
WASI, at once). After a trap the Store is poisoned and dropped; the runtime's `on_finish`
releases every page reference, pending submission and channel of the instance.
"""
from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from concurrent.futures import Future
from typing import Any

from wasmtime import Store, WasiConfig, WasmtimeError
from wasmtime import _bindings, _ffi as ffi
from wasmtime.component import Variant

from host.errors import Cancelled, TrapError
from host.runtime_config import InstanceLimits
from host.sandbox.events import InstanceOutcome
from host.sandbox.instance_log import InstanceLog
from host.sandbox.programs import Program
from host.sandbox.services import HostServices, Launch, ModelInfo
from host.sandbox.spare_instances import SpareHandover
from host.sandbox.traps import classify_trap
from host.scheduling.items import SubmissionFuture

__all__ = ["Instance", "HostServices", "Launch", "ModelInfo"]

_log = logging.getLogger("pie.instance")
_ABANDON_AFTER_S = 0.5          # a terminated instance still running then is abandoned
_MAX_CHECK_TICKS = 5            # the deadline callback runs at least every 5 epoch ticks
_COMPUTING_MARGIN_S = 0.2       # a deadline callback this recent: the guest computes, not in WASI
_DEADLINE_CONTINUE = 0          # WASMTIME_UPDATE_DEADLINE_CONTINUE
# The exact ctypes function types wasmtime-py declared for wasmtime_store_epoch_deadline_callback.
_DeadlineCallback = _bindings._wasmtime_store_epoch_deadline_callback.argtypes[1]
_NO_FINALIZER = ctypes.cast(0, _bindings._wasmtime_store_epoch_deadline_callback.argtypes[3])


class Instance:
    """A launched inferlet. Created by the runtime with its `launch`, started with `start()`;
    ends exactly once, calling `launch.on_finish(instance, outcome)` on its own thread after its
    Store is dropped. Or a spare (`spare` given, no launch): started at once, it instantiates
    and waits; `bind` then gives it its launch and `start` lets it run (or the handover
    discards it: it ends calling `spare.on_end(instance)`): host/sandbox/spare_instances.py."""

    def __init__(self, *, program: Program, limits: InstanceLimits, services: HostServices,
                 launch: Launch | None = None, spare: SpareHandover | None = None) -> None:
        if (launch is None) == (spare is None):
            raise ValueError("Instance: give exactly one of launch and spare")
        self.program = program
        self.limits = limits
        self.services = services
        self.spare = spare
        self._launched = False
        self.instance_id, self.tenant, self.args, self.launch_index = "spare", "", (), -1
        if launch is not None:
            self.bind(launch)
        self.started_at = time.time()
        self.outcome: InstanceOutcome | None = None
        self.trap_cause: str | None = None
        self.last_host_exit = time.monotonic()
        self.last_deadline_check = 0.0   # the deadline callback's last run (the guest computing)
        self._in_guest = False           # the Store exists: the guest instantiates or runs
        self._may_hold_start_slot = False    # guests.start() ran, no wait_future since
        self._log = InstanceLog(limits.max_log_chars,
                                lambda line: _log.debug("[%s] %s", self.instance_id, line))
        self._lock = threading.Lock()
        self._cancel_reason: str | None = None
        self._cancel_status = "terminated"   # the outcome's status once cancelled
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
        self._thread_ident: int | None = None   # the thread running _main, once it runs
        self._thread_active = False       # _main has been started and has not returned

    # ------------------------------------------------------------ lifecycle
    def bind(self, launch: Launch) -> None:
        """Give the instance its launch (before `start`); a spare's limits are its launch's
        but for page_quota (host/sandbox/spare_instances.py: spare_key)."""
        self.instance_id, self.tenant, self.args = launch.instance_id, launch.tenant, launch.args
        self.limits = launch.limits
        self.tables, self.channel = launch.tables, launch.channel
        self.launch_index = launch.launch_index
        self._on_finish = launch.on_finish
        self.started_at = time.time()
        self._launched = True

    def start(self) -> None:
        """Run the instance on a thread of its own; a bound spare runs on, on its thread."""
        if self.spare is not None and self._launched:
            self.spare.launch()
            return
        self._thread_active = True
        self.services.threads.run(self._main, f"pie-{self.instance_id}")

    def terminate(self, reason: str, status: str = "terminated") -> bool:
        """Ask the instance to end: blocked host calls wake with Cancelled, a computing guest
        traps at its next epoch check. A guest blocked in a WASI call (a sleep) cannot be
        interrupted: if it has not ended _ABANDON_AFTER_S later it is abandoned (every page,
        pass and channel returned, its end reported); its thread ends by itself later, trapping
        at its next host call or epoch check. It ends with `status` ("terminated", or "trap" for
        a limit) and `reason`. False when it had already ended or been asked."""
        with self._lock:
            if self._done.is_set() or self._cancel_reason is not None:
                return False
            self._cancel_reason, self._cancel_status = reason, status
        self._wake()
        self.services.guests.wake()                  # a computing guest traps at the next ticks
        self.channel.close(f"instance {self.instance_id} terminated: {reason}")
        self.tables.stop_loops()                      # no loop submits after the cancel below
        self.services.scheduler.cancel_owner(self.instance_id)
        self._arm_abandon(_ABANDON_AFTER_S)
        return True

    def end_if_idle_in_wasi(self, now: float) -> bool:
        """End the instance with the idle trap ("no host call for N s (blocked in a WASI call)")
        when it has spent max_idle_s since its last host call with its thread outside both the
        host's bindings and Wasm (no deadline callback for _COMPUTING_MARGIN_S: a computing
        guest is trapped by that callback instead). It is abandoned at once, on a timer thread.
        Called by the runtime's ticker; True when it ended the instance."""
        if not self._in_guest or self.num_host_calls_active > 0 or self._cancel_reason is not None \
                or now - self.last_host_exit < self.limits.max_idle_s \
                or now - self.last_deadline_check < _COMPUTING_MARGIN_S:
            return False
        cause = f"no host call for {self.limits.max_idle_s:g} s (blocked in a WASI call)"
        if not self.terminate(cause, status="trap"):
            return False
        if self.trap_cause is None:
            self.trap_cause = cause
        self._arm_abandon(0.0)
        return True

    def _arm_abandon(self, delay_s: float) -> None:
        timer = threading.Timer(delay_s, self._abandon_if_stuck)
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
            self._arm_abandon(_ABANDON_AFTER_S)
            return
        self.log("host: abandoned after terminate (blocked in a WASI call); its thread ends by "
                 "itself")
        self._finish_once(InstanceOutcome(self._cancel_status, self._cancel_reason or "terminated"))

    def wait(self, timeout: float | None = None) -> InstanceOutcome | None:
        """The outcome once the instance has ended (None when `timeout` passes first)."""
        self._done.wait(timeout)
        return self.outcome

    @property
    def is_running(self) -> bool:
        return not self._done.is_set()

    def on_own_thread(self) -> bool:
        """True when called from the instance's own thread."""
        return threading.get_ident() == self._thread_ident

    @property
    def is_lingering(self) -> bool:
        """Ended (abandoned in a WASI call) while its thread still runs, holding its Store."""
        return self._done.is_set() and self._thread_active

    @property
    def cancel_reason(self) -> str | None:
        return self._cancel_reason

    def log_lines(self) -> tuple[str, ...]:
        return self._log.lines()

    def log(self, line: str) -> None:
        """Append a line to the bounded log (see InstanceLog). Ignored once the instance has
        finished (the thread of an abandoned instance may still write)."""
        if not self._finish_started:
            self._log.append(line)

    def trim_log(self, max_chars: int) -> None:
        """Keep only the newest lines holding at most max_chars characters (an ended instance)."""
        self._log.trim(max_chars)

    # ------------------------------------------------------ blocking helpers
    def blocking_timeout(self) -> float | None:
        return self.limits.max_blocking_s

    def wait_future(self, future: Future, call: str) -> Any:
        """Block until `future` resolves, `terminate` is called, or max_blocking_s passes.
        Returns its result; raises Cancelled / TrapError otherwise (the future's own exception
        is re-raised as is). A scheduler submission is told first (`wait_started`: the adaptive
        policy's hold after a batch waits for instances until they block again); so is the
        scheduler for any other future (`owner_waiting`)."""
        if future.done():
            return future.result()
        guests = self.services.guests
        if self._may_hold_start_slot:                  # the first wait gives the slot back
            self._may_hold_start_slot = False
            guests.release_slot()
        guests.wait_begins()                           # no Wasm runs in here
        try:
            if isinstance(future, SubmissionFuture):
                future.wait_started()
            else:                                      # a decode loop's outputs, a lease...
                self.services.scheduler.owner_waiting(self.instance_id)
            if not future.done():
                self._block_until_done(future, call)
        finally:
            guests.wait_ends()
        return future.result()

    def _block_until_done(self, future: Future, call: str) -> None:
        """wait_future's wait: until `future` resolves (returns), `terminate` (Cancelled) or
        max_blocking_s passes (TrapError)."""
        self._waker.acquire(blocking=False)            # forget a stale signal
        self.check_not_cancelled(call)                 # terminate signals after setting this
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
        if not self._launched:
            raise TrapError(f"{call}: called while instantiating ahead of a launch (a spare)")

    # -------------------------------------------------------------- thread
    def _main(self) -> None:
        self._thread_ident = threading.get_ident()
        self.services.current.instance = self
        try:
            outcome = self._execute()
            self._log.flush_output(self.log)
            self._finish_once(outcome)
        finally:
            self.services.current.instance = None
            self._thread_active = False

    def _finish_once(self, outcome: InstanceOutcome) -> None:
        """Record the outcome and call on_finish, once: on the instance's thread when it ends,
        or on the abandon timer's thread for a thread stuck in a WASI call."""
        with self._lock:
            if self._finish_started:
                return
            self._finish_started = True
        self.outcome = outcome
        try:
            if self._launched:
                self._on_finish(self, outcome)
            else:                                    # a spare that never ran
                self.spare.on_end(self)
        finally:
            self._done.set()

    def _execute(self) -> InstanceOutcome:
        store = None
        try:
            self.services.guests.start()             # may wait for a start slot
            self._may_hold_start_slot = True
            self._in_guest, self.last_host_exit = True, time.monotonic()   # idle clock from here
            if self._cancel_reason is not None:      # terminated while it waited
                return InstanceOutcome(self._cancel_status, self._cancel_reason)
            store = self._make_store()
            guest = self.services.linker.instantiate(store, self.program.component)
            run = guest.get_func(store, "run")
            if run is None:
                return InstanceOutcome("trap", "the component has no `run` export")
            if self.spare is not None and not self._wait_for_launch(store):
                return InstanceOutcome(self._cancel_status, self._cancel_reason or "not launched")
            value = run(store)
            return self._outcome_of_result(value)
        except WasmtimeError as exc:
            return self._outcome_of_trap(str(exc))
        except Exception as exc:   # noqa: BLE001 -- a host bug must not kill the thread silently
            _log.exception("instance %s: host error", self.instance_id)
            return self._outcome_of_trap(f"host error: {exc!r}", host_error=True)
        finally:
            if self._in_guest:
                self.services.guests.end()
            self._in_guest = False
            del store   # drop the (possibly poisoned) Store: nothing may call into it again

    def _wait_for_launch(self, store: Store) -> bool:
        """A spare, instantiated: out of the guests' count and its start slot, wait for the
        launch; then back in, its clocks restarted. False when discarded or terminated."""
        self.services.guests.end()
        self._in_guest = False
        if not self.spare.wait_for_launch(self):
            return False
        threading.current_thread().name = f"pie-{self.instance_id}"
        self.services.guests.start()
        self._may_hold_start_slot = True
        self._in_guest, self.last_host_exit = True, time.monotonic()
        store.set_epoch_deadline(self._check_ticks)
        return self._cancel_reason is None

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
        wasi.stdout_custom = lambda data: self._log.write_output("stdout", data, self.log)
        wasi.stderr_custom = lambda data: self._log.write_output("stderr", data, self.log)
        store.set_wasi(wasi)
        ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), self._deadline_callback, None,
                                                   _NO_FINALIZER)
        self.last_host_exit = time.monotonic()
        store.set_epoch_deadline(self._check_ticks)   # before instantiation, or it traps
        return store

    def _on_deadline(self, _context: Any, _data: Any, delta_out: Any, kind_out: Any) -> int:
        """Wasmtime's epoch-deadline callback: trap (return an error) or continue."""
        try:
            self.last_deadline_check = time.monotonic()
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
            return InstanceOutcome(self._cancel_status, self._cancel_reason)
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
