"""Hostile guests: each one ends with its own clear cause while 8 well-behaved instances running
at the same time finish with exactly the results they give alone, and the page pool returns to
where it started."""
from __future__ import annotations

import pytest

from host import InstanceLimits, ProgramError
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine

LIMITS = InstanceLimits(memory_mb=8, max_idle_s=0.5, page_quota=8)
PROMPTS = [f"prompt {i}" for i in range(8)]

# guest, expected status, phrases its outcome value must contain
RUNTIME_HOSTILE = [
    ("spin", "trap", ["no host call for 0.5 s"]),
    ("memory_bomb", "trap", ["memory limit 8 MiB reached"]),
    ("forged_page", "trap", ["kv.free-pages", "12345"]),
    ("double_free", "trap", ["kv.free-pages", "page id 0", "freed"]),
    ("hoard", "trap", ["kv.allocate-pages", "quota 8"]),
    ("leak", "ok", ["leaked"]),
    ("bad_handle", "trap", ["invalid resource handle", "77"]),
    ("bad_token", "trap", ["forward.submit", "token id 2147483647 outside the vocabulary"]),
    ("bad_sampler", "trap", ["forward.submit", "sampler 0", "temperature", "nan"]),
    ("long_pass", "trap", ["forward.submit", "8189 KV slots", "context length 4096"]),
]
# bytes that never become a program: builder, expected phrases of the ProgramError
LOAD_HOSTILE = [
    ("malformed", lambda b: b"\x00asm\x0d\x00\x01\x00garbage", ["not a valid component"]),
    ("not_wasm", lambda b: b"#!/bin/sh\nrm -rf /\n", ["not a WebAssembly binary"]),
    ("core_module", lambda b: b.core_module("generate"), ["core WebAssembly module"]),
    ("wrong_world_no_run", lambda b: b.component("no_run"), ["no export `run`"]),
    ("wrong_world_run_type", lambda b: b.component("run_string"),
     ["`run` must be `func() -> result<string, string>`"]),
    ("wrong_world_foreign_import", lambda b: b.component("foreign"),
     ["pie:test/gadget@0.1.0", "does not provide"]),
]


def fresh_engine() -> FakeEngine:
    return FakeEngine(num_pages=128, page_size=4)


@pytest.fixture(scope="module")
def solo_results(components, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    """What each well-behaved instance returns when it runs alone."""
    from host import Runtime, RuntimeConfig

    config = RuntimeConfig(cache_dir=tmp_path_factory.mktemp("solo"), limits=LIMITS)
    results = {}
    with Runtime(fresh_engine(), config) as runtime:
        program = runtime.load_program(components.component("generate"))
        for prompt in PROMPTS:
            outcome = runtime.wait(runtime.launch(program, [prompt]), timeout=30)
            assert outcome.status == "ok", outcome
            results[prompt] = outcome.value
    assert len(set(results.values())) == len(PROMPTS)   # distinct: a mix-up would show
    return results


def launch_well_behaved(runtime, components) -> dict[str, str]:  # noqa: F811
    program = runtime.load_program(components.component("generate"))
    return {prompt: runtime.launch(program, [prompt]) for prompt in PROMPTS}


def assert_well_behaved_unharmed(runtime, instance_ids: dict[str, str], solo: dict[str, str]):
    for prompt, instance_id in instance_ids.items():
        outcome = runtime.wait(instance_id, timeout=30)
        assert (outcome.status, outcome.value) == ("ok", solo[prompt]), prompt


@pytest.mark.parametrize("guest,status,phrases", RUNTIME_HOSTILE,
                         ids=[case[0] for case in RUNTIME_HOSTILE])
def test_hostile_guest_traps_alone(guest, status, phrases, components, make_runtime,  # noqa: F811
                                   solo_results):
    runtime = make_runtime(fresh_engine(), LIMITS)
    num_free_at_start = runtime.statistics().pages.num_free
    hostile_program = runtime.load_program(components.component(guest))
    events = []
    hostile_id = runtime.launch(hostile_program, on_event=events.append)
    well_behaved = launch_well_behaved(runtime, components)

    outcome = runtime.wait(hostile_id, timeout=30)
    assert outcome.status == status, outcome
    for phrase in phrases:
        assert phrase in outcome.value, (phrase, outcome.value)
    assert [(e.kind, e.data) for e in events] == [(outcome.event_kind, outcome.value)]
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)

    stats = runtime.statistics()
    assert stats.pages.num_free == num_free_at_start
    assert stats.pages.num_shared == 0
    assert runtime.exports.names("default") == []      # non-persistent exports dropped
    assert stats.num_running == 0


@pytest.mark.parametrize("name,make_bytes,phrases", LOAD_HOSTILE,
                         ids=[case[0] for case in LOAD_HOSTILE])
def test_bad_bytes_are_refused_with_reason(name, make_bytes, phrases, components,  # noqa: F811
                                           make_runtime, solo_results):
    runtime = make_runtime(fresh_engine(), LIMITS)
    num_free_at_start = runtime.statistics().pages.num_free
    well_behaved = launch_well_behaved(runtime, components)

    with pytest.raises(ProgramError) as refused:
        runtime.load_program(make_bytes(components))
    for phrase in phrases:
        assert phrase in str(refused.value), (phrase, str(refused.value))

    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert runtime.statistics().pages.num_free == num_free_at_start
    assert runtime.statistics().programs.num_programs == 1   # nothing cached for the bad bytes


def test_many_hostile_at_once_each_gets_its_own_cause(components, make_runtime,  # noqa: F811
                                                       solo_results):
    """Traps recorded per instance: 3 of each hostile kind at once, plus the 8 good ones."""
    runtime = make_runtime(fresh_engine(), LIMITS)
    num_free_at_start = runtime.statistics().pages.num_free
    hostile_ids = {}
    for guest, status, phrases in RUNTIME_HOSTILE:
        program = runtime.load_program(components.component(guest))
        for copy in range(3):
            hostile_ids[runtime.launch(program)] = (guest, status, phrases)
    well_behaved = launch_well_behaved(runtime, components)

    for instance_id, (guest, status, phrases) in hostile_ids.items():
        outcome = runtime.wait(instance_id, timeout=30)
        assert outcome.status == status, (guest, outcome)
        assert all(phrase in outcome.value for phrase in phrases), (guest, outcome)
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert runtime.statistics().pages.num_free == num_free_at_start
