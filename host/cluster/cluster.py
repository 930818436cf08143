"""Starting a pie cluster's actors on Ray: the Directory and one EngineReplica per replica.

Actors are named (`<prefix>-directory`, `<prefix>-replica-<id>`) in the namespace of the
ClusterConfig and taken over when they exist already (`get_if_exists`), so several fronts (or a
restarted one) share them. A replica is restarted by Ray up to `max_restarts` times; each life
joins the directory under a new epoch. Detached actors outlive the process that made them;
`stop_cluster` kills them.
"""
from __future__ import annotations

import ctypes
import math
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from host.cluster.directory import Directory, TenantQuota
from host.cluster.replica import EngineReplica, ReplicaSpec
from host.cluster.topics import TOPICS_GROUP

__all__ = ["ClusterConfig", "ClusterHandles", "init_ray", "shutdown_ray", "kept_signal_handlers", "start_directory", "start_replicas",
           "start_cluster", "stop_cluster"]

_REPLICA_CONCURRENCY = 64      # calls a replica serves at once (long polls, launches, sends)


def init_ray(**options: Any) -> None:
    """`ray.init(**options)`, this process's fatal-signal handlers kept as they were (see
    `kept_signal_handlers`). A Ray started here (no `address`) listens on 127.0.0.1 only."""
    if not options.get("address"):
        options.setdefault("_node_ip_address", "127.0.0.1")
    with kept_signal_handlers():
        ray.init(**options)


def shutdown_ray() -> None:
    """`ray.shutdown()`, this process's fatal-signal handlers kept as they were."""
    with kept_signal_handlers():
        ray.shutdown()


@contextmanager
def kept_signal_handlers() -> Iterator[None]:
    """The handlers of the fatal signals as they were on entry, put back on exit. Wasmtime
    turns a guest's trap (an illegal instruction or a fault in compiled Wasm) into an error
    through its signal handlers; Ray's driver installs crash handlers over them when it starts
    (absl's failure handler, Python's faulthandler) and resets them to the default when it shuts
    down, either of which would end the whole process on a guest's trap. Ray's worker processes
    install theirs before any Wasmtime engine exists."""
    saved = {signum: _sigaction(signum) for signum in _FATAL_SIGNALS}
    try:
        yield
    finally:
        for signum, action in saved.items():
            _sigaction(signum, action)


_FATAL_SIGNALS = (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE)
_SIGACTION_BYTES = 512         # more than any platform's struct sigaction: kept as opaque bytes


def _sigaction(signum: int, action: ctypes.Array | None = None) -> ctypes.Array:
    """Install `action` for `signum` (None: leave it); returns the action in place before."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = ctypes.create_string_buffer(_SIGACTION_BYTES)
    if libc.sigaction(signum, action, before) != 0:
        raise OSError(ctypes.get_errno(), f"sigaction({signum}) failed")
    return before


@dataclass(frozen=True)
class ClusterConfig:
    """How the actors are made. `num_cpus` / `num_gpus`: Ray resources per replica (a GPU
    machine: num_gpus=1, one replica per GPU); `detached`: actors outlive their maker."""

    num_replicas: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_restarts: int = 4
    detached: bool = True
    namespace: str = "pie"
    name_prefix: str = "pie"

    def __post_init__(self) -> None:
        if isinstance(self.num_replicas, bool) or not 1 <= self.num_replicas <= 1024:
            raise ValueError(f"ClusterConfig.num_replicas must be 1..1024, "
                             f"got {self.num_replicas}")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"ClusterConfig.{name} must be a finite number >= 0, "
                                 f"got {value}")
        if self.max_restarts < -1:
            raise ValueError(f"ClusterConfig.max_restarts must be >= -1 (-1: forever), "
                             f"got {self.max_restarts}")
        for name in ("namespace", "name_prefix"):
            value = getattr(self, name)
            if not value or not value.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"ClusterConfig.{name} must be letters, digits, - or _, "
                                 f"got {value!r}")

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(f"r{index}" for index in range(self.num_replicas))


@dataclass(frozen=True)
class ClusterHandles:
    """The actors of one cluster: the directory and the replicas by id."""

    config: ClusterConfig
    directory: Any
    replicas: dict[str, Any]


def _lifetime(config: ClusterConfig) -> str | None:
    return "detached" if config.detached else None


def start_directory(config: ClusterConfig, quotas: tuple[TenantQuota, ...] = (),
                    default_quota: TenantQuota | None = None) -> Any:
    """The cluster's Directory actor (made, or the running one of that name), on this process's
    node: it lives with the front that made it, never on a replica's node whose loss would
    take it along. Ray restarts it there when its process dies (the fronts restore it)."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(Directory).options(
        name=f"{config.name_prefix}-directory", namespace=config.namespace,
        lifetime=_lifetime(config), get_if_exists=True, num_cpus=0, max_restarts=-1,
        scheduling_strategy=here)
    return actor.remote(quotas, default_quota)


def _join(directory: Any, replica_id: str) -> int:
    return ray.get(directory.join.remote(replica_id))


def _replica_name(config: ClusterConfig, replica_id: str) -> str:
    return f"{config.name_prefix}-replica-{replica_id}"


def _peer(config: ClusterConfig, replica_id: str) -> Any:
    """Another replica's handle, by its name (in a replica's process)."""
    return ray.get_actor(_replica_name(config, replica_id), namespace=config.namespace)


def start_replicas(config: ClusterConfig, specs: list[ReplicaSpec],
                   directory: Any) -> dict[str, Any]:
    """One EngineReplica actor per spec (made, or the running one of that name); waits until
    each answers."""
    replicas = {}
    for spec in specs:
        actor = ray.remote(concurrency_groups={TOPICS_GROUP: 1})(EngineReplica).options(
            name=_replica_name(config, spec.replica_id), namespace=config.namespace,
            lifetime=_lifetime(config), get_if_exists=True, num_cpus=config.num_cpus,
            num_gpus=config.num_gpus, max_restarts=config.max_restarts, max_task_retries=0,
            max_concurrency=_REPLICA_CONCURRENCY)
        replicas[spec.replica_id] = actor.remote(spec, partial(_join, directory), directory,
                                                 partial(_peer, config))
    ray.get([handle.ping.remote() for handle in replicas.values()])
    return replicas


def start_cluster(config: ClusterConfig, make_spec: Any, quotas: tuple[TenantQuota, ...] = (),
                  default_quota: TenantQuota | None = None) -> ClusterHandles:
    """The directory and `config.num_replicas` replicas, `make_spec(replica_id)` giving each
    one's ReplicaSpec. Ray must be initialised."""
    directory = start_directory(config, quotas, default_quota)
    replicas = start_replicas(config, [make_spec(rid) for rid in config.replica_ids], directory)
    return ClusterHandles(config, directory, replicas)


def stop_cluster(handles: ClusterHandles, timeout_s: float = 10.0) -> None:
    """Close every replica (instances terminated, pages returned), then kill the actors."""
    closing = [handle.close.remote() for handle in handles.replicas.values()]
    try:
        ray.get(closing, timeout=timeout_s)
    except Exception:  # noqa: BLE001 -- a replica already gone is as good as closed
        pass
    for handle in [*handles.replicas.values(), handles.directory]:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 -- already dead
            pass
