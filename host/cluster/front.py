"""ClusterFront: the server's runtime when it serves a Ray cluster (`pie serve --ray`).

It answers the calls the server makes of a Runtime (load_program, launch, send, terminate, wait,
instance_log, num_lingering, hub.waiting_for_client, close), over the cluster's actors:
- a launch is placed (placement.py) over the live replicas, reserved in the Directory (the
  tenant's quotas across the cluster), and started on the chosen replica; when its affinity
  names an export held on another replica only, the export's pages are copied first through
  Ray's object store into a persistent mirror on the chosen one (charged to that tenant there);
- instance ids are `<replica>.<local id>`: sends, terminates and logs go to the replica the id
  names, without a lookup;
- one reader thread per replica takes its events, which the replica pushes over a connection
  to this front's listener (event_channel.py; its life watched through the Ray call that
  streams them; long polls over Ray when it cannot connect), hands each to the launcher's
  `on_event` in order, frees the instance's reservation at its final event and forwards
  changed exports to the Directory;
- the Directory is watched and restored once Ray restarted it (directory_client.py);
- a front closed with `terminate=False` leaves its instances running; another front lists
  them (`running_instances`) and takes them over (`attach`);
- a replica whose stream call fails is lost: each of its instances ends with a final trap
  event naming it, their reservations are freed and its exports dropped from the index; the
  reader waits for Ray to restart the replica, which rejoins under a new epoch (the rejoin
  hooks run: adapters registered again) and takes placements again.
Thread-safe. Blocking (Ray calls): the server calls it from worker threads, as it does a Runtime.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from host.cluster.directory import Reservation
from host.cluster.directory_client import DirectoryClient, DirectoryState
from host.cluster.errors import ClusterError, ReplicaLostError, StaleEpochError
from host.cluster.event_buffer import ReplicaEvent
from host.cluster.event_channel import ChannelClosed, EventListener
from host.cluster.placement import Placement, PlacementPolicy, ReplicaLoad, place
from host.cluster.ray_calls import answer
from host.cluster.replica import EventBatch, ReplicaFigures
from host.runtime_config import InstanceLimits, RuntimeConfig
from host.sandbox.events import InstanceEvent, InstanceOutcome

__all__ = ["ClusterFront", "ClusterInstance", "ClusterProgram", "FrontStats", "MAX_AFFINITY_CHARS",
           "replica_of"]

_log = logging.getLogger("pie.cluster")
MAX_AFFINITY_CHARS = 256
_MAX_ENDED_KEPT = 4096
_MAX_EARLY_KEPT = 4096         # instances with events before their launch returned
_MAX_LATENCIES_KEPT = 65536
_REJOIN_WAIT_S = 5.0
_CALL_TIMEOUT_S = 60.0
_HEARTBEAT_GRACE_S = 1.0       # a replica's stream sends at least every poll_s; then Ray is asked
_STATUS_OF_KIND = {"result": "ok", "error": "error", "trap": "trap", "terminated": "terminated"}
EventCallback = Callable[[InstanceEvent], None]


@dataclass(frozen=True)
class ClusterProgram:
    """A program the front validated: its hash, size and bytes in Ray's object store (each
    replica fetches them once, at its first launch of it)."""

    hash: str
    num_bytes: int
    ref: Any


@dataclass(eq=False)
class _Instance:
    """The front's record of one instance it launched."""

    instance_id: str
    replica_id: str
    epoch: int
    local_id: str
    tenant: str
    reservation: Reservation
    on_event: EventCallback | None
    done: threading.Event = field(default_factory=threading.Event)
    outcome: InstanceOutcome | None = None


@dataclass(frozen=True)
class ClusterInstance:
    """An instance running on some replica: its id, tenant, program and whether its events come
    to this front."""

    instance_id: str
    tenant: str
    program_hash: str
    attached_here: bool


@dataclass(frozen=True)
class FrontStats:
    """What the front counts: placements by rule, launches whose affinity named an export held
    on the chosen replica (`num_import_local`) or copied there (`num_import_mirrored`),
    instances lost with a replica, replicas lost, and each delivered event's time from its
    emission on the replica to its hand-over here (seconds, the newest kept)."""

    placements: dict[str, int]
    num_import_local: int
    num_import_mirrored: int
    num_lost_instances: int
    num_replicas_lost: int
    event_latencies_s: tuple[float, ...]


def _get(ref: Any) -> Any:
    """ray.get within the front's call timeout, raising what the actor raised itself."""
    return answer(ref, _CALL_TIMEOUT_S)


def replica_of(instance_id: str) -> tuple[str, str]:
    """(replica id, local id) of a cluster instance id; KeyError when it is not one."""
    replica_id, dot, local_id = instance_id.partition(".")
    if not dot or not replica_id.isalnum() or not local_id.isalnum():
        raise KeyError(f"unknown instance {instance_id!r}")
    return replica_id, local_id


class _Hub:
    """The one call the server makes of the runtime's message hub, answered by the replica."""

    def __init__(self, front: "ClusterFront") -> None:
        self._front = front

    def waiting_for_client(self, instance_id: str) -> bool:
        return self._front.waiting_for_client(instance_id)


class ClusterFront:
    """A Runtime-like face over a cluster's directory and replicas (see the module doc).
    `config`: the RuntimeConfig whose `limits` launches default to; `poll_s`: how often an idle
    replica's event stream (or long poll) answers; `push_events` False: events come by long
    polls over Ray instead (for a front whose node replicas cannot connect to); `engine`: what
    the server reads of the served engine here (its model's name, page size, tokenizer), a
    description, not an engine (None: none)."""

    places_by_affinity = True          # `launch` takes an affinity (the server passes it on)

    def __init__(self, directory: Any, replicas: dict[str, Any], *,
                 config: RuntimeConfig = RuntimeConfig(),
                 policy: PlacementPolicy = PlacementPolicy(), poll_s: float = 0.5,
                 push_events: bool = True, directory_check_s: float = 1.0,
                 engine: Any = None, on_close: Callable[[], None] | None = None) -> None:
        if not replicas:
            raise ValueError("ClusterFront: no replicas")
        self.config = config
        self.policy = policy
        self.engine = engine
        self.front_id = uuid.uuid4().hex[:12]
        self.hub = _Hub(self)
        self._replicas = dict(replicas)
        self._poll_s = poll_s
        self._on_close = on_close
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._epochs = dict(zip(replicas, ray.get([h.ping.remote() for h in replicas.values()])))
        self._down: set[str] = set()
        self._loads = {rid: ReplicaLoad(rid, 0) for rid in replicas}
        self._live: dict[str, _Instance] = {}                 # by instance id
        self._ended: OrderedDict[str, _Instance] = OrderedDict()
        self._early: dict[str, list[ReplicaEvent]] = {}      # events before launch returned
        self._programs: dict[str, ClusterProgram] = {}
        self._loaded: set[tuple[str, int, str]] = set()       # (replica, epoch, program hash)
        self._placements: Counter[str] = Counter()
        self._starting: Counter[str] = Counter()     # replica -> launches placed, not started
        self._num_import_local = self._num_import_mirrored = 0
        self._num_lost_instances = self._num_replicas_lost = 0
        self._latencies: deque[float] = deque(maxlen=_MAX_LATENCIES_KEPT)
        self._counted: dict[tuple[str, str], int] = {}     # (tenant, sha256) -> program bytes
        self._exports_seen: dict[str, tuple[int, dict[tuple[str, str], int]]] = {}
        self._directory = DirectoryClient(directory, self._directory_state, directory_check_s)
        self._rejoin_hooks: list[Callable[[str, int], None]] = []
        self._listener = EventListener(ray.util.get_node_ip_address()) if push_events else None
        self._pollers = [threading.Thread(target=self._poll, args=(rid,), daemon=True,
                                          name=f"pie-poll-{rid}") for rid in replicas]
        self._pollers.append(threading.Thread(target=self._directory.watch,
                                              args=(self._closed,), daemon=True,
                                              name="pie-watch-directory"))
        for poller in self._pollers:
            poller.start()

    # ---- programs ---------------------------------------------------------------------------
    def load_program(self, wasm_bytes: bytes) -> ClusterProgram:
        """Validate `wasm_bytes` by compiling it on a live replica; ClusterError naming why it
        is refused. The bytes go to Ray's object store once."""
        wasm_bytes = bytes(wasm_bytes)
        program_hash = hashlib.sha256(wasm_bytes).hexdigest()
        with self._lock:
            known = self._programs.get(program_hash)
        if known is not None:
            return known
        replica_id, epoch = self._any_live()
        self._call(replica_id, "load_program", epoch, wasm_bytes)
        program = ClusterProgram(program_hash, len(wasm_bytes), ray.put(wasm_bytes))
        with self._lock:
            self._loaded.add((replica_id, epoch, program_hash))
            return self._programs.setdefault(program_hash, program)

    def keep_spares(self, program: ClusterProgram | str, num_spares: int,
                    limits: InstanceLimits | None = None, owner: str = "") -> None:
        """Keep `num_spares` instances of `program` instantiated ahead on every live replica,
        for `owner`'s launches ("": anyone's; Runtime.keep_spares there). ClusterError naming
        a replica that refused."""
        if isinstance(program, str):
            with self._lock:
                program = self._programs[program]
        with self._lock:
            live = [(rid, self._epochs[rid]) for rid in self._replicas if rid not in self._down]
        for replica_id, epoch in live:
            key = (replica_id, epoch, program.hash)
            with self._lock:
                loaded = key in self._loaded
            self._call(replica_id, "keep_spares", epoch, program.hash,
                       None if loaded else program.ref, num_spares, limits or self.config.limits,
                       owner)
            with self._lock:
                self._loaded.add(key)

    def count_program(self, tenant: str, sha256: str, num_bytes: int) -> None:
        """Count a stored program against the tenant's max_program_bytes across the cluster
        (once per program), and register its bytes (when loaded here) for replicas resolving
        children of it. ReservationError when it would pass it."""
        with self._lock:
            known = self._programs.get(sha256)
        refs = [known.ref] if known is not None else []
        self._directory.ask("add_program", tenant, sha256, num_bytes, refs)
        with self._lock:
            self._counted[(tenant, sha256)] = num_bytes

    # ---- instances --------------------------------------------------------------------------
    def launch(self, program: ClusterProgram | str, args: Iterable[str] = (), *,
               tenant: str = "default", limits: InstanceLimits | None = None,
               on_event: EventCallback | None = None, affinity: str | None = None) -> str:
        """Place and start an instance; its id. `affinity`: the name of an export it will import,
        or a session key (at most MAX_AFFINITY_CHARS characters). ReservationError past the
        tenant's cluster-wide quotas; ClusterError when no replica can take it."""
        if self._closed.is_set():
            raise ClusterError("the cluster front is closed")
        if affinity is not None and (not isinstance(affinity, str)
                                     or len(affinity) > MAX_AFFINITY_CHARS):
            raise ClusterError(f"affinity must be a string of at most {MAX_AFFINITY_CHARS} "
                               f"characters")
        if isinstance(program, str):
            with self._lock:
                program = self._programs[program]
        limits = limits or self.config.limits
        args = tuple(str(arg) for arg in args)
        held = self._directory.ask("held_pages", tenant, (affinity,)) if affinity else {}
        placement = self._place(affinity, held)
        replica_id = placement.replica_id
        try:
            with self._lock:
                epoch = self._epochs[replica_id]
            reservation = self._directory.reserve(tenant, replica_id, epoch,
                                                  limits.page_quota or 0)
            try:
                if affinity and held:
                    self._bring_export(tenant, affinity, held, replica_id, epoch)
                local_id = self._start(replica_id, epoch, program, args, tenant, limits,
                                       reservation.key)
            except BaseException:
                self._directory.tell("release", reservation.key)
                raise
            return self._register(_Instance(f"{replica_id}.{local_id}", replica_id, epoch,
                                            local_id, tenant, reservation, on_event), placement)
        finally:
            self._started(replica_id)

    def send(self, instance_id: str, message: str) -> bool:
        """Deliver a client message; False once the instance has ended (or its replica is lost).
        LimitError (from the replica) when its unread messages are full."""
        instance = self._instance(instance_id)
        if instance.done.is_set():
            return False
        try:
            return self._call(instance.replica_id, "send", instance.epoch, instance.local_id,
                              message)
        except (ReplicaLostError, StaleEpochError):
            return False

    def terminate(self, instance_id: str, reason: str = "terminated by its client") -> bool:
        """Ask the instance to end; False when it had already ended."""
        instance = self._instance(instance_id)
        if instance.done.is_set():
            return False
        try:
            return self._call(instance.replica_id, "terminate", instance.epoch,
                              instance.local_id, reason)
        except (ReplicaLostError, StaleEpochError):
            return False

    def wait(self, instance_id: str, timeout: float | None = None) -> InstanceOutcome:
        """The instance's outcome once its final event was delivered. TimeoutError."""
        instance = self._instance(instance_id)
        if not instance.done.wait(timeout):
            raise TimeoutError(f"instance {instance_id} still running after {timeout} s")
        assert instance.outcome is not None
        return instance.outcome

    def instance_log(self, instance_id: str) -> tuple[str, ...]:
        """The instance's log, from its replica. KeyError when no longer kept there."""
        instance = self._instance(instance_id)
        try:
            return self._call(instance.replica_id, "instance_log", instance.epoch,
                              instance.local_id)
        except (ReplicaLostError, StaleEpochError) as exc:
            raise KeyError(f"instance {instance_id}: its log was lost with its replica: "
                           f"{exc}") from None

    def waiting_for_client(self, instance_id: str) -> bool:
        instance = self._instance(instance_id)
        if instance.done.is_set():
            return False
        try:
            return self._call(instance.replica_id, "waiting_for_client", instance.epoch,
                              instance.local_id)
        except (ReplicaLostError, StaleEpochError):
            return False

    def running_instances(self, tenant: str | None = None) -> list[ClusterInstance]:
        """Every instance running on the live replicas (the tenant's, or all), whichever front
        launched it: what a front taking over another's can `attach`."""
        with self._lock:
            live = [(rid, self._epochs[rid]) for rid in self._replicas if rid not in self._down]
        found = []
        for replica_id, epoch in live:
            try:
                held = self._call(replica_id, "instances", epoch)
            except (ReplicaLostError, StaleEpochError):
                continue
            found.extend(ClusterInstance(f"{replica_id}.{i.local_id}", i.tenant, i.program_hash,
                                         i.front_id == self.front_id)
                         for i in held if tenant is None or i.tenant == tenant)
        return found

    def attach(self, instance_id: str, tenant: str, on_event: EventCallback | None = None) -> str:
        """Take over the tenant's running instance `instance_id` (launched by any front, e.g.
        one that closed without ending it): its events, those still waiting first, go to
        `on_event` from now on, and this front frees its reservation at its end. KeyError
        when the tenant has no such instance running."""
        replica_id, local_id = replica_of(instance_id)
        with self._lock:
            if replica_id not in self._replicas or replica_id in self._down:
                raise KeyError(f"unknown instance {instance_id!r}: replica {replica_id} is not "
                               f"live")
            epoch = self._epochs[replica_id]
            mine = self._live.get(instance_id)
        if mine is not None:
            if mine.tenant != tenant:
                raise KeyError(f"unknown instance {instance_id!r}")
            mine.on_event = on_event
            return instance_id
        try:
            held = self._call(replica_id, "instances", epoch)
        except (ReplicaLostError, StaleEpochError) as exc:
            raise KeyError(f"unknown instance {instance_id!r}: {exc}") from None
        if not any(i.local_id == local_id and i.tenant == tenant for i in held):
            raise KeyError(f"unknown instance {instance_id!r}")
        with self._lock:
            self._starting[replica_id] += 1           # its events wait until it is registered
        try:
            attached = self._call(replica_id, "attach", epoch, local_id, self.front_id)
        except ClusterError as exc:
            self._started(replica_id)
            raise KeyError(f"unknown instance {instance_id!r}: {exc}") from None
        reservation = Reservation(attached.reservation_key or "", tenant, replica_id, epoch, 0)
        try:
            return self._register(_Instance(instance_id, replica_id, epoch, local_id, tenant,
                                            reservation, on_event), Placement(replica_id,
                                                                              "attached"))
        finally:
            self._started(replica_id)

    def num_lingering(self, tenant: str | None = None) -> int:
        """Lingering instances are a replica's own business: the front counts none."""
        return 0

    def live_replicas(self) -> list[tuple[str, int]]:
        """(replica id, epoch) of each live replica."""
        with self._lock:
            return [(rid, self._epochs[rid]) for rid in self._replicas if rid not in self._down]

    def call_replica(self, replica_id: str, method: str, *args: Any) -> Any:
        """A blocking call of one replica's `method`; ReplicaLostError when it is gone, what
        it raised as it raised it."""
        return self._call(replica_id, method, *args)

    def add_rejoin_hook(self, hook: Callable[[str, int], None]) -> None:
        """`hook(replica_id, epoch)` runs when a replica rejoins under a new life, before the
        front places on it again (e.g. to register what the replica's last life held)."""
        with self._lock:
            self._rejoin_hooks.append(hook)

    def list_instances(self) -> list[str]:
        with self._lock:
            return list(self._live)

    # ---- figures ----------------------------------------------------------------------------
    def statistics(self) -> FrontStats:
        with self._lock:
            return FrontStats(dict(self._placements), self._num_import_local,
                              self._num_import_mirrored, self._num_lost_instances,
                              self._num_replicas_lost, tuple(self._latencies))

    def replica_figures(self, timeout_s: float = 5.0) -> list[ReplicaFigures]:
        """Each live replica's figures (those that do not answer in time are left out)."""
        with self._lock:
            live = [rid for rid in self._replicas if rid not in self._down]
        refs = {rid: self._replicas[rid].figures.remote() for rid in live}
        figures = []
        for rid, ref in refs.items():
            try:
                figures.append(ray.get(ref, timeout=timeout_s))
            except (RayActorError, GetTimeoutError):
                continue
        return figures

    @property
    def directory_restorations(self) -> int:
        """How often this front restored a Directory Ray restarted."""
        return self._directory.num_restorations

    def loads(self) -> dict[str, ReplicaLoad]:
        """The live replicas' loads as placement sees them."""
        with self._lock:
            return {rid: self._load(rid) for rid in self._replicas if rid not in self._down}

    # ---- lifecycle --------------------------------------------------------------------------
    def close(self, timeout: float = 10.0, terminate: bool = True) -> None:
        """Terminate this front's instances, wait for their final events, stop the pollers,
        then `on_close` (e.g. stop the cluster). `terminate` False: leave them running on
        their replicas (for a front that another takes over: `attach`)."""
        if self._closed.is_set():
            return
        with self._lock:
            live = list(self._live.values()) if terminate else []
            replicas = [handle for rid, handle in self._replicas.items()
                        if rid not in self._down]
        if not terminate:             # events of its instances wait on the replicas, untaken
            ray.wait([handle.let_go.remote(self.front_id) for handle in replicas],
                     num_returns=len(replicas), timeout=timeout)
        for instance in live:
            self.terminate(instance.instance_id, "the runtime is closing")
        deadline = time.monotonic() + timeout
        for instance in live:
            instance.done.wait(max(0.0, deadline - time.monotonic()))
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        for poller in self._pollers:
            poller.join(self._poll_s + _REJOIN_WAIT_S + _HEARTBEAT_GRACE_S + 1.0)
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> "ClusterFront":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- placement and start ----------------------------------------------------------------
    def _load(self, replica_id: str) -> ReplicaLoad:
        """Under the lock: the replica's last reported load, with this front's exact count of
        its instances (the report may be a poll old)."""
        reported = self._loads[replica_id]
        num_mine = self._starting[replica_id] + sum(
            1 for inst in self._live.values() if inst.replica_id == replica_id)
        return ReplicaLoad(replica_id, max(num_mine, reported.num_instances),
                           reported.num_queued_passes, reported.num_free_pages)

    def _place(self, affinity: str | None, held: dict[str, int]) -> Placement:
        """Choose a replica and count the launch there as starting (concurrent launches see
        it); `_started` uncounts it."""
        with self._lock:
            loads = [self._load(rid) for rid in self._replicas if rid not in self._down]
            if not loads:
                raise ClusterError("no live replica: every replica of the cluster is lost")
            placement = place(loads, self.policy, key=affinity, held_pages=held)
            self._starting[placement.replica_id] += 1
            return placement

    def _started(self, replica_id: str) -> None:
        with self._lock:
            self._starting[replica_id] -= 1

    def _bring_export(self, tenant: str, name: str, held: dict[str, int], replica_id: str,
                      epoch: int) -> None:
        """The launch names export `name`: count a local import, or copy it to `replica_id`
        first (through Ray's object store) as a mirror there."""
        if held.get(replica_id, 0) > 0:
            with self._lock:
                self._num_import_local += 1
            return
        source = max(held, key=held.get)
        with self._lock:
            source_epoch = self._epochs.get(source)
        try:
            copy = self._replicas[source].read_export.remote(source_epoch, tenant, name)
            refused = self._call(replica_id, "write_export", epoch, tenant, name, copy)
        except (ClusterError, RayActorError) as exc:
            refused = str(exc)
        if refused is not None:
            _log.warning("export %r not copied to replica %s: %s", name, replica_id, refused)
            return
        with self._lock:
            self._num_import_mirrored += 1

    def _start(self, replica_id: str, epoch: int, program: ClusterProgram,
               args: tuple[str, ...], tenant: str, limits: InstanceLimits,
               reservation_key: str) -> str:
        key = (replica_id, epoch, program.hash)
        with self._lock:
            loaded = key in self._loaded
        local_id = self._call(replica_id, "launch", epoch, self.front_id, program.hash,
                              None if loaded else program.ref, args, tenant, limits,
                              reservation_key)
        with self._lock:
            self._loaded.add(key)
        return local_id

    def _register(self, instance: _Instance, placement: Placement) -> str:
        """Record a started instance and hand it the events that arrived before this."""
        with self._lock:
            self._live[instance.instance_id] = instance
            self._placements[placement.rule] += 1
            early = self._early.pop(instance.instance_id, [])
            lost = instance.replica_id in self._down or \
                self._epochs.get(instance.replica_id) != instance.epoch
        for event in early:
            self._deliver(instance, event)
        if lost:
            self._end_lost([instance], instance.replica_id, "lost while the instance started")
        return instance.instance_id

    # ---- events -----------------------------------------------------------------------------
    def _poll(self, replica_id: str) -> None:
        """The replica's reader: take its events (pushed over its connection to this front's
        listener; with push_events False, by long polls over Ray) until the front closes; when
        the replica's stream call (or poll) fails, the replica is lost; then wait for its next
        life. A replica that cannot connect to the listener has its events polled instead."""
        polled = self._listener is None
        while not self._closed.is_set():
            with self._lock:
                epoch = self._epochs[replica_id]
            try:
                if polled:
                    self._take(replica_id, epoch, _get(self._replicas[replica_id].next_events
                                                       .remote(epoch, self.front_id, self._poll_s)))
                    continue
                stream = self._replicas[replica_id].stream_events.remote(
                    epoch, self.front_id, self._listener.address, self._listener.token,
                    self._poll_s)
                polled = not self._read_stream(replica_id, epoch, stream)
            except (RayActorError, StaleEpochError, GetTimeoutError) as exc:
                self._lose(replica_id, epoch, exc)
                self._rejoin(replica_id, epoch)
            except Exception:  # noqa: BLE001 -- the reader must outlive any one stream
                _log.exception("replica %s: event stream failed", replica_id)
                self._closed.wait(self._poll_s)

    def _read_stream(self, replica_id: str, epoch: int, stream: Any) -> bool:
        """Read one stream call's connection until it ends; raises what the call raised (the
        replica is lost) once it failed; returns when it ended otherwise (or the front closed):
        False when the replica never connected."""
        reader = None
        while reader is None and not self._closed.is_set():
            reader = self._listener.take(replica_id, epoch, self._poll_s)
            if reader is None and ray.wait([stream], timeout=0)[0]:
                reader = self._listener.take(replica_id, epoch, 0.0)   # it came and went
            if reader is None and ray.wait([stream], timeout=0)[0]:
                _log.warning("replica %s cannot push its events here (%s); they come by long "
                             "polls over Ray instead", replica_id,
                             _get(stream))            # raises when the replica is gone
                return False
        if reader is None:
            return True
        try:
            while not self._closed.is_set():
                try:
                    batch = reader.read(self._poll_s + _HEARTBEAT_GRACE_S)
                except ChannelClosed:
                    break
                if batch is not None:
                    self._take(replica_id, epoch, batch)
                elif ray.wait([stream], timeout=0)[0]:
                    break
        finally:
            reader.close()
        if not self._closed.is_set():
            why = _get(stream)                # raises when the replica is gone; else reconnect
            _log.info("replica %s: event stream ended: %s", replica_id, why)
            self._closed.wait(self._poll_s)
        return True

    def _take(self, replica_id: str, epoch: int, batch: EventBatch) -> None:
        now = time.time()
        if batch.load is not None:
            with self._lock:
                self._loads[replica_id] = batch.load
        if batch.exports is not None:
            with self._lock:
                self._exports_seen[replica_id] = (epoch, batch.exports)
            self._directory.tell("report_exports", replica_id, epoch, batch.exports)
        for event in batch.events:
            instance_id = f"{replica_id}.{event.local_id}"
            with self._lock:
                instance = self._live.get(instance_id)
                if instance is None:
                    self._keep_early(instance_id, event)
                    continue
                self._latencies.append(now - event.emitted_at)
            self._deliver(instance, event)

    def _keep_early(self, instance_id: str, event: ReplicaEvent) -> None:
        """Under the lock: an event of an instance whose launch has not returned yet (or never
        will: its launch call failed after the start). Bounded: the oldest instance's go."""
        self._early.setdefault(instance_id, []).append(event)
        while len(self._early) > _MAX_EARLY_KEPT:
            del self._early[next(iter(self._early))]

    def _deliver(self, instance: _Instance, event: ReplicaEvent) -> None:
        """Hand one event to the launcher (on the poller's thread, in order); at the final one,
        free the reservation and keep the outcome."""
        if instance.done.is_set():
            return
        final = event.kind in _STATUS_OF_KIND
        if final:
            self._end(instance, InstanceOutcome(_STATUS_OF_KIND[event.kind], event.data))
        if instance.on_event is not None:
            try:
                instance.on_event(InstanceEvent(instance.instance_id, event.kind, event.data))
            except Exception:  # noqa: BLE001 -- a client callback must not stop the poller
                _log.exception("instance %s: on_event raised", instance.instance_id)
        if final:
            instance.on_event = None          # kept ended: not its launcher's callback
            instance.done.set()

    def _end(self, instance: _Instance, outcome: InstanceOutcome) -> None:
        instance.outcome = outcome
        self._directory.tell("release", instance.reservation.key)
        with self._lock:
            self._live.pop(instance.instance_id, None)
            self._ended[instance.instance_id] = instance
            while len(self._ended) > _MAX_ENDED_KEPT:
                self._ended.popitem(last=False)

    def _lose(self, replica_id: str, epoch: int, cause: BaseException) -> None:
        """The replica's life `epoch` is gone: end its instances, let the directory free their
        reservations and drop its exports."""
        with self._lock:
            if self._epochs.get(replica_id) != epoch or replica_id in self._down:
                return
            self._down.add(replica_id)
            self._num_replicas_lost += 1
            victims = [inst for inst in self._live.values()
                       if inst.replica_id == replica_id and inst.epoch == epoch]
            for instance_id in [i for i in self._early if i.startswith(f"{replica_id}.")]:
                del self._early[instance_id]
        reason = str(cause).splitlines()[0][:200] if str(cause) else type(cause).__name__
        _log.warning("replica %s (epoch %d) lost: %s", replica_id, epoch, reason)
        try:
            lines = ray.get(self._directory.actor.drop_replica.remote(replica_id, epoch),
                            timeout=_CALL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            lines = []
        for line in lines:
            _log.warning("%s", line)
        self._end_lost(victims, replica_id, reason)

    def _end_lost(self, victims: list[_Instance], replica_id: str, reason: str) -> None:
        for instance in victims:
            with self._lock:
                self._num_lost_instances += 1
            self._deliver(instance, ReplicaEvent(
                instance.local_id, "trap",
                f"replica lost: replica {replica_id} is gone ({reason}); the instance ended "
                f"with it", time.time()))

    def _rejoin(self, replica_id: str, lost_epoch: int) -> None:
        """Wait for the replica's next life (Ray restarts it; it joins under a new epoch), then
        place on it again. Waits while the front is open."""
        while not self._closed.is_set():
            try:
                epoch = ray.get(self._replicas[replica_id].ping.remote(),
                                timeout=_REJOIN_WAIT_S)
            except (RayActorError, GetTimeoutError):
                self._closed.wait(0.5)
                continue
            if epoch != lost_epoch:
                self._run_rejoin_hooks(replica_id, epoch)
            with self._lock:
                self._epochs[replica_id] = epoch
                self._loads[replica_id] = ReplicaLoad(replica_id, 0)
                if epoch != lost_epoch:
                    self._down.discard(replica_id)
            if epoch == lost_epoch:     # the same life answered: it was not lost after all,
                self._orphans(replica_id, epoch)   # but its instances were ended here
                with self._lock:
                    self._down.discard(replica_id)
            _log.info("replica %s rejoined at epoch %d", replica_id, epoch)
            return

    def _run_rejoin_hooks(self, replica_id: str, epoch: int) -> None:
        with self._lock:
            hooks = list(self._rejoin_hooks)
        for hook in hooks:
            try:
                hook(replica_id, epoch)
            except Exception:  # noqa: BLE001 -- logged: the replica takes placements anyway
                _log.exception("replica %s: a rejoin hook failed", replica_id)

    def _orphans(self, replica_id: str, epoch: int) -> None:
        """Terminate what still runs of instances this front already ended as lost."""
        with self._lock:
            ended = [inst for inst in self._ended.values()
                     if inst.replica_id == replica_id and inst.epoch == epoch]
        for instance in ended:
            try:
                self._call(replica_id, "terminate", epoch, instance.local_id,
                           "its front ended it as lost with its replica")
            except ClusterError:
                pass

    # ---- the Directory ----------------------------------------------------------------------
    def _directory_state(self) -> DirectoryState:
        """What this front gives a restarted Directory."""
        with self._lock:
            return DirectoryState(
                {rid: self._epochs[rid] for rid in self._replicas if rid not in self._down},
                [inst.reservation for inst in self._live.values() if inst.reservation.key],
                [(tenant, sha, size, [self._programs[sha].ref] if sha in self._programs else [])
                 for (tenant, sha), size in self._counted.items()],
                dict(self._exports_seen))

    # ---- helpers ----------------------------------------------------------------------------
    def _instance(self, instance_id: str) -> _Instance:
        replica_of(instance_id)
        with self._lock:
            instance = self._live.get(instance_id) or self._ended.get(instance_id)
        if instance is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        return instance

    def _any_live(self) -> tuple[str, int]:
        with self._lock:
            for replica_id in self._replicas:
                if replica_id not in self._down:
                    return replica_id, self._epochs[replica_id]
        raise ClusterError("no live replica: every replica of the cluster is lost")

    def _call(self, replica_id: str, method: str, *args: Any) -> Any:
        """A blocking call of one replica; ReplicaLostError when it is gone; what the replica
        raised, as it raised it."""
        try:
            return _get(getattr(self._replicas[replica_id], method).remote(*args))
        except RayActorError as exc:
            raise ReplicaLostError(f"replica {replica_id} is gone: "
                                   f"{str(exc).splitlines()[0][:200]}") from None
        except GetTimeoutError:
            raise ReplicaLostError(f"replica {replica_id} did not answer {method} within "
                                   f"{_CALL_TIMEOUT_S} s") from None

