"""Runtime: ties the engine, programs, instances, KV pages, scheduler and messages together.

launch -> an Instance on its own thread; it ends by returning, by a trap, or by `terminate`.
When the pool runs dry, the contention policy (host/kv/contention.py) names instances over their
tenant's or their fair share; they are suspended (host/suspensions.py: pages to host memory,
restored when the pool has room), and the one that asked waits suspended when none may be.
Termination remains for what no wait can serve: a request above the tenant's hard quota, a swap
space that is full, a suspension past suspend_deadline_s; the trap names which. Whatever the end,
`_finish` cancels its pending passes, closes its channels, returns every page reference (exports
too, unless persistent) and emits exactly one final InstanceEvent.
"""
from __future__ import annotations

import gc
import importlib.metadata
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Iterable

from engine.protocol import EngineLike, EngineStats
from host.bindings import build_linker, provided_items
from host.kv import ExportRegistry, InstancePages, PageAllocator, PageStats
from host.errors import OutOfPagesError
from host.kv.contention import (Holder, PoolView, next_victim, reclaim_reason,
                                tenant_shares)
from host.kv.swap import SwapSpace
from host.messages.hub import MessageHub
from host.outbound import Outbound
from host.runtime_config import InstanceLimits, RuntimeConfig
from host.runtime_defaults import resolved_policy
from host.sandbox.events import EndedInstance, InstanceEvent, InstanceOutcome
from host.sandbox.guest_activity import IDLE_WAIT_S, GuestActivity
from host.sandbox.instance import HostServices, Instance, Launch, ModelInfo
from host.sandbox.instance_threads import InstanceThreads
from host.sandbox.linear_memory import LinearMemories
from host.sandbox.programs import Program, ProgramCache, ProgramStats, make_engine
from host.sandbox.spare_instances import SpareHandover, SpareInstances
from host.sandbox.start_gate import start_gate_for
from host.spawns import SpawnHooks, Spawns
from host.bindings.tables import InstanceTables
from host.scheduling.scheduler import BatchScheduler, SchedulerPolicy, SchedulerStats
from host.restore_costs import measure_restore_costs
from host.suspensions import Suspensions, SuspensionStats

__all__ = ["Runtime", "RuntimeStats", "InstanceInfo", "InstanceEvent", "InstanceOutcome",
           "SpawnHooks", "SuspensionStats"]

_log = logging.getLogger("pie.runtime")
_RECLAIM_WAIT_S = 5.0
_MAX_RECLAIM_ROUNDS = 64       # victims one reclaim may suspend before the requester waits
_MAX_FINISHED_KEPT = 4096
_IDLE_CHECK_S = 0.05           # how often the ticker looks for instances idle in a WASI call
EventCallback = Callable[[InstanceEvent], None]


@dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    tenant: str
    program_hash: str
    started_at: float
    num_pages_held: int


@dataclass(frozen=True)
class RuntimeStats:
    pages: PageStats
    scheduler: SchedulerStats
    engine: EngineStats
    programs: ProgramStats
    num_running: int
    num_launched: int
    num_finished: int
    suspensions: SuspensionStats = field(default_factory=SuspensionStats)


class Runtime:
    """The host. Thread-safe; use as a context manager or call `close()`."""

    def __init__(self, engine: EngineLike, config: RuntimeConfig = RuntimeConfig()) -> None:
        self.engine = engine
        self.config = config
        policy = resolved_policy(config.scheduler or SchedulerPolicy(), engine)
        current = threading.local()
        # lives as long as the engine; None: Wasmtime's own memories (copy-on-write images)
        self.linear_memories = (
            LinearMemories(current, config.memory_pool_mb << 20, config.memory_pool_idle_s)
            if config.count_linear_memory else None)
        self.wasm_engine = make_engine(self.linear_memories)
        self.programs = ProgramCache(self.wasm_engine, config.cache_dir, provided_items(),
                                     compile_timeout_s=config.compile_timeout_s,
                                     compile_memory_mb=config.compile_memory_mb,
                                     copy_on_write=self.linear_memories is None)
        self.page_allocator = PageAllocator(engine.num_pages)
        self._kv_shares = dict(config.kv_shares)
        if sum(self._kv_shares.values()) > engine.num_pages:
            raise ValueError(f"RuntimeConfig.kv_shares: the shares sum to "
                             f"{sum(self._kv_shares.values())} pages, more than the pool of "
                             f"{engine.num_pages}")
        self.exports = ExportRegistry(self.page_allocator, page_limit=self.export_page_limit)
        # swap or recompute (measured while the engine is idle: before the scheduler runs)
        self.restore_costs = measure_restore_costs(
            engine, self.page_allocator, config.restore if config.swap_mb else "swap")
        _log.info("runtime: %s", self.restore_costs.describe())
        self.scheduler = BatchScheduler(engine, policy)
        self.swap = SwapSpace(config.swap_mb << 20, self._swap_limit)
        self.suspensions = Suspensions(engine, self.scheduler, self.page_allocator, self.swap,
                                       config.suspend_deadline_s, self.pool_view,
                                       self.restore_costs)
        self.page_allocator.on_free = self.suspensions.wake
        self.hub = MessageHub(config.messages)
        self.spawns = Spawns(partial(self._launch, client=False), self.terminate, self.send)
        self.outbound = Outbound()            # the instances' HTTP requests and MCP calls
        tokenizer = engine.tokenizer
        self.services = HostServices(
            wasm_engine=self.wasm_engine, linker=build_linker(self.wasm_engine, current),
            scheduler=self.scheduler, hub=self.hub, engine=engine,
            model_info=ModelInfo(config.model_name or engine.model_name, engine.page_size, tokenizer.vocab_size,
                                 tuple(tokenizer.stop_token_ids), tokenizer.chat_template,
                                 policy.max_batch_tokens),
            version=_version(), epoch_tick_ms=config.epoch_tick_ms, current=current,
            threads=InstanceThreads(),
            counts_memory=self.linear_memories is not None,
            guests=GuestActivity(start_gate_for(config.start_slots)), spawner=self.spawns)
        self._lock = threading.Lock()
        self._running: dict[str, Instance] = {}
        self._finished: dict[str, EndedInstance] = {}   # the newest, bounded
        self._abandoned: dict[str, Instance] = {}   # ended on another thread than their own
        self._num_finished_chars = 0          # log and result characters of _finished
        self._launch_counter = itertools.count()
        self._num_launched = 0
        self._num_finished = 0
        self._closed = threading.Event()
        self._num_ticks = 0                   # epoch ticks so far (the ticker's thread writes)
        self.scheduler.start()
        self._ticker = threading.Thread(target=self._tick, name="pie-epoch", daemon=True)
        self._ticker.start()
        self.spares = SpareInstances(
            self._make_spare, config.max_spare_instances, self.services.threads.run,
            lambda: not self._running,
            self.linear_memories.warm if self.linear_memories is not None else lambda _: None)
        if config.freeze_heap:
            gc.collect()
            gc.freeze()

    @property
    def num_epoch_ticks(self) -> int:
        """Wasmtime epoch ticks so far: every epoch_tick_ms while some guest may run Wasm, none
        while every instance waits in the host (or none runs)."""
        return self._num_ticks

    # -------------------------------------------------------------- programs
    def load_program(self, wasm_bytes: bytes) -> Program:
        """Validate and compile (or load from the cache). Raises host.sandbox.programs.ProgramError."""
        return self.programs.load(wasm_bytes)

    # ------------------------------------------------------------- instances
    def launch(self, program: Program | str, args: Iterable[str] = (), *,
               tenant: str = "default", limits: InstanceLimits | None = None,
               on_event: EventCallback | None = None) -> str:
        """Start an instance of `program` (a Program or the hash of a loaded one); returns its id.
        `on_event` is called on the instance's thread for each message and once at the end.
        The instance is the root of its own tree of children (host/spawns.py)."""
        if isinstance(program, str):
            program = self.programs.get(program)
        limits = limits or self.config.limits
        return self._launch(program, tuple(str(arg) for arg in args), tenant, limits, on_event,
                            lambda instance_id: self.spawns.add_root(instance_id, tenant,
                                                                     program, limits),
                            client=True)

    def set_spawn_hooks(self, hooks: SpawnHooks | None) -> None:
        """How children.spawn finds a program other than the parent's own, and who admits a
        child (host/spawns.py). None (the default): every spawn refused; SpawnHooks(): children
        of an instance's own program, admitted by the spawn limits alone."""
        self.spawns.set_hooks(hooks)

    def _launch(self, program: Program, args: tuple[str, ...], tenant: str,
                limits: InstanceLimits, on_event: EventCallback | None,
                before_start: Callable[[str], None], *, client: bool) -> str:
        """Start an instance; `before_start(instance_id)` runs just before it may run. `client`:
        launched by a client (the scheduler's start hold waits for a pause in those), not
        spawned by an instance."""
        if self._closed.is_set():
            raise RuntimeError("the runtime is closed")
        instance_id = uuid.uuid4().hex[:12]
        emit = self._emitter(instance_id, on_event)
        pages = InstancePages(
            self.page_allocator, self.exports, instance_id=instance_id, tenant=tenant,
            page_quota=self.page_allocator.num_pages if limits.page_quota is None else limits.page_quota,
            page_size=self.engine.page_size,
            reclaim=lambda num_pages: self._reclaim(instance_id, num_pages),
            vocab_size=self.services.model_info.vocab_size,
            max_kv_len=self.engine.model_config.max_position)
        channel = self.hub.open(instance_id, tenant,
                                lambda message: emit(InstanceEvent(instance_id, "message", message)))
        launch = Launch(instance_id, tenant, args, limits, InstanceTables(
                            pages, self.outbound.for_instance(tenant, limits.outbound)), channel,
                        next(self._launch_counter),
                        lambda inst, outcome: self._finish(inst, outcome, emit))
        instance = self.spares.take(program, limits, tenant)
        if instance is None:
            instance = Instance(program=program, limits=limits, services=self.services,
                                launch=launch)
        else:
            instance.bind(launch)
        self.scheduler.set_owner_group(instance_id, tenant)
        self.scheduler.owner_starting(instance_id, burst=client)
        with self._lock:
            self._running[instance_id] = instance
            self._num_launched += 1
        before_start(instance_id)
        instance.start()
        return instance_id

    def keep_spares(self, program: Program | str, num_spares: int,
                    limits: InstanceLimits | None = None, owner: str = "") -> None:
        """Keep `num_spares` instances of `program` instantiated ahead, for launches with
        `limits` (default: the config's) by tenant `owner` ("": by anyone): made while no
        instance runs, each taken by a launch (host/sandbox/spare_instances.py). 0: none.
        Raises ValueError past RuntimeConfig.max_spare_instances."""
        if isinstance(program, str):
            program = self.programs.get(program)
        self.spares.keep(program, num_spares, limits or self.config.limits, owner)
        self.spares.fill()

    def wait_spares(self, timeout: float = 10.0) -> bool:
        """Wait until no spare is being made; False if `timeout` passed first."""
        return self.spares.wait_filled(timeout)

    def send(self, instance_id: str, message: str) -> bool:
        """Deliver a client message to a running instance; False when it has ended. Raises
        host.errors.LimitError when its unread client messages would pass client_max_chars."""
        self._instance(instance_id)
        return self.hub.deliver(instance_id, message)

    def terminate(self, instance_id: str, reason: str = "terminated by its client") -> bool:
        """Ask an instance to end (it ends with status "terminated" and `reason`). False when it
        had already ended."""
        return self._instance(instance_id).terminate(reason)

    def wait(self, instance_id: str, timeout: float | None = None) -> InstanceOutcome:
        """The outcome of an instance, waiting for its end. Raises TimeoutError."""
        outcome = self._instance(instance_id).wait(timeout)
        if outcome is None:
            raise TimeoutError(f"instance {instance_id} still running after {timeout} s")
        return outcome

    def list_instances(self, tenant: str | None = None) -> list[InstanceInfo]:
        """The running instances (of `tenant`, or all), oldest first."""
        with self._lock:
            running = sorted(self._running.values(), key=lambda inst: inst.launch_index)
        return [InstanceInfo(inst.instance_id, inst.tenant, inst.program.hash, inst.started_at,
                             inst.tables.pages.num_pages_held)
                for inst in running if tenant is None or inst.tenant == tenant]

    def instance_log(self, instance_id: str) -> tuple[str, ...]:
        """The instance's log: runtime.log lines and its stdout / stderr, line by line."""
        return self._instance(instance_id).log_lines()

    def statistics(self) -> RuntimeStats:
        with self._lock:
            num_running, launched, finished = (len(self._running), self._num_launched,
                                               self._num_finished)
        return RuntimeStats(self.page_allocator.statistics(), self.scheduler.statistics(),
                            self.engine.statistics(), self.programs.statistics(), num_running,
                            launched, finished, self.suspensions.statistics())

    # -------------------------------------------------------------- lifecycle
    def close(self, timeout: float = 10.0) -> None:
        """Terminate every instance, wait for them, stop the scheduler and the epoch ticker."""
        if self._closed.is_set():
            return
        with self._lock:
            running = list(self._running.values())
        for instance in running:
            instance.terminate("the runtime is closing")
        for instance in running:
            instance.wait(timeout)
        self._closed.set()
        self.suspensions.close()
        self.outbound.close()
        self.spares.close(timeout)
        self.services.guests.wake()
        self.scheduler.close()
        self.services.threads.close()
        self._ticker.join()
        if self.linear_memories is not None:
            self.linear_memories.close_pool()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -------------------------------------------------------------- internal
    def _instance(self, instance_id: str) -> Instance | EndedInstance:
        with self._lock:
            instance = self._running.get(instance_id) or self._finished.get(instance_id)
        if instance is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        return instance

    def _emitter(self, instance_id: str, on_event: EventCallback | None) -> EventCallback:
        def emit(event: InstanceEvent) -> None:
            if on_event is None:
                return
            try:
                on_event(event)
            except Exception:  # noqa: BLE001 -- a client callback must not kill the instance
                _log.exception("instance %s: on_event raised", instance_id)
        return emit

    def _finish(self, instance: Instance, outcome: InstanceOutcome, emit: EventCallback) -> None:
        """Called once on the instance's thread after its Store is gone."""
        reason = f"instance {instance.instance_id} ended ({outcome.status})"
        self.spawns.ended(instance.instance_id)       # its children end too, unless detached
        instance.tables.stop_loops()                  # no loop submits after the cancel below
        self.scheduler.cancel_owner(instance.instance_id)
        self.hub.close(instance.instance_id, reason)
        instance.tables.clear()
        self.suspensions.forget(instance.instance_id)
        instance.trim_log(self.config.finished_log_chars)
        ended = EndedInstance(instance.instance_id, outcome, instance.log_lines())
        with self._lock:
            self._running.pop(instance.instance_id, None)
            self._finished[instance.instance_id] = ended
            if not instance.on_own_thread():      # abandoned: its thread is stuck in WASI
                self._abandoned[instance.instance_id] = instance
            self._num_finished_chars += ended.num_kept_chars
            self._forget_finished()
            self._num_finished += 1
        self.spares.fill()                            # when that was the last one running
        emit(InstanceEvent(instance.instance_id, outcome.event_kind, outcome.value))

    def _make_spare(self, program: Program, limits: InstanceLimits,
                    handover: SpareHandover) -> Instance:
        return Instance(program=program, limits=limits, services=self.services, spare=handover)

    def num_lingering(self, tenant: str | None = None) -> int:
        """Ended instances (of `tenant`, or all) whose threads are still blocked in the WASI
        call they were abandoned in: each still holds its Store and linear memory."""
        with self._lock:
            for instance_id in [i for i, inst in self._abandoned.items() if not inst.is_lingering]:
                del self._abandoned[instance_id]
            return sum(1 for inst in self._abandoned.values()
                       if tenant is None or inst.tenant == tenant)

    def _forget_finished(self) -> None:
        """Forget the oldest ended instances past _MAX_FINISHED_KEPT or max_finished_chars
        (the newest is always kept, so `wait` answers right after the end). Under _lock."""
        while len(self._finished) > 1 and (
                len(self._finished) > _MAX_FINISHED_KEPT
                or self._num_finished_chars > self.config.max_finished_chars):
            oldest = self._finished.pop(next(iter(self._finished)))
            self._num_finished_chars -= oldest.num_kept_chars

    def export_page_limit(self, tenant: str) -> int:
        """Most distinct pages `tenant`'s exports may hold: its configured share, else what the
        configured shares leave. Takes no lock (the export registry calls it under its own)."""
        if tenant in self._kv_shares:
            return self._kv_shares[tenant]
        return self.page_allocator.num_pages - sum(self._kv_shares.values())

    def _swap_limit(self, tenant: str) -> int:
        """Most swap bytes `tenant` may hold: its share of the pool's fraction of swap_mb
        (configured share, else what the configured shares leave). Takes no lock."""
        return (self.config.swap_mb << 20) * self.export_page_limit(tenant) \
            // self.page_allocator.num_pages

    def _hard_quota(self, tenant: str) -> int:
        """Most pages `tenant` could ever hold: the pool less the other tenants' configured
        shares."""
        return self.page_allocator.num_pages - sum(
            num_pages for name, num_pages in self._kv_shares.items() if name != tenant)

    def pool_view(self) -> PoolView:
        """A snapshot for the contention policy: running instances, the distinct pages each
        tenant holds (its instances' and its exports'), the shares."""
        with self._lock:
            running = list(self._running.values())
        holders = tuple(Holder(inst.instance_id, inst.tenant,
                               inst.tables.pages.num_resident_pages(), inst.launch_index,
                               inst.tables.pages.suspended) for inst in running)
        held: dict[str, set[int]] = {}
        for inst in running:
            held.setdefault(inst.tenant, set()).update(inst.tables.pages.physical_ids())
        for tenant in self.exports.namespaces():
            held.setdefault(tenant, set()).update(self.exports.page_ids(tenant))
        shares = tenant_shares(self.page_allocator.num_pages, self._kv_shares, set(held))
        return PoolView(self.page_allocator.num_pages, holders,
                        {tenant: len(pages) for tenant, pages in held.items()}, shares)

    def _reclaim(self, requester_id: str, num_pages: int) -> bool:
        """Contention policy (host/kv/contention.py), on the requester's thread with no page
        table lock held: suspend the instances it names, one at a time, until `num_pages` are
        free, and hand them to the requester (InstancePages.hand_over: no one else takes them);
        with none left to name, suspend the requester itself (its retry waits at its gate; its
        restore hands it the pages). True: retry the allocation. A victim whose pages the swap
        space refuses is terminated instead. OutOfPagesError, naming why, when no wait can
        serve the request: above the tenant's hard quota, no other instance running, or the
        requester's own pages refused by the swap space. False: nothing could be done (the
        caller raises OutOfPagesError)."""
        with self._lock:
            requester = self._running.get(requester_id)
        if requester is None:
            return False
        pages = requester.tables.pages
        hard_quota = self._hard_quota(requester.tenant)
        num_held = len(pages.physical_ids()) + pages.num_swapped_pages()    # distinct pages
        if num_held + num_pages > hard_quota:
            raise OutOfPagesError(
                f"out of KV pages: {num_pages} more asked while holding {num_held}, "
                f"above tenant {requester.tenant!r}'s hard quota of {hard_quota} pages (the "
                f"pool less the other tenants' shares): no wait can serve it")
        skipped: set[str] = set()
        for _ in range(_MAX_RECLAIM_ROUNDS):
            try:
                pages.hand_over(self.page_allocator.allocate(num_pages))
                return True
            except OutOfPagesError:
                pass
            if pages.suspended:
                return True               # suspended meanwhile: the retry waits for its restore
            view = self.pool_view()
            if skipped:
                view = replace(view, holders=tuple(h for h in view.holders
                                                   if h.instance_id not in skipped))
            victim = next_victim(view, requester_id, num_pages)
            if victim is None:
                break
            with self._lock:
                instance = self._running.get(victim.instance_id)
            if instance is None:
                skipped.add(victim.instance_id)
                continue
            why = reclaim_reason(view, victim, requester_id, requester.tenant)
            suspended, refused = self.suspensions.suspend(instance)
            if suspended:
                _log.info("instance %s suspended %s", victim.instance_id, why)
                continue
            skipped.add(victim.instance_id)
            if refused is not None:
                instance.terminate(f"out of KV pages and {refused}: terminated {why}",
                                   status="trap")
                instance.wait(_RECLAIM_WAIT_S)
        with self._lock:
            alone = len(self._running) == 1
        if alone:                          # no other instance could give pages back
            stats = self.page_allocator.statistics()
            raise OutOfPagesError(f"out of KV pages: {num_pages} asked, {stats.num_free} free "
                                  f"of {stats.num_pages}, and no other instance runs: no wait "
                                  f"can serve it")
        suspended, refused = self.suspensions.suspend(requester, num_pages)
        if refused is not None:
            raise OutOfPagesError(f"out of KV pages: {num_pages} asked, no instance may be "
                                  f"suspended for it, and this one may not wait: {refused}")
        return suspended or pages.suspended

    def _tick(self) -> None:
        """Advance the Wasmtime epoch every epoch_tick_ms while a guest may run Wasm, else wait
        for one (host/sandbox/guest_activity.py); every _IDLE_CHECK_S at most, end the
        instances idle past their limit in a WASI call (no epoch deadline reaches them) and
        unmap the pooled linear memories unused for the pool's idle time."""
        interval = self.config.epoch_tick_ms / 1000
        guests = self.services.guests
        next_idle_check = time.monotonic()
        while not self._closed.is_set():
            if guests.num_active:
                if self._closed.wait(interval):
                    return
                self.wasm_engine.increment_epoch()
                self._num_ticks += 1
            else:
                guests.wait_for_guests(IDLE_WAIT_S)
            now = time.monotonic()
            if now >= next_idle_check:
                next_idle_check = now + _IDLE_CHECK_S
                self._check_idle(now)

    def _check_idle(self, now: float) -> None:
        """The ticker's idle check (a function of its own: no ended instance stays referenced
        by the ticker's locals while it waits)."""
        with self._lock:
            running = list(self._running.values())
        for instance in running:
            instance.end_if_idle_in_wasi(now)
        if self.linear_memories is not None:
            self.linear_memories.release_idle()


def _version() -> str:
    try:
        return f"pie {importlib.metadata.version('pie-serve')}"
    except importlib.metadata.PackageNotFoundError:
        return "pie 0.1.0"
