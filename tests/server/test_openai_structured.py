"""The OpenAI behaviours of issue 13 on the real model, through the official `openai` client
against a real `pie serve`: log-probabilities, penalties, logit bias, response formats, tools
(forced and auto, with a tool history), echo, prompt lists, error.param, 404s as JSON."""
from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from tests.server.conftest import TOKENS, wait_until_idle

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "days": {"type": "integer", "minimum": 1,
                                                             "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(model_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{model_server.url}/v1", api_key=TOKENS["alice"], max_retries=0)


def test_chat_logprobs_and_top_logprobs(client) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1.0 + 1e-5


def test_completion_logprobs_echo_and_prompt_lists(client) -> None:
    answer = client.completions.create(model=MODEL, prompt=["The capital of France is", "Hello"],
                                       max_tokens=4, temperature=0, logprobs=2, echo=True)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].text.startswith("The capital of France is")
    assert answer.choices[1].text.startswith("Hello")
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == len("The capital of France is")


def test_penalties_and_logit_bias(client) -> None:
    kwargs = dict(model=MODEL, prompt="one one one one one one one one", max_tokens=12,
                  temperature=0)
    def max_count(tokens: list[str]) -> int:
        return max(tokens.count(t) for t in tokens)
    plain = client.completions.create(**kwargs, logprobs=0).choices[0].logprobs.tokens
    penalized = client.completions.create(**kwargs, logprobs=0, frequency_penalty=2.0,
                                          presence_penalty=2.0).choices[0].logprobs.tokens
    assert max_count(plain) > 3 and max_count(penalized) < max_count(plain)
    forced = client.completions.create(**kwargs, logit_bias={"45": 100}, logprobs=0)
    assert set(forced.choices[0].logprobs.tokens) == {"="}       # token 45 is "="
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs, presence_penalty=2.5)
    assert info.value.body["param"] == "presence_penalty"


def test_response_format_json_schema_and_json_object(client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 10**9}},
              "required": ["city", "population"], "additionalProperties": False}
    for seed in range(2):
        answer = client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=80, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        value = json.loads(answer.choices[0].message.content)
        assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    obj = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60,
                                         temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_forced_tool_call_parses_and_matches_the_parameters(client) -> None:
    messages = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]
    for seed in range(2):
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], temperature=0.8, seed=seed,
            max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(arguments) == {"city", "days"}
        assert 1 <= arguments["days"] <= 7


def test_tool_history_and_streamed_forced_call(client) -> None:
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                            tool_choice="none", max_tokens=20, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=history[:1], tools=[WEATHER], tool_choice="required",
        max_tokens=60, temperature=0, stream=True))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and json.loads(calls[0][0].function.arguments)["city"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_errors_are_openai_shaped(model_server, client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert info.value.body["param"] == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    aliases = ["Smollm2 135M 8k Lc100K Mix1 Ep2", "SmolLM2-135M-Instruct.Q4_1.gguf"]
    for alias in aliases:
        assert client.completions.create(model=alias, prompt="Hi", max_tokens=1).choices
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10**6)
    assert info.value.body["param"] == "max_tokens"
    missing = httpx.get(f"{model_server.url}/v1/nothing-here",
                        headers={"Authorization": f"Bearer {TOKENS['alice']}"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wait_until_idle(model_server.url)
