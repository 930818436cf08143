"""DirectoryClient: a front's calls of the cluster's Directory, and its watch over it.

The Directory's state lives in its process only (directory.py). The client asks it its life
every `check_s`: while it does not answer, every call fails at once with a ClusterError naming
it ("the cluster's directory is not answering (...)"), so launches and uploads are refused and
running instances go on; once Ray restarted it (another life), the client restores it with
what the front knows (`snapshot()`: a DirectoryState) before the front relies on it again. A
reservation refused for a stale epoch (a restarted Directory knows no epoch yet) triggers that
check at once and is asked again. Thread-safe.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from host.cluster.directory import Reservation
from host.cluster.errors import ClusterError, StaleEpochError
from host.cluster.ray_calls import answer

__all__ = ["DirectoryClient", "DirectoryState"]

_log = logging.getLogger("pie.cluster")
_CALL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class DirectoryState:
    """What a front gives a restarted Directory (Directory.restore's arguments)."""

    epochs: dict[str, int]
    reservations: list[Reservation]
    programs: list[tuple[str, str, int, list]]
    exports: dict[str, tuple[int, dict[tuple[str, str], int]]]


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


class DirectoryClient:
    """Calls of the Directory actor `directory` for one front; `snapshot()` what to restore."""

    def __init__(self, directory: Any, snapshot: Callable[[], DirectoryState],
                 check_s: float = 1.0) -> None:
        self.actor = directory
        self._snapshot = snapshot
        self.check_s = check_s
        self._lock = threading.Lock()              # one check (and restore) at a time
        self._life = self.ask("life")
        self._down: str | None = None              # why the Directory does not answer
        self.num_restorations = 0

    def ask(self, method: str, *args: Any) -> Any:
        """The Directory's answer; what it raised, as raised; ClusterError naming it when it
        does not answer (or did not at the last check)."""
        down = getattr(self, "_down", None)
        if down is not None:
            raise _not_answering(down)
        try:
            return answer(getattr(self.actor, method).remote(*args), _CALL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as exc:
            raise _not_answering(_first_line(exc)) from None

    def tell(self, method: str, *args: Any) -> None:
        """A call of the Directory without waiting for it (lost if the Directory is down)."""
        getattr(self.actor, method).remote(*args)

    def reserve(self, tenant: str, replica_id: str, epoch: int, num_pages: int) -> Reservation:
        """Directory.reserve; a Directory restarted since the last check is restored first."""
        try:
            return self.ask("reserve", tenant, replica_id, epoch, num_pages)
        except StaleEpochError:
            if not self.check():
                raise
            return self.ask("reserve", tenant, replica_id, epoch, num_pages)

    def watch(self, closed: threading.Event) -> None:
        """Check every `check_s` until `closed` is set (a thread's target)."""
        while not closed.wait(self.check_s):
            self.check()

    def check(self) -> bool:
        """Ask the Directory its life: note when it does not answer; restore it when Ray
        restarted it. True when it was restored now."""
        with self._lock:
            try:
                life = ray.get(self.actor.life.remote(), timeout=_CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError) as exc:
                if self._down is None:
                    _log.warning("the cluster's directory does not answer: %s", exc)
                self._down = _first_line(exc)
                return False
            if life == self._life:
                self._down = None
                return False
            state = self._snapshot()
            try:
                taken = ray.get(self.actor.restore.remote(
                    state.epochs, state.reservations, state.programs, state.exports),
                    timeout=_CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError) as exc:
                self._down = _first_line(exc)
                return False
            self._life, self._down = life, None
            self.num_restorations += 1
            _log.warning("the cluster's directory restarted; restored %d reservations", taken)
            return True


def _not_answering(cause: str) -> ClusterError:
    return ClusterError(f"the cluster's directory is not answering ({cause}); launches and "
                        f"uploads are refused until it is back")
