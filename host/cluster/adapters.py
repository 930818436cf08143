"""ClusterAdapterStore: the engine adapter store a server's TenantAdapters drives, over every
replica of a cluster (`pie serve --ray`).

It answers `register`, `unregister` and `info` as engine.adapters.AdapterStore does: a
registration reads the adapter's files once, puts them in Ray's object store and registers
them on every live replica (each writes them to its own disk); it succeeds when every live
replica took it, else nothing stays registered and the error names the first refusal. A
replica that rejoins (a new life, nothing registered) gets every registered adapter again
before the front places on it. Thread-safe.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import ray

from engine.adapters import AdapterError, scoped_name
from host.cluster.errors import ClusterError

__all__ = ["ClusterAdapterStore", "MAX_ADAPTER_FILES"]

MAX_ADAPTER_FILES = 16


class ClusterAdapterStore:
    """An AdapterStore face over the replicas of `front` (a ClusterFront)."""

    def __init__(self, front: Any) -> None:
        self._front = front
        self._lock = threading.Lock()
        self._registered: dict[tuple[str | None, str], Any] = {}    # -> the files' ObjectRef
        self._infos: dict[str, Any] = {}                             # scoped name -> info
        front.add_rejoin_hook(self._replay)

    def register(self, name: str, directory: str | Path, scope: str | None = None) -> Any:
        """Register the adapter in `directory` as `name` of `scope` on every live replica; its
        AdapterInfo (the first replica's). AdapterError naming the cause when one refuses."""
        files = _read_files(name, Path(directory))
        ref = ray.put(files)
        done, info = [], None
        try:
            for replica_id, epoch in self._front.live_replicas():
                info = self._front.call_replica(replica_id, "register_adapter", epoch, name,
                                                scope, ref)
                done.append((replica_id, epoch))
        except ClusterError as exc:
            for replica_id, epoch in done:
                self._unregister_on(replica_id, epoch, name, scope)
            raise AdapterError(name, f"refused by the cluster: {exc}") from None
        if info is None:
            raise AdapterError(name, "no live replica to register it on")
        with self._lock:
            self._registered[(scope, name)] = ref
            self._infos[scoped_name(scope, name)] = info
        return info

    def unregister(self, name: str, scope: str | None = None) -> bool:
        with self._lock:
            known = self._registered.pop((scope, name), None) is not None
            self._infos.pop(scoped_name(scope, name), None)
        for replica_id, epoch in self._front.live_replicas():
            self._unregister_on(replica_id, epoch, name, scope)
        return known

    def info(self, name: str) -> Any:
        with self._lock:
            return self._infos.get(name)

    def _unregister_on(self, replica_id: str, epoch: int, name: str, scope: str | None) -> None:
        try:
            self._front.call_replica(replica_id, "unregister_adapter", epoch, name, scope)
        except ClusterError:
            pass                                  # gone: its adapters went with it

    def _replay(self, replica_id: str, epoch: int) -> None:
        """A replica's new life: register every adapter on it again."""
        with self._lock:
            registered = list(self._registered.items())
        for (scope, name), ref in registered:
            try:
                self._front.call_replica(replica_id, "register_adapter", epoch, name, scope, ref)
            except ClusterError as exc:
                raise ClusterError(f"adapter {name!r} of {scope!r} not registered again on "
                                   f"replica {replica_id}: {exc}") from None


def _read_files(name: str, directory: Path) -> dict[str, bytes]:
    """The adapter's files (plain files of `directory`, at most MAX_ADAPTER_FILES)."""
    paths = sorted(p for p in directory.iterdir() if p.is_file())
    if not paths or len(paths) > MAX_ADAPTER_FILES:
        raise AdapterError(name, f"its folder holds {len(paths)} files, not 1..{MAX_ADAPTER_FILES}")
    return {path.name: path.read_bytes() for path in paths}
