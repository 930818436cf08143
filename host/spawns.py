"""Child inferlets: the trees of instances that spawned one another, their limits, and the end of
a parent's children.

Every launched instance is the root of a tree (depth 0); a child (children.spawn) joins its
parent's tree one level down and runs with its parent's tenant and InstanceLimits. A spawn is
refused, naming the limit, past the parent's `max_spawn_depth`, past `max_children` children
alive at once, past `max_spawns` spawns by the whole tree (alive or ended), or when the runtime's
`SpawnHooks.admit` refuses it (`pie serve`: the tenant's instance and page quotas). The program
is the parent's own ("") or one `SpawnHooks.resolve` finds for the parent's tenant. A runtime
whose host set no hooks refuses every spawn: an embedding that counts its tenants' instances
elsewhere (a cluster replica) must say how children count before any runs. When an instance
ends, its children that were not spawned
detached are terminated (and theirs, as each ends); detached ones run on, parentless.

`Spawns` owns the trees (one lock); the runtime calls `add_root` for each launch before the
instance starts and `ended` from its end; the bindings reach it as a
`host.sandbox.services.Spawner`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol

from host.errors import SpawnRefused
from host.runtime_config import InstanceLimits
from host.sandbox.events import InstanceEvent
from host.sandbox.programs import Program

__all__ = ["SpawnHooks", "Spawns", "SELF_PROGRAM", "ChildInfo", "TenantSpawns"]

SELF_PROGRAM = ""                 # children.spawn's name for the parent's own program
_MAX_PROGRAM_CHARS = 256
_MAX_ARGS = 1024
_MAX_ARGS_CHARS = 1 << 20
EventCallback = Callable[[InstanceEvent], None]


class LaunchFn(Protocol):
    def __call__(self, program: Program, args: tuple[str, ...], tenant: str,
                 limits: InstanceLimits, on_event: EventCallback,
                 before_start: Callable[[str], None]) -> str: ...


@dataclass(frozen=True)
class SpawnHooks:
    """How the runtime's host finds and admits children.

    resolve: (tenant, program) -> the tenant's Program named `program` (a name or a hash);
             raises LookupError (its message given to the guest) when the tenant has none.
             None: the parent's own program ("") only.
    admit:   (tenant, limits) -> a release callable, called once when the child ends; raises
             any Exception (its message given to the guest) to refuse the child, e.g. past the
             tenant's instance or page quota. None: every child admitted.
    """

    resolve: Callable[[str, str], Program] | None = None
    admit: Callable[[str, InstanceLimits], Callable[[], None]] | None = None


@dataclass(frozen=True)
class ChildInfo:
    """A running child: its id, its parent's (None once a detached child's parent ended), its
    program's hash, its depth (1 for a child of a launched instance), whether it is detached,
    its page quota (its parent's limits')."""

    instance_id: str
    parent_id: str | None
    program_hash: str
    depth: int
    detached: bool
    page_quota: int | None


@dataclass(frozen=True)
class TenantSpawns:
    """One tenant's children: spawned since the runtime started, and alive now."""

    num_spawns: int
    num_live_children: int


@dataclass
class _Tree:
    num_spawns: int = 0            # children spawned by the tree so far (reserved ones too)


@dataclass(eq=False)
class _Node:
    """One running instance's place in its tree."""

    tenant: str
    program: Program
    limits: InstanceLimits
    depth: int
    tree: _Tree
    parent_id: str | None = None
    detached: bool = False
    children: set[str] = field(default_factory=set)     # alive, detached or not
    num_launching: int = 0        # spawns under way (counted against max_children)
    release: Callable[[], None] | None = None


class Spawns:
    """The trees of the runtime's running instances. Thread-safe."""

    def __init__(self, launch: LaunchFn, terminate: Callable[[str, str], bool],
                 deliver: Callable[[str, str], bool]) -> None:
        self._launch = launch
        self._terminate = terminate
        self._deliver = deliver
        self._hooks: SpawnHooks | None = None
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._num_spawns: dict[str, int] = {}        # tenant -> children started, ever

    def set_hooks(self, hooks: SpawnHooks | None) -> None:
        """The resolver and admission of later spawns (None: every spawn refused)."""
        self._hooks = hooks

    # ------------------------------------------------------------- the runtime's side
    def add_root(self, instance_id: str, tenant: str, program: Program,
                 limits: InstanceLimits) -> None:
        """A launched instance, before it starts: the root of a tree of its own."""
        with self._lock:
            self._nodes[instance_id] = _Node(tenant, program, limits, 0, _Tree())

    def ended(self, instance_id: str) -> None:
        """An instance ended: forget it, release its admission, and terminate its children that
        were not spawned detached (each, ending, does the same for its own)."""
        with self._lock:
            node = self._nodes.pop(instance_id, None)
            if node is None:
                return
            parent = self._nodes.get(node.parent_id) if node.parent_id else None
            if parent is not None:
                parent.children.discard(instance_id)
            attached = []
            for child_id in node.children:
                child = self._nodes.get(child_id)
                if child is None:
                    continue
                child.parent_id = None
                if not child.detached:
                    attached.append(child_id)
        if node.release is not None:
            node.release()
        for child_id in attached:
            self._terminate(child_id, f"its parent {instance_id} ended")

    def num_children(self, instance_id: str) -> int:
        """Children of a running instance alive now (0 for an unknown one)."""
        with self._lock:
            node = self._nodes.get(instance_id)
            return 0 if node is None else len(node.children)

    def children(self, tenant: str) -> list[ChildInfo]:
        """The running children of `tenant`'s instances, at every depth."""
        with self._lock:
            return [_info(instance_id, node) for instance_id, node in self._nodes.items()
                    if node.depth > 0 and node.tenant == tenant]

    def child_of(self, tenant: str, instance_id: str) -> ChildInfo | None:
        """The running child `instance_id` of `tenant`'s instances (None: no such child)."""
        with self._lock:
            node = self._nodes.get(instance_id)
            if node is None or node.depth == 0 or node.tenant != tenant:
                return None
            return _info(instance_id, node)

    def stats(self) -> dict[str, TenantSpawns]:
        """Per tenant that ever spawned: children spawned so far and alive now."""
        with self._lock:
            live: dict[str, int] = {}
            for node in self._nodes.values():
                if node.depth > 0:
                    live[node.tenant] = live.get(node.tenant, 0) + 1
            return {tenant: TenantSpawns(num, live.get(tenant, 0))
                    for tenant, num in self._num_spawns.items()}

    # ------------------------------------------------------------- the bindings' side
    def spawn(self, parent_id: str, program: str, args: tuple[str, ...], detached: bool,
              on_event: EventCallback) -> str:
        """host.sandbox.services.Spawner.spawn."""
        _check_request(program, args)
        if self._hooks is None:
            raise SpawnRefused("children.spawn: this host admits no children (its runtime has no "
                               "SpawnHooks)")
        parent = self._reserve(parent_id)
        try:
            child_program = self._resolve(parent, program)
            release = self._admit(parent)
        except BaseException:
            self._unreserve(parent)
            raise
        node = _Node(parent.tenant, child_program, parent.limits, parent.depth + 1, parent.tree,
                     parent_id, detached, release=release)

        def before_start(child_id: str) -> None:
            with self._lock:
                self._nodes[child_id] = node
                parent.children.add(child_id)
                parent.num_launching -= 1
                self._num_spawns[node.tenant] = self._num_spawns.get(node.tenant, 0) + 1
        try:
            return self._launch(child_program, args, parent.tenant, parent.limits, on_event,
                                before_start)
        except Exception as exc:
            self._unreserve(parent)
            if release is not None:
                release()
            raise SpawnRefused(f"children.spawn: launch failed: {exc}") from None

    def send(self, child_id: str, message: str) -> bool:
        """host.sandbox.services.Spawner.send."""
        try:
            return self._deliver(child_id, message)
        except KeyError:
            return False

    def kill(self, child_id: str, reason: str) -> bool:
        """host.sandbox.services.Spawner.kill."""
        try:
            return self._terminate(child_id, reason)
        except KeyError:
            return False

    # ------------------------------------------------------------- internal
    def _reserve(self, parent_id: str) -> _Node:
        """Check the parent's limits and count the spawn (SpawnRefused naming the limit)."""
        with self._lock:
            parent = self._nodes.get(parent_id)
            if parent is None:
                raise SpawnRefused(f"children.spawn: instance {parent_id} is not running")
            limits = parent.limits
            if parent.depth + 1 > limits.max_spawn_depth:
                raise SpawnRefused(
                    f"children.spawn: refused at depth {parent.depth}: a child would be at "
                    f"depth {parent.depth + 1}, past max_spawn_depth {limits.max_spawn_depth}")
            num_alive = len(parent.children) + parent.num_launching
            if num_alive >= limits.max_children:
                raise SpawnRefused(
                    f"children.spawn: refused: {num_alive} children alive, the limit "
                    f"max_children is {limits.max_children}")
            if parent.tree.num_spawns >= limits.max_spawns:
                raise SpawnRefused(
                    f"children.spawn: refused: this tree of instances has spawned "
                    f"{parent.tree.num_spawns} children, the limit max_spawns is "
                    f"{limits.max_spawns}")
            parent.tree.num_spawns += 1
            parent.num_launching += 1
            return parent

    def _unreserve(self, parent: _Node) -> None:
        with self._lock:
            parent.tree.num_spawns -= 1
            parent.num_launching -= 1

    def _resolve(self, parent: _Node, program: str) -> Program:
        if program == SELF_PROGRAM:
            return parent.program
        hooks = self._hooks
        if hooks is None or hooks.resolve is None:
            raise SpawnRefused(f"children.spawn: unknown program {program!r}: this host runs "
                               f"children of an instance's own program only (\"\")")
        try:
            return hooks.resolve(parent.tenant, program)
        except LookupError as exc:
            raise SpawnRefused(f"children.spawn: unknown program {program!r} for tenant "
                               f"{parent.tenant!r}: {_message(exc)}") from None

    def _admit(self, parent: _Node) -> Callable[[], None] | None:
        hooks = self._hooks
        if hooks is None or hooks.admit is None:
            return None
        try:
            return hooks.admit(parent.tenant, parent.limits)
        except Exception as exc:  # noqa: BLE001 -- the host's refusal, named to the guest
            raise SpawnRefused(f"children.spawn: refused: {_message(exc)}") from None


def _info(instance_id: str, node: _Node) -> ChildInfo:
    return ChildInfo(instance_id, node.parent_id, node.program.hash, node.depth, node.detached,
                     node.limits.page_quota)


def _check_request(program: str, args: tuple[str, ...]) -> None:
    if len(program) > _MAX_PROGRAM_CHARS:
        raise SpawnRefused(f"children.spawn: a program name of {len(program)} characters, more "
                           f"than {_MAX_PROGRAM_CHARS}")
    num_chars = sum(map(len, args))
    if len(args) > _MAX_ARGS or num_chars > _MAX_ARGS_CHARS:
        raise SpawnRefused(f"children.spawn: {len(args)} arguments of {num_chars} characters, "
                           f"more than {_MAX_ARGS} arguments or {_MAX_ARGS_CHARS} characters")


def _message(exc: BaseException) -> str:
    """An exception's message (a KeyError's without its quotes)."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
