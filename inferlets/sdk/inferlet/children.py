"""Child inferlets (WIT `children`): launch an instance, talk to it, take its result.

    child = inferlet.spawn("", ["--question", q])       # "" : this inferlet's own program
    child.send("go")                                     # its inferlet.receive() gets it
    note = child.receive()                               # what it sent (inferlet.send)
    answer = child.result()                              # its run's result (waits for its end)

A child's client is its parent. It runs with its parent's limits, counts against the tenant's
instance and page quotas, and ends when its parent ends unless spawned `detached`.
"""
from __future__ import annotations

from inferlet._wit import Err, children
from inferlet.errors import InferletError

__all__ = ["Child", "ChildError", "spawn"]


class ChildError(InferletError):
    """A child could not be spawned (the message names the program or the limit), or ended
    without a result (the message is "error: ...", "trap: ..." or "terminated: ...")."""


class Child:
    """A spawned child instance. Dropping it does not end the child; `kill` does."""

    __slots__ = ("_handle", "id")

    def __init__(self, handle: "children.Child") -> None:
        self._handle = handle
        self.id: str = handle.id()

    def send(self, message: str) -> None:
        """Deliver `message` to the child (its `inferlet.receive`); ChildError when it has
        ended or its unread messages would pass the host's limit."""
        try:
            self._handle.send(message)
        except Err as err:
            raise ChildError(err.value) from None

    def receive(self) -> str | None:
        """The child's next message (its `inferlet.send`), waiting for one; None once it has
        ended and every message it sent was read."""
        return self._handle.receive()

    def try_receive(self) -> str | None:
        """The child's next message if one is waiting, else None."""
        return self._handle.try_receive()

    def result(self) -> str:
        """Wait for the child's end; its result, or ChildError naming how it ended."""
        try:
            return self._handle.wait()
        except Err as err:
            raise ChildError(f"child {self.id}: {err.value}") from None

    def kill(self) -> bool:
        """End the child (and its own children); False when it had already ended."""
        return self._handle.kill()

    def __repr__(self) -> str:
        return f"Child({self.id!r})"


def spawn(program: str = "", args: "list[str] | tuple[str, ...]" = (), *,
          detached: bool = False) -> Child:
    """Launch a child: `program` "" for this inferlet's own program, else one of the tenant's
    programs by hash (`pie run`: the app's name or hash). ChildError names the program or the
    limit that refused it (max_spawn_depth, max_children, max_spawns, the tenant's quotas)."""
    try:
        return Child(children.spawn(program, [str(arg) for arg in args], detached))
    except Err as err:
        raise ChildError(err.value) from None
