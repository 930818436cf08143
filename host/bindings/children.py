"""`pie:inferlet/children`: child inferlets the instance spawns, as `child` resources.

The runtime launches a child through `HostServices.spawner` (host/spawns.py: the limits, the
program's resolution, the end of a parent's children). A child's client is its parent: its
messages (messaging.send) go to the parent's `ChildEntry` mailbox, bounded by the hub's
`client_max_chars`; a child that sends past it, its parent not reading, is terminated naming
the limit. `receive` and `wait` block through `BindingContext.wait_future` (terminate wakes them,
max_blocking_s bounds them); a child blocked for its parent is bounded by its own limits
(max_receive_wait_s). Once the parent has ended (a detached child outlives it) or dropped its
handle, what the child sends is dropped.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from wasmtime.component import ResourceHost, Variant

from host.bindings.context import BindingContext
from host.errors import LimitError, SpawnRefused, TrapError
from host.sandbox.events import InstanceEvent, InstanceOutcome

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "CHILD_TYPE", "ChildEntry",
           "ChildTable", "MAX_CHILD_HANDLES"]

INTERFACE = "pie:inferlet/children@0.1.0"
CHILD_TYPE = 16
MAX_CHILD_HANDLES = 65536     # child handles alive per instance (its children ended or not)
MAX_MESSAGE_CHARS = 1 << 20


class ChildEntry:
    """One child as its parent sees it: the messages it sent, unread (at most `max_chars`
    characters), and its outcome. `on_event` is the child's event callback (its thread);
    `bind` names the child once launched, and how to end it when it floods its parent."""

    def __init__(self, max_chars: int) -> None:
        self.child_id = ""
        self.max_chars = max_chars
        self.outcome: Future = Future()
        self._lock = threading.Lock()
        self._messages: deque[str] = deque()
        self._num_chars = 0
        self._waiter: Future | None = None       # a receive waiting for a message or the end
        self._kill: Callable[[str], object] | None = None
        self._closed = False                     # the parent has ended: messages dropped

    def on_event(self, event: InstanceEvent) -> None:
        """A message of the child, or its end (exactly once, last)."""
        if event.is_final:
            status = {"result": "ok"}.get(event.kind, event.kind)
            with self._lock:
                waiter, self._waiter = self._waiter, None
            if not self.outcome.done():
                self.outcome.set_result(InstanceOutcome(status, event.data))
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        with self._lock:
            if self._closed:                     # a detached child's parent has ended
                return
            if self._num_chars + len(event.data) > self.max_chars:
                refused = self._num_chars
            else:
                refused = None
                self._messages.append(event.data)
                self._num_chars += len(event.data)
                waiter, self._waiter = self._waiter, None
        if refused is not None:
            if self._kill is not None:
                self._kill(f"its parent is not reading: {refused} characters of its messages "
                           f"unread, {len(event.data)} more would pass client_max_chars "
                           f"({self.max_chars})")
            return
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def bind(self, child_id: str, kill: Callable[[str], object]) -> None:
        self.child_id = child_id
        self._kill = kill

    def close(self) -> None:
        """The parent has ended: drop the unread messages, and any the child sends later."""
        with self._lock:
            self._closed = True
            self._messages.clear()
            self._num_chars = 0

    def take(self) -> str | None:
        """The oldest unread message, if any."""
        with self._lock:
            if not self._messages:
                return None
            message = self._messages.popleft()
            self._num_chars -= len(message)
            return message

    def arm(self) -> Future | None:
        """A future resolved by the next message or the end; None when either is there now."""
        with self._lock:
            if self._messages or self.outcome.done():
                return None
            self._waiter = Future()
            return self._waiter


class ChildTable:
    """Child resource reps (never reused, from 1) -> entries; only the instance's thread
    touches it. Cleared at the instance's end (the runtime ends its children itself)."""

    def __init__(self) -> None:
        self._entries: dict[int, ChildEntry] = {}
        self._next_rep = 1

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, call: str, entry: ChildEntry) -> int:
        if len(self._entries) >= MAX_CHILD_HANDLES:
            raise TrapError(f"{call}: {MAX_CHILD_HANDLES} child handles alive; drop some first")
        rep = self._next_rep
        self._next_rep += 1
        self._entries[rep] = entry
        return rep

    def get(self, call: str, rep: int) -> ChildEntry:
        entry = self._entries.get(rep)
        if entry is None:
            raise TrapError(f"{call}: unknown child {rep}")
        return entry

    def drop(self, rep: int) -> None:
        """The guest dropped its handle: the child runs on, its messages dropped."""
        entry = self._entries.pop(rep, None)
        if entry is not None:
            entry.close()

    def clear(self) -> None:
        """At the instance's end: every entry closed (a detached child's later messages are
        dropped, not kept for a parent that is gone) and forgotten."""
        for entry in self._entries.values():
            entry.close()
        self._entries.clear()


def spawn(ctx: BindingContext, program: str, args: list[str],
          detached: bool) -> ResourceHost | str:
    """result<child, string>: err names the program or the limit that refused it."""
    call = "children.spawn"
    spawner = ctx.services.spawner
    if spawner is None:
        return f"{call}: this host spawns no children"
    if len(ctx.tables.children) >= MAX_CHILD_HANDLES:
        raise TrapError(f"{call}: {MAX_CHILD_HANDLES} child handles alive; drop some first")
    entry = ChildEntry(ctx.services.hub.limits.client_max_chars)
    try:
        child_id = spawner.spawn(ctx.instance_id, program, tuple(args), detached, entry.on_event)
    except SpawnRefused as exc:
        return str(exc)
    entry.bind(child_id, lambda reason: spawner.kill(child_id, reason))
    # inside a result the Python converter lowers it: an owned host resource of its own
    return ResourceHost.own(ctx.tables.children.add(call, entry), CHILD_TYPE)


def child_id(ctx: BindingContext, store: Any, rep: int) -> str:
    return ctx.tables.children.get("child.id", rep).child_id


def send(ctx: BindingContext, store: Any, rep: int, message: str) -> str | None:
    """result<_, string>: None is ok."""
    call = "child.send"
    entry = ctx.tables.children.get(call, rep)
    if len(message) > MAX_MESSAGE_CHARS:
        raise TrapError(f"{call}: {len(message)} characters, more than {MAX_MESSAGE_CHARS}")
    try:
        delivered = ctx.services.spawner.send(entry.child_id, message)
    except LimitError as exc:
        return f"{call}: {exc}"
    return None if delivered else f"{call}: child {entry.child_id} has ended"


def receive(ctx: BindingContext, store: Any, rep: int) -> str | None:
    """The child's next message, waiting for it; None once it ended and all were read."""
    call = "child.receive"
    entry = ctx.tables.children.get(call, rep)
    while True:
        message = entry.take()
        if message is not None:
            return message
        waiter = entry.arm()
        if waiter is None:
            if entry.outcome.done():
                return entry.take()
            continue
        ctx.wait_future(waiter, call)


def try_receive(ctx: BindingContext, store: Any, rep: int) -> str | None:
    return ctx.tables.children.get("child.try-receive", rep).take()


def wait(ctx: BindingContext, store: Any, rep: int) -> Any:
    """result<string, string>: the child's result, or "<status>: <cause>"."""
    entry = ctx.tables.children.get("child.wait", rep)
    outcome: InstanceOutcome = ctx.wait_future(entry.outcome, "child.wait")
    if outcome.status == "ok":
        return _ok(outcome.value)
    return Variant("err", f"{outcome.status}: {outcome.value}")


def kill(ctx: BindingContext, store: Any, rep: int) -> bool:
    entry = ctx.tables.children.get("child.kill", rep)
    return ctx.services.spawner.kill(entry.child_id, f"killed by its parent {ctx.instance_id}")


def drop(ctx: BindingContext, rep: int) -> None:
    ctx.tables.children.drop(rep)


def _ok(value: str) -> Variant:
    """An ok result<string, string> (its cases share a type: the value is tagged)."""
    return Variant("ok", value)


FUNCTIONS = {"spawn": spawn}
METHODS = {"[method]child.id": child_id, "[method]child.send": send,
           "[method]child.receive": receive, "[method]child.try-receive": try_receive,
           "[method]child.wait": wait, "[method]child.kill": kill}
RESOURCES = {"child": (CHILD_TYPE, drop)}
