"""Hostile OpenAI requests on the real model: a deeply nested body and a prompt longer than the
context answer 400 naming the problem, up front, and a well-behaved request before and after them
gives exactly the same answer; every page comes back."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import TOKENS, scrape, wait_until_idle

pytestmark = pytest.mark.slow
HEADERS = {"Authorization": f"Bearer {TOKENS['alice']}"}
QUESTION = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 6, "temperature": 0}


def _post(server, body: str | dict) -> httpx.Response:
    url = f"{server.url}/v1/chat/completions"
    if isinstance(body, dict):
        return httpx.post(url, json=body, headers=HEADERS, timeout=120)
    return httpx.post(url, content=body, headers={**HEADERS, "Content-Type": "application/json"},
                      timeout=120)


def test_hostile_bodies_answer_400_and_leave_others_alone(model_server) -> None:
    solo = _post(model_server, QUESTION).json()["choices"][0]["message"]["content"]

    deep = _post(model_server, '{"messages": ' + "[" * 50_000 + "]" * 50_000 + "}")
    assert deep.status_code == 400
    assert "nested deeper than 64 levels" in deep.json()["error"]["message"]
    value: object = 1
    for _ in range(70):
        value = [value]
    nested = {**QUESTION, "metadata": value}                     # valid JSON, 72 levels deep
    answer = _post(model_server, nested)
    assert answer.status_code == 400 and "nested deeper" in answer.json()["error"]["message"]

    words = "the quick brown fox jumps over the lazy dog " * 600      # > 4096 tokens
    too_long = _post(model_server, {**QUESTION, "messages": [{"role": "user", "content": words}]})
    assert too_long.status_code == 400
    message = too_long.json()["error"]["message"]
    assert "the context length is 4096 tokens" in message and "in the prompt" in message

    near = _post(model_server, {**QUESTION, "max_tokens": 4096})  # prompt + 4096 > context
    assert near.status_code == 400 and "max_tokens 4096" in near.json()["error"]["message"]

    again = _post(model_server, QUESTION).json()["choices"][0]["message"]["content"]
    assert again == solo
    wait_until_idle(model_server.url)


def test_all_choices_and_prompts_are_counted_against_the_context_up_front(model_server) -> None:
    # each choice fits the 4096-token context; 8 of them at once need more than the 256 pages
    # one request may hold: refused before launch (no instance ran, nothing was generated)
    launched = _launched(model_server)
    many = _post(model_server, {**QUESTION, "n": 8, "max_tokens": 600})
    assert many.status_code == 400
    error = many.json()["error"]
    assert error["param"] == "n" and error["code"] == "context_length_exceeded"
    assert "n=8 choices" in error["message"] and "256 pages (4096 tokens)" in error["message"]

    prompts = {"model": QUESTION["model"], "prompt": ["Name a colour."] * 16, "max_tokens": 300}
    listed = httpx.post(f"{model_server.url}/v1/completions", json=prompts, headers=HEADERS,
                        timeout=120)
    assert listed.status_code == 400
    assert listed.json()["error"]["param"] == "prompt"
    assert "16 prompt(s)" in listed.json()["error"]["message"]
    assert _launched(model_server) == launched


    two = _post(model_server, {**QUESTION, "n": 2})
    assert two.status_code == 200 and len(two.json()["choices"]) == 2
    wait_until_idle(model_server.url)


def _launched(server) -> float:
    return sum(value for name, value in scrape(server.url).items()
               if name.startswith("pie_instances_launched_total"))


def test_one_context_length_everywhere_and_lone_surrogates_are_400(model_server) -> None:
    """/v1/models, a max_tokens refusal and a long prompt's refusal name the same figure, the one
    enforced (the tenant's reservation, 256 pages of 16 tokens); a lone surrogate in a prompt or
    a chat message is a 400 naming the field, not a 500 from the tokenizer."""
    models = httpx.get(f"{model_server.url}/v1/models", headers=HEADERS, timeout=30).json()
    assert models["data"][0]["max_model_len"] == 4096
    over = _post(model_server, {**QUESTION, "max_tokens": 5000})
    assert over.status_code == 400
    assert over.json()["error"]["message"] == \
        "'max_tokens' is 5000, but the context length is 4096 tokens"
    chat = _post(model_server, '{"model": "SmolLM2-135M-Instruct", "max_tokens": 2, '
                               '"messages": [{"role": "user", "content": "hi \\ud800"}]}')
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "messages[0].content"
    completion = httpx.post(f"{model_server.url}/v1/completions", headers={
        **HEADERS, "Content-Type": "application/json"}, timeout=60,
        content='{"model": "SmolLM2-135M-Instruct", "max_tokens": 2, "prompt": "\\udc80"}')
    assert completion.status_code == 400, completion.text
    assert completion.json()["error"]["param"] == "prompt"
    wait_until_idle(model_server.url)
