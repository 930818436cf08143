"""Instances instantiated ahead of their launch (Runtime.keep_spares): a launch that takes one
runs as itself, with its own id, limits, log and end; spares are made again only while nothing
runs; a program whose instantiation calls the host gets none; close drops them all."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from host import InstanceLimits, RuntimeConfig
from host.sandbox.programs.build import build_cached
from host.sandbox.image_files import image_span
from host.sandbox.spare_instances import SpareInstances
from tests.host.components import _run, _wasm_tools
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.host.test_children import BUILD_CACHE, REPO_DIR
from tests.host.test_image_files import private_kb

# A component whose core module's start function calls the host (kv.create-sequence, lowered
# straight into it: no memory needed) during instantiation; its `run` returns ok("ran").
START_CALL = """
(component
  (import "pie:inferlet/kv@0.1.0" (instance $kv (export "create-sequence" (func (result u32)))))
  (core func $create (canon lower (func $kv "create-sequence")))
  (core module $m
    (import "host" "create" (func $create (result i32)))
    (memory (export "memory") 1)
    (global $sequence (mut i32) (i32.const -1))
    (data (i32.const 16) "ran")
    (func $init (global.set $sequence (call $create)))
    (start $init)
    (func (export "run") (result i32)
      (i32.store (i32.const 0) (i32.const 0))
      (i32.store (i32.const 4) (i32.const 16))
      (i32.store (i32.const 8) (i32.const 3))
      (i32.const 0)))
  (core instance $i (instantiate $m (with "host" (instance (export "create" (func $create))))))
  (func (export "run") (result (result string (error string)))
    (canon lift (core func $i "run") (memory (core memory $i "memory")))))
"""


def ready_runtime(make_runtime, components, guest, num_spares,  # noqa: F811
                  **config) -> tuple:
    """A runtime with `num_spares` spares of `guest` made; (runtime, program)."""
    runtime = make_runtime(FakeEngine(), **config)
    program = runtime.load_program(components.component(guest))
    runtime.keep_spares(program, num_spares)
    assert runtime.wait_spares(10)
    return runtime, program


def test_a_launch_takes_a_spare_and_runs_as_itself(components, make_runtime):  # noqa: F811
    runtime, program = ready_runtime(make_runtime, components, "info", 2)
    assert runtime.spares.num_ready == 2
    instance_id = runtime.launch(program, tenant="alice")
    assert runtime.spares.num_ready == 1                    # taken, not yet made again
    outcome = runtime.wait(instance_id, timeout=10)
    assert (outcome.status, outcome.value) == ("ok", instance_id)
    assert any(line.endswith("pie 0.1.0") or "pie " in line
               for line in runtime.instance_log(instance_id))
    assert runtime.wait_spares(10)
    assert runtime.spares.num_ready == 2                    # made again once nothing ran


def test_spares_are_made_again_only_while_nothing_runs(components, make_runtime):  # noqa: F811
    runtime, program = ready_runtime(make_runtime, components, "echo", 1)
    first = runtime.launch(program)                         # takes the spare, then waits
    assert runtime.send(first, "ping")
    assert runtime.wait_spares(10) and runtime.spares.num_ready == 0
    second = runtime.launch(program)                        # none ready: instantiates now
    assert runtime.send(second, "") and runtime.wait(second, timeout=10).value == "bye"
    time.sleep(0.1)
    assert runtime.spares.num_ready == 0                    # `first` still runs
    assert runtime.send(first, "") and runtime.wait(first, timeout=10).value == "bye"
    assert runtime.wait_spares(10)
    assert runtime.spares.num_ready == 1


def test_a_launch_with_other_limits_instantiates_as_before(components, make_runtime):  # noqa: F811
    runtime, program = ready_runtime(make_runtime, components, "info", 1)
    instance_id = runtime.launch(program, limits=InstanceLimits(max_idle_s=2.0))
    assert runtime.spares.num_ready == 1
    assert runtime.wait(instance_id, timeout=10).value == instance_id


def test_a_launch_with_another_page_quota_takes_a_spare(components, make_runtime):  # noqa: F811
    """The spare's pages are its launch's: page_quota is read at the launch, not before."""
    runtime, program = ready_runtime(make_runtime, components, "generate", 1)
    instance_id = runtime.launch(program, ("hi",),
                                 limits=InstanceLimits(max_idle_s=5.0, page_quota=0))
    assert runtime.spares.num_ready == 0
    outcome = runtime.wait(instance_id, timeout=10)
    assert (outcome.status, outcome.value) == (
        "trap", "kv.allocate-pages: 2 pages asked, quota 0 (holding 0)")


def test_a_spare_traps_with_the_limits_of_a_launch_made_cold(components,  # noqa: F811
                                                             make_runtime):
    """The same hostile guest ends the same way whether its launch took a spare or not."""
    outcomes = []
    for num_spares in (0, 1):
        runtime, program = ready_runtime(make_runtime, components, "memory_bomb", num_spares,
                                         limits=InstanceLimits(memory_mb=8),
                                         count_linear_memory=True)
        assert runtime.spares.num_ready == num_spares
        outcome = runtime.wait(runtime.launch(program), timeout=10)
        outcomes.append((outcome.status, outcome.value))
    assert outcomes[0] == outcomes[1] == ("trap", "memory limit 8 MiB reached")


def test_terminated_right_after_its_launch_a_spare_returns_everything(components,  # noqa: F811
                                                                      make_runtime):
    runtime, program = ready_runtime(make_runtime, components, "echo", 1)
    events = []
    instance_id = runtime.launch(program, on_event=events.append)
    assert runtime.terminate(instance_id, "client went away")
    outcome = runtime.wait(instance_id, timeout=5)
    assert (outcome.status, outcome.value) == ("terminated", "client went away")
    assert [(e.kind, e.data) for e in events] == [("terminated", "client went away")]
    assert runtime.statistics().num_running == 0
    assert runtime.page_allocator.num_free() == runtime.page_allocator.num_pages


def test_a_program_calling_the_host_while_instantiating_gets_no_spares(  # noqa: F811
        components, make_runtime, caplog):
    runtime = make_runtime(FakeEngine())
    program = runtime.load_program(_run([_wasm_tools(), "parse", "-", "-o", "/dev/stdout"],
                                        START_CALL.encode()))
    runtime.keep_spares(program, 2)
    assert runtime.wait_spares(10)
    assert runtime.spares.num_ready == 0
    assert "kv.create-sequence: called while instantiating ahead of a launch" in caplog.text
    instance_id = runtime.launch(program)                  # made now: its call answered
    outcome = runtime.wait(instance_id, timeout=10)
    assert (outcome.status, outcome.value) == ("ok", "ran")
    assert runtime.wait_spares(10) and runtime.spares.num_ready == 0   # none tried again


def test_close_drops_every_spare_and_its_memory(components, make_runtime):  # noqa: F811
    runtime, program = ready_runtime(make_runtime, components, "info", 3,
                                     count_linear_memory=True)
    assert runtime.spares.num_ready == 3
    assert runtime.linear_memories.num_memories == 3
    runtime.close()
    assert runtime.linear_memories.num_memories == 0
    assert runtime.spares.num_ready == 0


def test_spares_are_bounded(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine(), max_spare_instances=4)
    first = runtime.load_program(components.component("info"))
    second = runtime.load_program(components.component("echo"))
    runtime.keep_spares(first, 3)
    with pytest.raises(ValueError, match="max_spare_instances"):
        runtime.keep_spares(second, 2)
    runtime.keep_spares(second, 1)
    with pytest.raises(ValueError, match="num_spares"):
        runtime.keep_spares(second, -1)
    runtime.keep_spares(first, 1)                           # fewer: the rest dropped
    assert runtime.wait_spares(10)
    assert runtime.spares.num_ready == 2


def test_a_tenants_spares_serve_only_its_launches(components, make_runtime):  # noqa: F811
    """Spares kept for owner alice serve only alice's launches; the runtime's own (owner "")
    serve anyone's; dropping alice's (0 of them) leaves the runtime's."""
    runtime = make_runtime(FakeEngine())
    program = runtime.load_program(components.component("echo"))
    runtime.keep_spares(program, 2, owner="alice")
    runtime.keep_spares(program, 1)
    assert runtime.wait_spares(10) and runtime.spares.num_ready == 3
    running = []
    for tenant, num_left in (("bob", 2), ("bob", 2), ("alice", 1), ("alice", 0), ("alice", 0)):
        running.append(runtime.launch(program, tenant=tenant))    # each waits for input
        assert runtime.spares.num_ready == num_left
    for instance_id in running:
        assert runtime.send(instance_id, "") and runtime.wait(instance_id, 10).value == "bye"
    assert runtime.wait_spares(10) and runtime.spares.num_ready == 3
    runtime.keep_spares(program, 0, owner="alice")
    assert runtime.spares.num_ready == 1


@pytest.mark.parametrize("value", [-1, 4097, "4"])
def test_max_spare_instances_is_checked(value) -> None:
    with pytest.raises(ValueError, match="max_spare_instances must be an int in 0..4096"):
        RuntimeConfig(max_spare_instances=value)


def test_no_spare_is_made_once_a_launch_has_come() -> None:
    """The pool alone (no Wasm): `fill` while idle, but a launch comes within the fill delay:
    nothing is made, and nothing is left counted as being made."""
    made, idle = [], [True]

    def run_after_a_launch(target, name) -> None:
        idle[0] = False                                     # a launch came within the delay
        target()

    spares = SpareInstances(lambda program, limits, handover: made.append(program),
                            max_spares=4, run=run_after_a_launch, is_idle=lambda: idle[0])
    spares.keep(SimpleNamespace(hash="p"), 2, InstanceLimits())
    spares.fill()
    assert spares.wait_filled(1)
    assert made == [] and spares.num_ready == 0


def test_a_spare_made_after_a_run_finds_its_memory_warmed(components,  # noqa: F811
                                                          make_runtime):
    """The pages the last ended instance of the program wrote are the spare's own before its
    launch (LinearMemories.warm), not faulted in by its guest."""
    runtime = make_runtime(FakeEngine(), count_linear_memory=True, memory_pool_mb=0)
    wasm_path, _ = build_cached(REPO_DIR / "tests" / "host" / "apps" / "spawner.py",
                                BUILD_CACHE)                  # a componentize-py guest
    program = runtime.load_program(wasm_path.read_bytes())
    assert program.memory_image is not None
    assert runtime.wait(runtime.launch(program, ["quick"]), timeout=60).status == "ok"
    written = runtime.linear_memories._images.last_written(program.memory_image)
    assert written                                       # noted as its memory ended
    runtime.keep_spares(program, 1)
    assert runtime.wait_spares(10) and runtime.spares.num_ready == 1
    (memory,) = runtime.linear_memories._memories.values()
    assert private_kb(memory.base) == 4 * sum(
        count for first, count in written if first * 4096 < image_span(program.memory_image))
