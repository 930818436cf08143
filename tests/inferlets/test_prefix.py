"""inferlet.prefix_context: a prompt's leading page shared through a persistent export named by its
tokens' hash. Computed, imported, or beside a bogus export of that name (other tokens, which it
must refuse), the continuation equals the engine's greedy loop, and it leaves no page behind."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_prefix_context_refuses_other_tokens_and_equals_greedy(run_inferlet, runtime, engine,
                                                               greedy_oracle) -> None:
    num_tokens = 6
    prompt = ("Once upon a time there was a small village by the sea where everyone knew the "
              "name of every boat")
    prompt_ids = engine.tokenizer.encode(prompt)
    assert len(prompt_ids) > engine.page_size
    expected = greedy_oracle([prompt_ids], num_tokens)[0]
    run = run_inferlet("probe", ["prefix", prompt, str(num_tokens)])
    assert run.status == "ok", run.value
    result = json.loads(run.value)
    assert result["runs"] == [expected] * 4
    assert result["kept"] and result["left"] == []     # the third run exported, persistent
    assert runtime.statistics().pages.num_used == 0
