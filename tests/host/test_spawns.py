"""host/spawns.py alone, over a recording launcher: a parent's end terminates its attached
children only, an admission is released once (at the child's end, or when its launch fails),
and refusals name the program or the limit."""
from __future__ import annotations

import itertools

import pytest

from host.errors import SpawnRefused
from host.runtime_config import InstanceLimits
from host.spawns import SpawnHooks, Spawns


class Recorder:
    """Launches by id only; remembers what the Spawns asked."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.ids = (f"i{n}" for n in itertools.count())
        self.launched: list[tuple[str, object, tuple[str, ...]]] = []
        self.terminated: list[tuple[str, str]] = []

    def launch(self, program, args, tenant, limits, on_event, before_start) -> str:
        if self.fail:
            raise RuntimeError("no thread left")
        instance_id = next(self.ids)
        before_start(instance_id)
        self.launched.append((instance_id, program, args))
        return instance_id

    def terminate(self, instance_id: str, reason: str) -> bool:
        self.terminated.append((instance_id, reason))
        return True


def _spawns(recorder: Recorder) -> Spawns:
    spawns = Spawns(recorder.launch, recorder.terminate, lambda instance_id, message: True)
    spawns.add_root("root", "alice", "root-program", InstanceLimits(max_children=3))
    spawns.set_hooks(SpawnHooks())
    return spawns


def test_a_parents_end_terminates_its_attached_children_only() -> None:
    recorder = Recorder()
    spawns = _spawns(recorder)
    attached = spawns.spawn("root", "", ("a",), False, lambda event: None)
    detached = spawns.spawn("root", "", ("b",), True, lambda event: None)
    grandchild = spawns.spawn(attached, "", ("c",), False, lambda event: None)
    assert [program for _, program, _ in recorder.launched] == ["root-program"] * 3
    assert spawns.num_children("root") == 2
    spawns.ended("root")
    assert recorder.terminated == [(attached, "its parent root ended")]
    spawns.ended(attached)
    assert recorder.terminated[-1] == (grandchild, f"its parent {attached} ended")
    assert spawns.num_children(detached) == 0 and detached not in dict(recorder.terminated)


def _admitting(spawns: Spawns, released: list[str]) -> None:
    spawns.set_hooks(SpawnHooks(resolve=lambda tenant, name: "other-program",
                                admit=lambda tenant, limits: lambda: released.append(tenant)))


def test_an_admission_is_released_once_at_the_childs_end() -> None:
    recorder, released = Recorder(), []
    spawns = _spawns(recorder)
    _admitting(spawns, released)
    child = spawns.spawn("root", "helper", (), False, lambda event: None)
    assert released == [] and recorder.launched[0][1] == "other-program"
    spawns.ended(child)
    spawns.ended(child)
    assert released == ["alice"]


def test_a_failed_launch_gives_back_its_admission_and_its_slots() -> None:
    recorder, released = Recorder(fail=True), []
    spawns = _spawns(recorder)
    _admitting(spawns, released)
    for _ in range(5):
        with pytest.raises(SpawnRefused, match="launch failed: no thread left"):
            spawns.spawn("root", "helper", (), False, lambda event: None)
    assert released == ["alice"] * 5 and spawns.num_children("root") == 0
    recorder.fail = False
    for _ in range(3):                                  # max_children 3: every slot is free
        spawns.spawn("root", "helper", (), False, lambda event: None)


def test_refusals_name_the_limit_or_the_program() -> None:
    recorder = Recorder()
    spawns = _spawns(recorder)
    with pytest.raises(SpawnRefused, match="unknown program 'helper'"):
        spawns.spawn("root", "helper", (), False, lambda event: None)
    for _ in range(3):
        spawns.spawn("root", "", (), False, lambda event: None)
    with pytest.raises(SpawnRefused, match="3 children alive, the limit max_children is 3"):
        spawns.spawn("root", "", (), False, lambda event: None)
    with pytest.raises(SpawnRefused, match="instance gone is not running"):
        spawns.spawn("gone", "", (), False, lambda event: None)
    with pytest.raises(SpawnRefused, match="2000 arguments"):
        spawns.spawn("root", "", ("x",) * 2000, False, lambda event: None)
    spawns.set_hooks(None)
    with pytest.raises(SpawnRefused, match="this host admits no children"):
        spawns.spawn("root", "", (), False, lambda event: None)


def test_pie_run_resolves_its_own_program_by_name_or_hash_only() -> None:
    from types import SimpleNamespace

    from host.cli import _own_program_hooks
    program = SimpleNamespace(hash="f" * 64)
    hooks = _own_program_hooks(program, "research_agent")
    assert hooks.resolve("default", "research_agent") is program
    assert hooks.resolve("default", "f" * 64) is program
    with pytest.raises(LookupError, match="runs one program: 'research_agent'"):
        hooks.resolve("default", "other_app")


def test_children_are_listed_per_tenant_with_their_parents_and_counted() -> None:
    from types import SimpleNamespace
    recorder = Recorder()
    spawns = Spawns(recorder.launch, recorder.terminate, lambda instance_id, message: True)
    program = SimpleNamespace(hash="ab" * 32)
    spawns.add_root("root", "alice", program, InstanceLimits(page_quota=7))
    spawns.add_root("other", "bob", program, InstanceLimits())
    spawns.set_hooks(SpawnHooks())
    attached = spawns.spawn("root", "", (), False, lambda event: None)
    detached = spawns.spawn("root", "", (), True, lambda event: None)
    grandchild = spawns.spawn(attached, "", (), False, lambda event: None)
    listed = {c.instance_id: c for c in spawns.children("alice")}
    assert set(listed) == {attached, detached, grandchild} and spawns.children("bob") == []
    assert (listed[attached].parent_id, listed[attached].depth) == ("root", 1)
    assert (listed[grandchild].parent_id, listed[grandchild].depth) == (attached, 2)
    assert listed[detached].detached and listed[detached].page_quota == 7
    assert listed[attached].program_hash == "ab" * 32
    assert spawns.child_of("bob", attached) is None and spawns.child_of("alice", "root") is None
    assert spawns.stats()["alice"].num_spawns == 3
    assert spawns.stats()["alice"].num_live_children == 3
    spawns.ended("root")                       # the detached child runs on, parentless
    assert spawns.child_of("alice", detached).parent_id is None
    for child_id in (attached, grandchild):
        spawns.ended(child_id)
    assert spawns.stats()["alice"].num_live_children == 1 and "bob" not in spawns.stats()
