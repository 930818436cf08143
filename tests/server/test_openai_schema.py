"""OpenAI request validation (no server): OpenAI's ranges, error.param, 404 for an unknown model,
tools and tool histories, response formats, prompt lists."""
from __future__ import annotations

import pytest

from host.server.openai.schema import ApiLimits, RequestError, parse_request

LIMITS = ApiLimits(frozenset({"SmolLM2-135M-Instruct", "Smollm2 135M"}), "SmolLM2-135M-Instruct",
                   4096, 49152)
CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def refused(body: dict, mode: str = "chat") -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(body, mode, LIMITS)
    return info.value


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("temperature", 5), ("top_logprobs", 21)])
def test_out_of_range_values_name_their_param(field, value) -> None:
    error = refused({**CHAT, field: value, "logprobs": True})
    assert error.status == 400 and error.param == field


def test_unknown_model_is_404_and_aliases_are_accepted() -> None:
    error = refused({**CHAT, "model": "gpt-4o"})
    assert error.status == 404 and error.param == "model" and error.code == "model_not_found"
    assert parse_request({**CHAT, "model": "Smollm2 135M"}, "chat", LIMITS)["mode"] == "chat"


def test_max_tokens_over_the_context_is_400() -> None:
    error = refused({**CHAT, "max_tokens": 5000})
    assert error.param == "max_tokens" and "4096" in str(error)


@pytest.mark.parametrize("body, mode, param", [
    ({**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}, "chat",
     "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "chat", "messages[0].content[0].text"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": ["ok", "x\ud800"]}, "completion", "prompt[1]"),
    ({**CHAT, "stop": "\ud800"}, "chat", "stop"),
    ({**CHAT, "metadata": {"\ud800": "v"}}, "chat", "metadata.\\ud800"),
])
def test_a_lone_surrogate_is_400_naming_its_field(body, mode, param) -> None:
    """JSON's escapes admit lone surrogates, which no tokenizer takes: refused up front."""
    error = refused(body, mode)
    assert error.status == 400 and error.param == param, (error.param, str(error))
    assert "not valid Unicode" in str(error)
    str(error).encode("utf-8")                  # the message itself is valid text


def test_max_tokens_refusal_names_the_context_given() -> None:
    """The figure in the refusal is ApiLimits.max_context (the frontend passes the tenant's)."""
    error = refused({**CHAT, "max_tokens": 4097})
    assert str(error) == "'max_tokens' is 4097, but the context length is 4096 tokens"


def test_logprobs_logit_bias_and_response_format_are_normalised() -> None:
    request = parse_request({**CHAT, "logprobs": True, "top_logprobs": 3,
                             "logit_bias": {"42": -100, "7": 5},
                             "response_format": {"type": "json_object"}}, "chat", LIMITS)
    assert request["logprobs"] == 3 and request["logit_bias"] == [[42, -100.0], [7, 5.0]]
    assert request["response_format"] == {"schema": {"type": "object"}}
    assert refused({**CHAT, "top_logprobs": 2}).param == "top_logprobs"
    assert refused({**CHAT, "logit_bias": {"99999999": 1}}).param == "logit_bias"
    assert refused({**CHAT, "response_format": {"type": "yaml"}}).param == "response_format.type"
    completion = parse_request({"model": "SmolLM2-135M-Instruct", "prompt": ["a", "b"],
                                "logprobs": 2, "echo": True}, "completion", LIMITS)
    assert completion["prompts"] == ["a", "b"] and completion["logprobs"] == 2 and completion["echo"]
    assert refused({"model": "SmolLM2-135M-Instruct", "prompt": "a", "logprobs": 6},
                   "completion").param == "logprobs"


def test_tools_choices_and_tool_histories() -> None:
    request = parse_request({**CHAT, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, "chat", LIMITS)
    assert request["tool_choice"] == {"name": "get_weather"}
    assert request["tools"][0]["parameters"]["required"] == ["city"]
    assert parse_request({**CHAT, "tools": [WEATHER]}, "chat", LIMITS)["tool_choice"] == "auto"
    assert refused({**CHAT, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}).param == "tool_choice"
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    messages = parse_request({**CHAT, "messages": history, "tools": [WEATHER]}, "chat",
                             LIMITS)["messages"]
    assert messages[1]["tool_calls"][0]["name"] == "get_weather"
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    bad = refused({**CHAT, "messages": [{"role": "tool", "content": "x"}]})
    assert bad.param == "messages[0].tool_call_id"
