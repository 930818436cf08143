"""What a binding may use of the instance that called it: `BindingContext`.

The Instance (host/sandbox/instance.py) is the one implementation; the bindings see only this
surface, so what a WIT call can reach is listed here and nowhere else.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from host.messages.hub import InstanceChannel
from host.runtime_config import InstanceLimits
from host.sandbox.instance import HostServices

if TYPE_CHECKING:
    from host.bindings.tables import InstanceTables

__all__ = ["BindingContext"]


class BindingContext(Protocol):
    """The calling instance, as the bindings see it."""

    instance_id: str
    tenant: str
    args: tuple[str, ...]
    limits: InstanceLimits
    services: HostServices          # the runtime's shared parts: scheduler, hub, engine, model info
    tables: "InstanceTables"          # queues, forward-futures, pages of this instance
    channel: InstanceChannel        # its client and topic messages
    trap_cause: str | None          # the first host-side cause recorded for a trap
    last_host_exit: float           # time.monotonic() of the last host call's return (idle clock)

    def wait_future(self, future: Future, call: str) -> Any:
        """Block until `future` resolves; Cancelled / TrapError on terminate or max_blocking_s."""

    def check_not_cancelled(self, call: str) -> None:
        """Raise Cancelled once the instance was asked to end."""

    def blocking_timeout(self) -> float | None:
        """The longest a blocking call may wait (None: unbounded)."""

    def log(self, line: str) -> None:
        """Append a line to the instance's log."""
