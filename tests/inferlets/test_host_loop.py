"""Generations on host decode loops (forward.submit-decode) on the real model: the same tokens as
step by step and as the engine's greedy loop, over many pages the host adds, a context read
part-way and then continued, and a generation that just fits the instance's page quota."""
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


@pytest.mark.parametrize("how", ["loop", "step"])
def test_a_generation_that_fits_the_quota_runs_and_one_that_does_not_traps(
        run_inferlet, runtime, engine, greedy_oracle, how):
    from host.runtime_config import InstanceLimits
    prompt = "The three primary colours are"
    num_prompt_tokens = len(engine.tokenizer.encode(prompt))
    num_tokens = 3 * engine.page_size - num_prompt_tokens + 1    # the KV fills 3 pages exactly
    expected = greedy_oracle([engine.tokenizer.encode(prompt)], num_tokens)[0]
    fits = run_inferlet("probe", ["quota", prompt, str(num_tokens), how],
                        limits=InstanceLimits(page_quota=3))
    assert fits.status == "ok", fits.value
    assert json.loads(fits.value) == expected
    over = run_inferlet("probe", ["quota", prompt, str(num_tokens + 1), how],
                        limits=InstanceLimits(page_quota=3))
    assert over.status == "trap" and "quota 3" in over.value
    assert runtime.statistics().pages.num_used == 0
