"""EngineReplica: one engine and today's Runtime around it (pages, instances, scheduler, compiled
programs, message hub), run as a Ray actor by `cluster.py`, one per GPU (per process on a CPU).

Every call but the read-only ones names the replica's epoch, its life as the directory counts
them: a call of an earlier life fails fast with StaleEpochError (the instances it named ended
with that life). Instance events wait in an `EventBuffer` per front until that front takes
them: pushed over the front's own connection (`stream_events`, event_channel.py), or by a
long poll (`next_events`); a front that stops reading has its instances' message events
refused once `max_buffered_bytes` wait, and such an instance is terminated (its final event
still goes out). Exports are reported to the front with the events whenever they changed.
Topics reach the other replicas' subscribers through `ClusterTopics` (topics.py) when the
replica is given the Directory. An export can be read out (`read_export`: its pages' bytes,
for Ray's object store) and written into another replica as a persistent mirror of the same
name (`write_export`), charged to the tenant's export share there. A front may hand its
instances over (`let_go`); another takes them (`instances`, `attach`). With the Directory, the
replica's topics, children (children.py), tenant stores (tenant_store.py) and adapters
(`register_adapter`) are the cluster's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

from engine.protocol import EngineLike
from host.cluster.children import cluster_spawn_hooks
from host.cluster.errors import ClusterError, StaleEpochError
from host.cluster.event_buffer import EventBuffer, ReplicaEvent
from host.cluster.event_channel import ChannelClosed, EventWriter
from host.cluster.front_presence import FrontPresence
from host.cluster.placement import ReplicaLoad
from host.cluster.tenant_store import ClusterStore
from host.cluster.topics import ClusterTopics, TopicMessage
from host.errors import LimitError
from host.runtime import Runtime, RuntimeStats
from host.runtime_config import InstanceLimits, RuntimeConfig
from host.sandbox.events import InstanceEvent
from host.sandbox.programs import ProgramError

__all__ = ["ReplicaSpec", "EngineReplica", "EventBatch", "ReplicaFigures", "ExportCopy",
           "ReplicaDescription", "ReplicaInstance", "EXPORT_METADATA_PREFIX",
           "MIRROR_OWNER"]

MIRROR_OWNER = "pie.mirror"      # the owner id of an export copied in from another replica
# The SDK keeps an export's token ids in the tenant's store under this prefix and the export's
# name (inferlets/sdk/inferlet/context.py, Context.export); a mirror carries that entry along.
EXPORT_METADATA_PREFIX = "inferlet.export."
_MAX_EVENTS_PER_BATCH = 4096
_REPORT_EVERY_S = 0.05         # a front gets the load and the exports this often at most
_MAX_ENDED_KEPT = 4096         # ended instances kept attachable while their events wait


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica is built from. `engine_factory()` makes its engine in the replica's
    process; `make_runtime(engine)` its Runtime there (None: `Runtime(engine,
    runtime_config)`); `torch_threads`: torch's intra-op threads there (None: torch's
    default); `orphan_grace_s`: how long the instances of a front no longer heard from (or
    that let go) wait for another front to attach them before they are terminated."""

    replica_id: str
    engine_factory: Callable[[], EngineLike]
    runtime_config: RuntimeConfig = field(default_factory=RuntimeConfig)
    make_runtime: Callable[[EngineLike], Runtime] | None = None
    torch_threads: int | None = 1
    max_buffered_bytes: int = 16 << 20
    orphan_grace_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.orphan_grace_s > 0:
            raise ValueError(f"ReplicaSpec.orphan_grace_s must be positive, "
                             f"got {self.orphan_grace_s}")
        if (not isinstance(self.replica_id, str) or not self.replica_id.isalnum()
                or len(self.replica_id) > 32):
            raise ValueError(f"ReplicaSpec.replica_id must be 1-32 letters or digits, "
                             f"got {self.replica_id!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"ReplicaSpec.torch_threads must be >= 1, got {self.torch_threads}")
        if self.max_buffered_bytes <= 0:
            raise ValueError(f"ReplicaSpec.max_buffered_bytes must be positive, "
                             f"got {self.max_buffered_bytes}")


@dataclass(frozen=True)
class EventBatch:
    """One long poll's answer: events in order; the replica's load (None: not due: it comes
    with every batch holding an instance's end, else at most every 50 ms); its exports
    ((tenant, name) -> pages) when due and changed since they last went (else None)."""

    events: tuple[ReplicaEvent, ...]
    load: ReplicaLoad | None
    exports: dict[tuple[str, str], int] | None


@dataclass(frozen=True)
class ReplicaFigures:
    """What /metrics shows of one replica."""

    replica_id: str
    epoch: int
    stats: RuntimeStats
    num_pages_exported: int
    num_spare_instances: int
    num_lingering: int


@dataclass(frozen=True)
class ReplicaDescription:
    """A replica's model (its engine's name, page size, pool, vocabulary, context) and the
    limits its instances get by default."""

    model_name: str
    page_size: int
    num_pages: int
    vocab_size: int
    max_position: int
    limits: InstanceLimits


@dataclass(frozen=True)
class ReplicaInstance:
    """A running instance as its replica knows it: its local id, tenant, program, the front
    its events go to and its reservation's key in the Directory (None: it has none)."""

    local_id: str
    tenant: str
    program_hash: str
    front_id: str
    reservation_key: str | None


@dataclass(frozen=True)
class ExportCopy:
    """An export's pages read out of one replica: the engine's bytes of them (its read_pages
    value), how many pages they are, and the export's token metadata from the tenant's store
    (None when it has none)."""

    num_pages: int
    data: Any
    metadata: str | None = None


def _digest(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for file_name in sorted(files):
        digest.update(file_name.encode() + b"\0" + hashlib.sha256(files[file_name]).digest())
    return digest.hexdigest()[:16]


class EngineReplica:
    """One engine's runtime behind Ray calls. `join(replica_id) -> epoch` registers this life
    (the directory's `join`; None: epoch 1, for a replica without a directory); `directory`
    and `peer(replica_id)` (another replica's handle): topics across replicas (None: local)."""

    def __init__(self, spec: ReplicaSpec, join: Callable[[str], int] | None = None,
                 directory: Any = None, peer: Callable[[str], Any] | None = None) -> None:
        if spec.torch_threads is not None:
            import torch
            torch.set_num_threads(spec.torch_threads)
        self.replica_id = spec.replica_id
        engine = spec.engine_factory()
        self.runtime = (Runtime(engine, spec.runtime_config) if spec.make_runtime is None
                        else spec.make_runtime(engine))
        self._events = EventBuffer(spec.max_buffered_bytes)
        self._lock = threading.Lock()
        self._route_lock = threading.Lock()          # who an instance's events go to
        self._running: dict[str, ReplicaInstance] = {}   # local id -> it, until its end
        self._ended_early: set[str] = set()          # ended before their launch returned
        self._ended: OrderedDict[str, ReplicaInstance] = OrderedDict()   # newest kept
        self._fronts = FrontPresence(spec.orphan_grace_s)
        self._directory = directory
        self._adapter_dir = Path(tempfile.mkdtemp(prefix=f"pie-adapters-{spec.replica_id}-"))
        self._reported: dict[str, dict[tuple[str, str], int]] = {}   # front -> exports it saw
        self._reported_at: dict[str, float] = {}     # front -> when load and exports last went
        self.epoch = 1 if join is None else join(spec.replica_id)
        threading.Thread(target=self._sweep_orphans, daemon=True,
                         name="pie-orphan-sweeper").start()
        self.topics = None
        if directory is not None and peer is not None:
            self.topics = ClusterTopics(self.replica_id, self.epoch, directory, peer,
                                        self.runtime.hub.deliver_topic)
            self.topics.load()
            self.runtime.hub.set_relay(self.topics)
            self.runtime.hub.set_store_source(
                partial(ClusterStore, directory, self.runtime.hub.limits))
            self.runtime.set_spawn_hooks(cluster_spawn_hooks(
                self.replica_id, self.epoch, directory, self.runtime.programs,
                self.runtime.load_program))

    # ---- calls of the front -----------------------------------------------------------------
    def ping(self) -> int:
        """The replica's epoch (a call that answers once the replica is up)."""
        return self.epoch

    def load_program(self, epoch: int, wasm_bytes: bytes) -> str:
        """Validate and compile a program; its hash. ClusterError naming why it is refused."""
        self._check(epoch)
        try:
            return self.runtime.load_program(wasm_bytes).hash
        except ProgramError as exc:
            raise ClusterError(f"not a valid inferlet component: {exc}") from None

    def launch(self, epoch: int, front_id: str, program_hash: str, wasm_bytes: bytes | None,
               args: tuple[str, ...], tenant: str, limits: InstanceLimits,
               reservation_key: str | None = None) -> str:
        """Start an instance for `front_id` (its events wait for that front); its local id.
        `wasm_bytes`: the program's bytes when this replica may not hold it yet;
        `reservation_key`: its reservation in the Directory, freed here at its end (as the
        front frees it: whichever comes first), so a front's loss leaks none."""
        self._check(epoch)
        self._fronts.seen(front_id)
        if wasm_bytes is not None:
            program_hash = self.load_program(epoch, wasm_bytes)
        try:
            program = self.runtime.programs.get(program_hash)
        except ProgramError as exc:
            raise ClusterError(f"replica {self.replica_id}: {exc}") from None
        local_id = self.runtime.launch(
            program, args, tenant=tenant, limits=limits,
            on_event=lambda event: self._on_event(front_id, reservation_key, event))
        with self._route_lock:
            if local_id in self._ended_early:        # it ended before the launch returned
                self._ended_early.discard(local_id)
            else:
                self._running[local_id] = ReplicaInstance(local_id, tenant, program.hash,
                                                          front_id, reservation_key)
        return local_id

    def let_go(self, front_id: str) -> None:
        """The front closes without ending its instances: their events wait here, untaken, for
        a front that attaches them; its event stream ends."""
        self._events.stop(front_id)
        self._fronts.left(front_id)

    def instances(self, epoch: int) -> list[ReplicaInstance]:
        """The instances running here, and those ended whose events still wait for a front (for
        a front taking over another's)."""
        self._check(epoch)
        with self._route_lock:
            return [*self._running.values(), *self._unclaimed()]

    def attach(self, epoch: int, local_id: str, front_id: str) -> ReplicaInstance:
        """From now on the instance's events go to `front_id`, those still waiting for its
        earlier front first, in order. ClusterError when it is not running here."""
        self._check(epoch)
        with self._route_lock:
            held = self._running.get(local_id)
            table = self._running
            if held is None and local_id in {i.local_id for i in self._unclaimed()}:
                held, table = self._ended[local_id], self._ended
            if held is None:
                raise ClusterError(f"instance {self.replica_id}.{local_id} is not running on "
                                   f"replica {self.replica_id}")
            moved = dataclasses.replace(held, front_id=front_id)
            table[local_id] = moved
            self._events.move(local_id, held.front_id, front_id)
        return moved

    def _sweep_orphans(self) -> None:
        """Every quarter grace: end the instances of fronts gone longer than the grace; once
        none of them runs, drop the front's waiting events and forget it."""
        while not self._events.closed:
            time.sleep(min(self._fronts.grace_s / 4, 5.0))
            for front_id in self._fronts.gone():
                with self._route_lock:
                    orphans = [i.local_id for i in self._running.values()
                               if i.front_id == front_id]
                for local_id in orphans:
                    try:
                        self.runtime.terminate(local_id, (
                            f"its front is gone: no front took its events for "
                            f"{self._fronts.grace_s:g} s (orphan_grace_s)"))
                    except KeyError:
                        pass
                if not orphans:
                    self._events.drop(front_id)
                    self._fronts.forget(front_id)

    def _unclaimed(self) -> list[ReplicaInstance]:
        """Under the route lock: ended instances whose events still wait for their front."""
        waiting = self._events.waiting_ids()
        return [held for held in self._ended.values()
                if (held.front_id, held.local_id) in waiting]

    def send(self, epoch: int, local_id: str, message: str) -> bool:
        self._check(epoch)
        return self.runtime.send(local_id, message)

    def terminate(self, epoch: int, local_id: str, reason: str) -> bool:
        self._check(epoch)
        try:
            return self.runtime.terminate(local_id, reason)
        except KeyError:
            return False

    def instance_log(self, epoch: int, local_id: str) -> tuple[str, ...]:
        self._check(epoch)
        return self.runtime.instance_log(local_id)

    def waiting_for_client(self, epoch: int, local_id: str) -> bool:
        self._check(epoch)
        return self.runtime.hub.waiting_for_client(local_id)

    def next_events(self, epoch: int, front_id: str, max_wait_s: float) -> EventBatch:
        """The front's events (waiting up to `max_wait_s` for one), the load, changed exports."""
        self._check(epoch)
        self._fronts.seen(front_id)
        events = self._events.take(front_id, min(max(max_wait_s, 0.0), 5.0),
                                   _MAX_EVENTS_PER_BATCH)
        now = time.monotonic()
        ended = any(event.kind != "message" for event in events)
        with self._lock:
            due = ended or now - self._reported_at.get(front_id, -1.0) >= _REPORT_EVERY_S
            if due:
                self._reported_at[front_id] = now
        if not due:                    # events go at once; load and exports at most every 50 ms,
            return EventBatch(tuple(events), None, None)    # and with every instance's end
        exports = self.exports()
        with self._lock:
            changed = self._reported.get(front_id) != exports
            self._reported[front_id] = exports
        return EventBatch(tuple(events), self.load(), exports if changed else None)

    def stream_events(self, epoch: int, front_id: str, address: tuple[str, int], token: bytes,
                      heartbeat_s: float) -> str:
        """Push the front's events to it over a connection to `address` (its EventListener,
        `token` its secret), an EventBatch per frame, at least every `heartbeat_s` (an empty
        one when idle), until the connection breaks, the replica closes or its life ends.
        Returns why it stopped."""
        self._check(epoch)
        try:
            writer = EventWriter(address, token, self.replica_id, epoch)
        except OSError as exc:
            return f"cannot reach the front at {address}: {exc}"
        try:
            while not self._events.closed and not self._events.stopped(front_id):
                if writer.peer_closed():
                    return "the front closed the connection"
                writer.send(self.next_events(epoch, front_id, heartbeat_s))
        except ChannelClosed as exc:
            return str(exc)
        finally:
            writer.close()
        return "the replica closed"

    # ---- topics across replicas (calls of other replicas, in their "topics" group) ---------
    def topic_peer(self, tenant: str, topic: str, replica_id: str, subscribed: bool) -> None:
        """Replica `replica_id` has (or no longer has) subscribers of the tenant's topic."""
        if self.topics is not None:
            self.topics.set_peer(tenant, topic, replica_id, subscribed)

    def receive_topics(self, messages: list[TopicMessage]) -> list[tuple[str, str]]:
        """Broadcasts made on another replica, delivered here in order; the topics nobody here
        hears any more."""
        if self.topics is None:
            return []
        return self.topics.receive(messages)

    # ---- exports across replicas ------------------------------------------------------------
    def read_export(self, epoch: int, tenant: str, name: str) -> ExportCopy:
        """The pages of the tenant's export `name`, read out with the engine held. ClusterError
        when there is no such export here."""
        self._check(epoch)
        page_ids = self.runtime.exports.acquire(tenant, name)
        if page_ids is None:
            raise ClusterError(f"export {name!r} of tenant {tenant!r} is not on replica "
                               f"{self.replica_id}")
        try:
            data = self.runtime.scheduler.run_exclusive(
                lambda: self.runtime.engine.read_pages(page_ids))
        finally:
            self.runtime.page_allocator.release(page_ids)
        metadata = self.runtime.hub.store(tenant).get(EXPORT_METADATA_PREFIX + name)
        return ExportCopy(len(page_ids), data, metadata)

    def write_export(self, epoch: int, tenant: str, name: str, copy: ExportCopy) -> str | None:
        """Register `copy` here as the tenant's persistent export `name` (a mirror), on pages
        of this pool counted against the tenant's export share, its token metadata in the
        tenant's store here (within the store's limits). None, or why it was refused."""
        self._check(epoch)
        if self.runtime.exports.get(tenant, name) is not None:
            return None                                   # already here
        if copy.metadata is not None:
            try:
                self.runtime.hub.store(tenant).set(EXPORT_METADATA_PREFIX + name, copy.metadata)
            except LimitError as exc:
                return f"mirror of export {name!r} on replica {self.replica_id}: {exc}"
        try:
            page_ids = self.runtime.page_allocator.allocate(copy.num_pages)
        except Exception as exc:  # noqa: BLE001 -- OutOfPagesError: the reason goes back
            return f"mirror of export {name!r} on replica {self.replica_id}: {exc}"
        try:
            self.runtime.scheduler.run_exclusive(
                lambda: self.runtime.engine.write_pages(page_ids, copy.data))
            return self.runtime.exports.publish(tenant, name, page_ids, owner_id=MIRROR_OWNER,
                                                persistent=True)
        finally:
            self.runtime.page_allocator.release(page_ids)   # the export holds its own refs

    def exports(self) -> dict[tuple[str, str], int]:
        """Every export here: (tenant, name) -> pages."""
        registry = self.runtime.exports
        held = {}
        for tenant in registry.namespaces():
            for name in registry.names(tenant):
                info = registry.get(tenant, name)
                if info is not None:
                    held[(tenant, name)] = len(info.page_ids)
        return held

    def tokenizer(self) -> Any:
        """The engine's tokenizer (pickled across: a front counts prompts with it)."""
        return self.runtime.engine.tokenizer

    def keep_spares(self, epoch: int, program_hash: str, wasm_bytes: bytes | None,
                    num_spares: int, limits: InstanceLimits, owner: str = "") -> None:
        """Keep `num_spares` instances of the program instantiated ahead for `owner`'s launches
        (Runtime.keep_spares); `wasm_bytes`: the program when this replica may not hold it
        yet."""
        self._check(epoch)
        if not isinstance(owner, str):
            raise ClusterError(f"replica {self.replica_id}: keep_spares: owner must be a "
                               f"tenant name, got {type(owner).__name__}")
        if wasm_bytes is not None:
            program_hash = self.load_program(epoch, wasm_bytes)
        try:
            self.runtime.keep_spares(program_hash, num_spares, limits=limits, owner=owner)
        except (ProgramError, ValueError) as exc:
            raise ClusterError(f"replica {self.replica_id}: {exc}") from None

    def model_config(self) -> Any:
        """The engine's model config (what adapters are checked against)."""
        return self.runtime.engine.model_config

    def has_adapters(self) -> bool:
        """Whether the engine serves LoRA adapters (an `adapters` store)."""
        return getattr(self.runtime.engine, "adapters", None) is not None

    def register_adapter(self, epoch: int, name: str, scope: str,
                         files: dict[str, bytes]) -> Any:
        """Write an adapter's files (file name -> bytes) to this replica's disk and register it
        in the engine's store as `name` of `scope`; its AdapterInfo. ClusterError naming what
        is wrong (the tensor at fault, the file names)."""
        self._check(epoch)
        store = getattr(self.runtime.engine, "adapters", None)
        if store is None:
            raise ClusterError(f"replica {self.replica_id} serves no adapters")
        if not files or any(not n or "/" in n or n.startswith(".") for n in files):
            raise ClusterError(f"adapter {name!r}: file names must be plain, got "
                               f"{sorted(files)[:4]!r}")
        folder = self._adapter_dir / scope / f"{name}-{_digest(files)}"
        folder.mkdir(parents=True, exist_ok=True)
        for file_name, data in files.items():
            (folder / file_name).write_bytes(data)
        try:
            return store.register(name, folder, scope=scope)
        except ValueError as exc:          # AdapterError: its message names the cause
            raise ClusterError(str(exc)) from None

    def unregister_adapter(self, epoch: int, name: str, scope: str) -> bool:
        self._check(epoch)
        store = getattr(self.runtime.engine, "adapters", None)
        return store is not None and store.unregister(name, scope=scope)

    def describe(self) -> ReplicaDescription:
        """The served model and the instances' default limits, as the server shows them."""
        engine = self.runtime.engine
        return ReplicaDescription(engine.model_name, engine.page_size, engine.num_pages,
                                  engine.tokenizer.vocab_size, engine.model_config.max_position,
                                  self.runtime.config.limits)

    # ---- figures ----------------------------------------------------------------------------
    def load(self) -> ReplicaLoad:
        stats = self.runtime.statistics()
        return ReplicaLoad(self.replica_id, stats.num_running, stats.scheduler.num_pending,
                           stats.pages.num_free)

    def figures(self) -> ReplicaFigures:
        runtime = self.runtime
        return ReplicaFigures(self.replica_id, self.epoch, runtime.statistics(),
                              runtime.exports.num_pages(), runtime.spares.num_ready,
                              runtime.num_lingering())

    def close(self) -> None:
        """Terminate every instance (their final events go out), then close the runtime."""
        if self.topics is not None:
            self.topics.close()
        self.runtime.close()
        self._events.close()
        shutil.rmtree(self._adapter_dir, ignore_errors=True)

    # ---- internal ---------------------------------------------------------------------------
    def _check(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise StaleEpochError(f"replica {self.replica_id} is at epoch {self.epoch}; a call "
                                  f"of epoch {epoch} names what ended with that life")

    def _on_event(self, launching_front: str, reservation_key: str | None,
                  event: InstanceEvent) -> None:
        """On the instance's thread: queue the event for its front (the one it was attached to
        last, else the launching one); at its end, free its reservation. A front not reading
        has the instance terminated (its final event is always queued)."""
        crossing = ReplicaEvent(event.instance_id, event.kind, event.data, time.time())
        with self._route_lock:
            held = self._running.get(event.instance_id)
            front_id = launching_front if held is None else held.front_id
            kept = self._events.put(front_id, crossing, event.is_final)
            if event.is_final:
                ended = self._running.pop(event.instance_id, None)
                if ended is None:
                    self._ended_early.add(event.instance_id)
                else:
                    self._ended[event.instance_id] = ended
                    while len(self._ended) > _MAX_ENDED_KEPT:
                        self._ended.popitem(last=False)
        if event.is_final and reservation_key is not None and self._directory is not None:
            self._directory.release.remote(reservation_key)
        if kept:
            return
        self.runtime.terminate(event.instance_id, (
            f"front not reading: over {self._events.max_bytes} bytes of events waiting on "
            f"replica {self.replica_id}"))
