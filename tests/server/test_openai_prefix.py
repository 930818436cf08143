"""The built-in inferlet's shared chat prefixes (inferlet.prefix_context) on the real model: a
request whose system prompt an earlier request of its tenant computed imports those leading KV
pages instead of computing them and answers the same; a tenant keeps at most
MAX_PREFIX_EXPORTS such prefixes; a tenant with prefix_cache_pages = 0 shares nothing."""
from __future__ import annotations

import ast

import openai
import pytest

from host.server.builtin import builtin_source
from tests.server.conftest import TOKENS, scrape, wait_until_idle

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PAGE_SIZE = 16       # the model_server fixture's engine
# the built-in's constant (its module imports the guest SDK, so it is read, not imported)
MAX_PREFIX_EXPORTS = next(
    node.value.value for node in ast.parse(builtin_source().read_text()).body
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MAX_PREFIX_EXPORTS")
SYSTEM = ("You are the careful assistant of test {tag}. Answer every question in one short, "
          "plain sentence, politely and without lists.")


def _client(model_server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{model_server.url}/v1", api_key=TOKENS[tenant],
                         max_retries=0)


def _ask(model_server, tenant: str, system: str) -> tuple[str, int, int]:
    """(answer, input tokens the engine computed for it, prompt tokens) of one greedy request."""
    before = scrape(model_server.url)["pie_input_tokens_total"]
    answer = _client(model_server, tenant).chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": system},
                  {"role": "user", "content": "What is the capital of France?"}])
    figures = wait_until_idle(model_server.url)
    return (answer.choices[0].message.content, int(figures["pie_input_tokens_total"] - before),
            answer.usage.prompt_tokens)


def test_a_system_prompt_is_computed_once_and_answers_the_same(model_server) -> None:
    first, computed_first, prompt_tokens = _ask(model_server, "alice", SYSTEM.format(tag="one"))
    exported = scrape(model_server.url)["pie_kv_pages_exported"]
    second, computed_second, _ = _ask(model_server, "alice", SYSTEM.format(tag="one"))
    shared = computed_first - computed_second
    assert second == first
    # to the token, not whole pages: the template's text before the user's content, less one
    assert shared > PAGE_SIZE and shared % PAGE_SIZE != 0 and shared < prompt_tokens
    assert exported >= -(-shared // PAGE_SIZE)
    other, computed_other, _ = _ask(model_server, "alice", SYSTEM.format(tag="two"))
    assert computed_other == computed_first      # another system prompt: nothing to import


def test_a_tenant_keeps_at_most_max_prefix_exports(model_server) -> None:
    _, computed, _ = _ask(model_server, "alice", SYSTEM.format(tag="cap 0"))
    _, again, _ = _ask(model_server, "alice", SYSTEM.format(tag="cap 0"))
    pages_each = -(-(computed - again) // PAGE_SIZE)
    for index in range(1, MAX_PREFIX_EXPORTS + 3):
        _ask(model_server, "alice", SYSTEM.format(tag=f"cap {index}"))
    exported = scrape(model_server.url)["pie_kv_pages_exported"]
    assert pages_each <= exported <= MAX_PREFIX_EXPORTS * pages_each
    _, last_again, _ = _ask(model_server, "alice", SYSTEM.format(tag=f"cap {MAX_PREFIX_EXPORTS + 2}"))
    assert last_again == again                   # the newest is kept


def test_a_tenant_without_prefix_cache_shares_nothing(model_server) -> None:
    before = scrape(model_server.url)["pie_kv_pages_exported"]
    first, computed_first, _ = _ask(model_server, "carol", SYSTEM.format(tag="carol"))
    second, computed_second, _ = _ask(model_server, "carol", SYSTEM.format(tag="carol"))
    assert (second, computed_second) == (first, computed_first)
    assert scrape(model_server.url)["pie_kv_pages_exported"] == before
