"""The research agent example on the real model: one child inferlet per sub-question (the same
program in its child mode), each streaming a note to its parent and returning a finding that
the parent merges; every child ends ok and every page returns."""
from __future__ import annotations

import time

import pytest

from host.runtime import SpawnHooks


@pytest.fixture
def own_program_children(runtime):
    """The session's runtime admits children of an instance's own program for this test."""
    runtime.set_spawn_hooks(SpawnHooks())
    yield
    runtime.set_spawn_hooks(None)


def test_research_agent_spawns_a_child_per_sub_question(run_inferlet, runtime,
                                                        own_program_children):
    result = run_inferlet("research_agent", [
        "--question", "Why do cities grow?", "--num-sub-questions", "3", "--plan-tokens", "40",
        "--finding-tokens", "12", "--answer-tokens", "16"]).json()
    subs, children = result["sub_questions"], result["children"]
    assert 1 <= len(subs) <= 3 and len(children) == len(subs) == len(result["findings"])
    assert len(set(children)) == len(children)
    assert [note["researching"] for note in result["notes"]] == subs
    for child_id in children:
        outcome = runtime.wait(child_id, timeout=60)
        assert outcome.status == "ok" and outcome.value.strip()
    assert [runtime.wait(c).value.strip() for c in children] == result["findings"]
    assert result["answer"]
    deadline = time.monotonic() + 30
    while runtime.statistics().pages.num_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runtime.statistics().pages.num_used == 0
