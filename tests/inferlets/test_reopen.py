"""Generating from a context whose tokens are all computed (a fresh fork, the exporter, an import):
the SDK recomputes the last token, so the continuation equals the engine's greedy loop."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


# 16 and 17 prompt tokens (page size 16): the last page is full (the import's is read-only) /
# holds one token (reopening it empties the page).
@pytest.mark.parametrize("num_prompt_tokens", [5, 16, 17])
def test_generate_after_fork_export_and_import_equals_greedy(run_inferlet, runtime, engine,
                                                            greedy_oracle, num_prompt_tokens):
    num_tokens = 6
    prompt = "Once upon a time" + " there" * (num_prompt_tokens - 4)
    prompt_ids = engine.tokenizer.encode(prompt)
    assert len(prompt_ids) == num_prompt_tokens and engine.page_size == 16
    expected = greedy_oracle([prompt_ids], num_tokens)[0]
    run = run_inferlet("probe", ["forks", prompt, str(num_tokens)])
    assert run.status == "ok", run.value
    assert json.loads(run.value) == [expected] * 4
    assert runtime.statistics().pages.num_used == 0
