"""Structured output, log-probabilities, penalties, probes and speculative decoding through the
SDK and the real host on the real model (the examples json_extractor, best_of_n, speculative and
the test app structured_probe)."""
from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = pytest.mark.slow


def test_json_extractor_output_parses_and_validates_for_every_seed(run_inferlet) -> None:
    for seed in range(3):
        result = run_inferlet("json_extractor", ["--seed", str(seed)])
        assert result.status == "ok", result.value
        value = json.loads(result.value)
        assert set(value) == {"name", "age", "city"}
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
        assert isinstance(value["name"], str) and isinstance(value["city"], str)


def test_json_extractor_says_when_max_tokens_cut_the_json_off(run_inferlet) -> None:
    """Constrained output parses only once complete: cut off by --max-tokens it ends with
    finish_reason "length", and the example fails saying so rather than return broken JSON."""
    result = run_inferlet("json_extractor", ["--max-tokens", "4"])
    assert result.status == "error", result
    assert "cut off at --max-tokens 4 before the JSON was complete" in result.value


def test_regex_and_lark_outputs_match(run_inferlet) -> None:
    pattern = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    for seed in range(3):
        text = run_inferlet("structured_probe", ["regex", pattern, str(seed)]).json()["text"]
        assert re.fullmatch(pattern, text), text
    lark = 'start: "Answer: " ("yes" | "no")'
    assert run_inferlet("structured_probe", ["lark", lark]).json()["text"] in (
        "Answer: yes", "Answer: no")


def test_a_bad_grammar_is_an_err_naming_the_problem(run_inferlet) -> None:
    err = run_inferlet("structured_probe", ["bad_grammar"]).json()["err"]
    assert err and "nowhere" in err


@pytest.mark.parametrize("which, cause", [
    ("bias", "logit-bias"), ("generation", "unknown generation 12345"),
    ("penalty", "presence_penalty must be in"), ("verify", "num-drafted 0")])
def test_hostile_sampler_options_trap_naming_the_cause(run_inferlet, which, cause) -> None:
    result = run_inferlet("structured_probe", ["hostile", which])
    assert result.status != "ok" and cause in result.value, result.value


def test_sdk_logprobs_equal_log_softmax_of_float32_logits(run_inferlet, engine) -> None:
    prompt = "My favourite colour is"
    result = run_inferlet("structured_probe", ["logprobs", prompt]).json()
    context = engine.tokenizer.encode(prompt)
    assert len(result["logprobs"]) == len(result["token_ids"]) == 4
    for token_id, logprob, top in result["logprobs"]:
        expected = torch.log_softmax(engine.prompt_logits(context).float(), dim=-1)
        assert logprob == pytest.approx(float(expected[token_id]), abs=2e-4)
        values, ids = expected.topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=2e-4)
        context.append(token_id)


def test_sdk_penalties_reduce_repeats(run_inferlet) -> None:
    prompt = "one one one one one one one one"
    plain = run_inferlet("structured_probe", ["penalty", prompt, "0"]).json()["token_ids"]
    penalized = run_inferlet("structured_probe", ["penalty", prompt, "2"]).json()["token_ids"]
    def max_count(tokens: list[int]) -> int:
        return max(tokens.count(t) for t in tokens)
    assert max_count(plain) > 3 and max_count(penalized) < max_count(plain)


def test_entropy_probe(run_inferlet, engine) -> None:
    prompt = "The capital of France is"
    value = run_inferlet("structured_probe", ["entropy", prompt]).json()["entropy"]
    log_probs = torch.log_softmax(engine.prompt_logits(engine.tokenizer.encode(prompt)).double(), -1)
    assert value == pytest.approx(float(-(log_probs.exp() * log_probs).sum()), rel=1e-4)


def test_best_of_n_picks_the_highest_mean_logprob(run_inferlet) -> None:
    result = run_inferlet("best_of_n", ["--n", "3", "--json", "--max-tokens", "12"]).json()
    scores = [c["mean_logprob"] for c in result["candidates"]]
    assert result["best"]["mean_logprob"] == max(scores) and len(scores) == 3
    for candidate in result["candidates"]:
        assert len(candidate["logprobs"]) >= len(candidate["token_ids"])
        assert all(lp <= 0 for lp in candidate["logprobs"])


def test_speculative_greedy_equals_plain_greedy(run_inferlet, runtime) -> None:
    drafted = run_inferlet("speculative", ["--json"]).json()
    plain = run_inferlet("speculative", ["--json", "--no-draft"]).json()
    assert drafted["token_ids"] == plain["token_ids"]
    assert drafted["num_accepted"] >= len(drafted["token_ids"]) // 3
    assert drafted["num_verify_passes"] < len(plain["token_ids"])
    assert runtime.statistics().pages.num_used == 0        # rolled-back pages were returned
