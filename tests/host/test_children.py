"""Child inferlets (WIT `children`, host/spawns.py) with a real Python guest on the fake engine:
a parent talks to its children, the limits stop a flood of spawns and a fork bomb with errors
naming them, a parent's end ends its children (not the detached one) and every page returns, a
killed child's pages return, a child that floods an unread parent is ended naming the limit, and
another tenant's program is refused. Others running alongside are not affected."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from host import InstanceLimits, Runtime, RuntimeConfig
from host.errors import LimitError
from host.sandbox.programs.build import build_cached
from host.spawns import SpawnHooks
from tests.host.fake_engine import FakeEngine

REPO_DIR = Path(__file__).resolve().parents[2]
BUILD_CACHE = REPO_DIR / ".cache" / "test-inferlets"
PROGRAM_CACHE = REPO_DIR / ".cache" / "pie-test"
LIMITS = InstanceLimits(max_idle_s=10.0)


@pytest.fixture(scope="module")
def runtime():
    with Runtime(FakeEngine(num_pages=256, page_size=16),
                 RuntimeConfig(cache_dir=PROGRAM_CACHE, limits=LIMITS)) as rt:
        yield rt


@pytest.fixture(scope="module")
def program(runtime):
    wasm_path, _ = build_cached(REPO_DIR / "tests" / "host" / "apps" / "spawner.py", BUILD_CACHE)
    return runtime.load_program(wasm_path.read_bytes())


@pytest.fixture(autouse=True)
def own_program_hooks(runtime):
    """Children of an instance's own program, the spawn limits alone (a test may set others)."""
    runtime.set_spawn_hooks(SpawnHooks())
    yield
    _wait_idle(runtime)


def _run(runtime, program, args, **launch):
    outcome = runtime.wait(runtime.launch(program, args, **launch), timeout=120)
    return outcome.status, outcome.value


def _wait_idle(runtime, timeout: float = 30.0) -> None:
    """Until no instance runs and no page is held (children end after their parent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = runtime.statistics()
        if stats.num_running == 0 and stats.pages.num_used == 0:
            return
        time.sleep(0.02)
    stats = runtime.statistics()
    raise AssertionError(f"still {stats.num_running} running, {stats.pages.num_used} pages")


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_parent_talks_to_its_children_and_takes_their_results(runtime, program) -> None:
    status, value = _run(runtime, program, ["fan", "alpha", "beta", "gamma"])
    assert status == "ok", value
    assert json.loads(value) == [["ALPHA", "done alpha", None], ["BETA", "done beta", None],
                                 ["GAMMA", "done gamma", None]]


def test_ten_thousand_spawns_stop_at_the_fan_out_limit(runtime, program) -> None:
    status, value = _run(runtime, program, ["flood", "10000", "0"])
    assert status == "ok", value
    report = json.loads(value)
    assert report["spawned"] == LIMITS.max_children
    assert "max_children is 16" in report["refused"]


def test_ten_thousand_spawns_stop_at_the_spawn_limit(runtime, program) -> None:
    limits = InstanceLimits(max_idle_s=10.0, max_spawns=40)
    status, value = _run(runtime, program, ["flood", "10000", "1"], limits=limits)
    assert status == "ok", value
    report = json.loads(value)
    assert report["spawned"] == 40
    assert "max_spawns is 40" in report["refused"]


def test_a_fork_bomb_is_stopped_by_depth_and_spawn_limits(runtime, program) -> None:
    limits = InstanceLimits(max_idle_s=10.0, max_spawn_depth=2, max_children=3, max_spawns=10)
    bystander = runtime.launch(program, ["fan", "calm"])
    status, value = _run(runtime, program, ["bomb"], limits=limits)
    assert status == "ok", value
    report = json.loads(value)
    assert report["instances"] == 11                       # the root and its 10 spawns
    refusals = "\n".join(report["refusals"])
    assert "past max_spawn_depth 2" in refusals or "max_spawns is 10" in refusals
    assert all("max_" in refusal for refusal in report["refusals"])
    outcome = runtime.wait(bystander, timeout=60)
    assert outcome.status == "ok" and json.loads(outcome.value)[0][0] == "CALM"
    _wait_idle(runtime)


def test_a_fork_bomb_is_stopped_by_the_tenant_instance_quota(runtime, program) -> None:
    """SpawnHooks.admit as `pie serve` sets it: at most 4 instances of the tenant at once."""
    running = {"bomber": 1}
    lock = threading.Lock()

    def admit(tenant, limits):
        with lock:
            if running[tenant] >= 4:
                raise LimitError(f"tenant {tenant!r}: instance quota reached ({running[tenant]}"
                                 f" running, of max_instances 4)")
            running[tenant] += 1

        def release() -> None:
            with lock:
                running[tenant] -= 1
        return release
    runtime.set_spawn_hooks(SpawnHooks(resolve=_no_program, admit=admit))
    status, value = _run(runtime, program, ["bomb"], tenant="bomber")
    assert status == "ok", value
    report = json.loads(value)
    assert report["instances"] >= 4         # children that ended made room for later ones
    assert any("max_instances 4" in refusal for refusal in report["refusals"])
    _wait_idle(runtime)
    assert running["bomber"] == 1                          # every child's admission released


def test_a_parents_end_ends_its_children_but_not_a_detached_one(runtime, program) -> None:
    messages: list[str] = []
    got = threading.Event()

    def on_event(event) -> None:
        if event.kind == "message":
            messages.append(event.data)
            got.set()
    parent = runtime.launch(program, ["parent_hold", "3", "2", "1"], on_event=on_event)
    assert got.wait(60)
    detached, *attached = json.loads(messages[0])
    assert runtime.statistics().pages.num_used == 6
    try:
        assert runtime.terminate(parent, "test ends the parent")
        assert runtime.wait(parent, timeout=60).status == "terminated"
        for child in attached:
            outcome = runtime.wait(child, timeout=60)
            assert outcome.status == "terminated"
            assert outcome.value == f"its parent {parent} ended"
        _wait_for(lambda: runtime.statistics().pages.num_used == 2)   # the detached child's
        _wait_for(lambda: runtime.statistics().num_running == 1)      # the parent counted out
        with pytest.raises(TimeoutError):                               # the detached one runs
            runtime.wait(detached, timeout=0.1)
    finally:
        runtime.terminate(detached)
    _wait_idle(runtime)


def test_a_killed_childs_pages_return(runtime, program) -> None:
    status, value = _run(runtime, program, ["kill", "5"])
    assert status == "ok", value
    first, second, result, after = json.loads(value)
    assert (first, second, after) == (True, False, None)
    assert result.startswith("ChildError: child ") and "terminated: killed by its parent" in result
    _wait_idle(runtime)


def test_a_child_flooding_a_parent_that_does_not_read_is_ended(runtime, program) -> None:
    status, value = _run(runtime, program, ["deaf"])
    assert status == "ok", value
    assert value.startswith("ChildError: ") and "its parent is not reading" in value
    assert "client_max_chars" in value


def test_programs_resolve_within_the_tenant_only(runtime, program) -> None:
    owned = {("alice", program.hash): program, ("alice", "helper"): program}

    def resolve(tenant, name):
        if (tenant, name) not in owned:
            raise LookupError(f"tenant {tenant!r} has no program {name!r}")
        return owned[(tenant, name)]
    runtime.set_spawn_hooks(SpawnHooks(resolve=resolve))
    assert _run(runtime, program, ["other", program.hash, "x"], tenant="alice") \
        == ("ok", "result: quick x")
    assert _run(runtime, program, ["other", "helper"], tenant="alice") == ("ok", "result: quick ")
    status, value = _run(runtime, program, ["other", program.hash], tenant="mallory")
    assert status == "ok" and value.startswith("refused: children.spawn: unknown program")
    assert "'mallory' has no program" in value


def test_without_a_resolver_only_the_own_program_spawns(runtime, program) -> None:
    status, value = _run(runtime, program, ["other", program.hash])
    assert status == "ok" and value.startswith("refused: children.spawn: unknown program")
    assert "own program only" in value


def test_a_runtime_without_hooks_admits_no_children(runtime, program) -> None:
    runtime.set_spawn_hooks(None)
    status, value = _run(runtime, program, ["flood", "10", "0"])
    assert status == "ok", value
    report = json.loads(value)
    assert report["spawned"] == 0 and "admits no children" in report["refused"]


def _no_program(tenant: str, name: str):
    raise LookupError("no programs by name here")


def test_messages_to_a_parent_that_has_gone_are_dropped_not_counted() -> None:
    """A detached child outlives its parent's table: what it sends then is dropped, and it is
    not ended for a parent "not reading"."""
    from host.bindings.children import ChildEntry, ChildTable
    from host.sandbox.events import InstanceEvent
    killed: list[str] = []
    table, entry = ChildTable(), ChildEntry(max_chars=10)
    entry.bind("c1", killed.append)
    rep = table.add("children.spawn", entry)
    entry.on_event(InstanceEvent("c1", "message", "x" * 8))
    entry.on_event(InstanceEvent("c1", "message", "y" * 8))      # past max_chars: ended
    assert len(killed) == 1 and "client_max_chars (10)" in killed[0]
    assert table.get("child.receive", rep).take() == "x" * 8
    table.clear()
    for _ in range(5):
        entry.on_event(InstanceEvent("c1", "message", "z" * 8))
    assert entry.take() is None and len(killed) == 1
