"""The example inferlets, built with `pie build`'s builder and run through the real host on the
real model. Exactness where the model is deterministic (greedy): token ids equal the engine's own
greedy loop."""
from __future__ import annotations

import json
import math
import threading

import pytest

from tests.inferlets.conftest import truncate_at_stop

pytestmark = pytest.mark.slow


def test_text_completion_greedy_equals_engine_greedy(run_inferlet, engine, greedy_oracle):
    prompt, num_tokens = "The capital of France is", 16
    result = run_inferlet("text_completion", ["--prompt", prompt, "--max-tokens", str(num_tokens),
                                              "--json"]).json()
    expected = greedy_oracle([engine.tokenizer.encode(prompt)], num_tokens)[0]
    assert result["token_ids"] == truncate_at_stop(expected, engine.tokenizer.stop_token_ids)
    assert result["text"] == engine.tokenizer.decode(result["token_ids"])


def test_text_completion_help_and_argument_errors(run_inferlet):
    """The SDK's ArgumentParser in the guest: --help is the result, at the fixed width and with no
    colour codes (the formatter the SDK sets, which asks for no terminal); a bad value fails the
    instance with argparse's message."""
    help_run = run_inferlet("text_completion", ["--help"])
    assert help_run.status == "ok" and help_run.value.startswith("usage: text_completion")
    assert "--max-tokens MAX_TOKENS" in help_run.value and "\x1b" not in help_run.value
    assert max(map(len, help_run.value.splitlines())) <= 78
    bad = run_inferlet("text_completion", ["--max-tokens", "many"])
    assert bad.status == "error" and "argument --max-tokens: invalid int value: 'many'" in bad.value


def test_text_completion_seeded_sampling_is_reproducible(run_inferlet):
    args = ["--prompt", "Once upon a time", "--max-tokens", "10", "--temperature", "0.9",
            "--seed", "1234", "--json"]
    first, second = run_inferlet("text_completion", args).json(), run_inferlet("text_completion", args).json()
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) > 0


def test_text_completion_streams_the_same_text(run_inferlet):
    args = ["--prompt", "The capital of France is", "--max-tokens", "16"]
    streamed = run_inferlet("text_completion", args + ["--stream"])
    whole = run_inferlet("text_completion", args)
    assert streamed.status == whole.status == "ok" and streamed.value == ""
    assert len(streamed.messages) > 1 and "".join(streamed.messages) == whole.value


def test_parallel_generation_equals_separate_greedy_runs(run_inferlet, runtime, engine, greedy_oracle):
    prefix, suffixes, num_tokens = "Three short facts about the moon.\n", ["Fact 1:", "Fact 2:", "Fact 3:"], 8
    tokenizer = engine.tokenizer
    expected = greedy_oracle([tokenizer.encode(prefix) + tokenizer.encode(s) for s in suffixes], num_tokens)
    before = runtime.statistics()
    args = ["--prefix", prefix, "--max-tokens", str(num_tokens)]
    for suffix in suffixes:
        args += ["--suffix", suffix]
    forks = run_inferlet("parallel_generation", args).json()
    after = runtime.statistics()
    for fork, want in zip(forks, expected):
        assert fork["token_ids"] == truncate_at_stop(want, tokenizer.stop_token_ids)
    # The prefix is computed once: every other computed token is a fork's suffix or decode input.
    num_computed = after.engine.num_input_tokens - before.engine.num_input_tokens
    per_fork = sum(len(tokenizer.encode(s)) + len(f["token_ids"]) - 1 for s, f in zip(suffixes, forks))
    stopped_early = sum(len(f["token_ids"]) < num_tokens for f in forks)   # their stop token was not computed
    assert num_computed == len(tokenizer.encode(prefix)) + per_fork + stopped_early
    # The forks share batches: fewer batches than passes.
    num_batches = after.engine.num_batches - before.engine.num_batches
    num_passes = after.engine.num_requests - before.engine.num_requests
    assert num_batches < num_passes


def test_chat_multi_turn_through_client_messages(run_inferlet, runtime, engine, greedy_oracle):
    system, questions, num_tokens = "You are a helpful assistant. Answer briefly.", ["What is 2+2?", "And 3+3?"], 24
    replies: list[str] = []

    def on_message(instance_id: str, message: str) -> None:
        replies.append(message)
        runtime.send(instance_id, questions[len(replies)] if len(replies) < len(questions) else "/quit")

    transcript = run_inferlet("chat", ["--system", system, "--max-tokens", str(num_tokens)],
                              on_message=on_message, send=[questions[0]]).json()
    assert [content for role, content in transcript if role == "user"] == questions
    assert [content for role, content in transcript if role == "assistant"] == replies
    assert len(replies) == 2 and all(replies)
    tokenizer = engine.tokenizer
    prompt = tokenizer.render_chat([{"role": "system", "content": system},
                                    {"role": "user", "content": questions[0]}], add_generation_prompt=True)
    expected = truncate_at_stop(greedy_oracle([tokenizer.encode(prompt)], num_tokens)[0],
                                tokenizer.stop_token_ids)
    assert replies[0] == tokenizer.decode(expected).strip()


def test_beam_search_width_one_is_greedy_and_beams_are_ranked(run_inferlet, engine, greedy_oracle):
    prompt, num_tokens = "The best way to learn a language is", 6
    expected = greedy_oracle([engine.tokenizer.encode(prompt)], num_tokens)[0]
    (single,) = run_inferlet("beam_search", ["--prompt", prompt, "--beam-width", "1",
                                             "--max-tokens", str(num_tokens)]).json()
    assert single["token_ids"] == truncate_at_stop(expected, engine.tokenizer.stop_token_ids)
    beams = run_inferlet("beam_search", ["--prompt", prompt, "--beam-width", "3",
                                         "--max-tokens", str(num_tokens)]).json()
    assert len(beams) == 3 and len({tuple(b["token_ids"]) for b in beams}) == 3
    scores = [b["log_prob"] / max(1, len(b["token_ids"])) for b in beams]
    assert scores == sorted(scores, reverse=True) and all(b["log_prob"] <= 0 for b in beams)


def test_prefix_cache_import_skips_the_prefix_prefill(run_inferlet, runtime):
    name, question = "test/prefix-cache", "What is a prime number?"
    args = ["--name", name, "--question", question, "--max-tokens", "12"]

    def computed_tokens(extra=()):
        before = runtime.statistics().engine.num_input_tokens
        result = run_inferlet("prefix_cache", args + list(extra)).json()
        return result, runtime.statistics().engine.num_input_tokens - before

    first, first_tokens = computed_tokens()
    second, second_tokens = computed_tokens(["--release"])
    assert not first["imported"] and second["imported"]
    assert first["prefix_tokens"] == second["prefix_tokens"] > 16
    assert second["answer"] == first["answer"]   # same KV, same greedy answer
    assert second_tokens == first_tokens - first["prefix_tokens"]
    stats = runtime.statistics()
    assert stats.pages.num_used == 0   # released export and finished instances hold no page


def test_windowed_attention_keeps_pages_bounded(run_inferlet, runtime, engine):
    num_tokens, sink, window = 160, 4, 32
    pages_used: list[int] = []

    def on_message(instance_id: str, message: str) -> None:
        pages_used.append(runtime.statistics().pages.num_used)

    result = run_inferlet("windowed_attention", ["--max-tokens", str(num_tokens), "--sink", str(sink),
                                                 "--window", str(window), "--report-every", "16"],
                          on_message=on_message).json()
    page_size = engine.page_size
    bound = 1 + math.ceil(window / page_size) + 2   # sink page + window pages + the growing ones
    unbounded = math.ceil((num_tokens + 12) / page_size)
    assert result["num_tokens"] == num_tokens and len(pages_used) == num_tokens // 16
    assert result["max_pages"] <= bound < unbounded
    assert max(pages_used) <= bound


def test_skeleton_of_thought_fans_out_and_joins(run_inferlet, runtime):
    before = runtime.statistics().engine
    result = run_inferlet("skeleton_of_thought", ["--question", "How can I sleep better?",
                                                  "--num-points", "3", "--skeleton-tokens", "40",
                                                  "--point-tokens", "12"]).json()
    after = runtime.statistics().engine
    assert 1 <= len(result["points"]) <= 3 and len(result["expansions"]) == len(result["points"])
    assert all(result["expansions"])
    for point, expansion in zip(result["points"], result["expansions"]):
        assert point in result["answer"] and expansion in result["answer"]
    if len(result["points"]) > 1:   # the expansions ran side by side
        assert after.num_batches - before.num_batches < after.num_requests - before.num_requests


def test_agent_calls_a_tool_through_the_client(run_inferlet, runtime):
    observation = "Sunny, 21 degrees Celsius, light wind."
    calls: list[dict] = []

    def on_message(instance_id: str, message: str) -> None:
        calls.append(json.loads(message))
        runtime.send(instance_id, observation)

    result = run_inferlet("agent", ["--task", "What is the weather in Paris?", "--max-tokens", "24"],
                          on_message=on_message).json()
    assert len(calls) == 1 and calls[0]["type"] == "tool_call" and calls[0]["name"] == "get_weather"
    assert isinstance(calls[0]["arguments"]["city"], str) and calls[0]["arguments"]["city"]
    assert result["tool_calls"] == calls and result["observations"] == [observation]
    assert isinstance(result["answer"], str)
