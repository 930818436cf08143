"""Generations on host decode loops (forward.submit-decode) on the real model: the same tokens as
step by step and as the engine's greedy loop, across several loops (a loop grows by at most
MAX_SPARE_PAGES pages), and a context read part-way and then continued."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("num_tokens, num_first", [(7, 3), (150, 40)])
def test_host_loops_equal_steps_and_greedy(run_inferlet, runtime, engine, greedy_oracle,
                                           num_tokens, num_first):
    prompt = "The three primary colours are"
    expected = greedy_oracle([engine.tokenizer.encode(prompt)], num_tokens)[0]
    run = run_inferlet("probe", ["loops", prompt, str(num_tokens), str(num_first)])
    assert run.status == "ok", run.value
    step_by_step, on_loops, resumed, then_stepped, in_two = json.loads(run.value)
    assert step_by_step == expected
    assert on_loops == expected
    assert resumed == expected          # read part-way, the context settled, then continued
    assert then_stepped == expected     # the same Generation, stepped after a partial read
    assert in_two == expected
    assert runtime.statistics().pages.num_used == 0
