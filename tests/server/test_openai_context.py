"""The up-front context check of OpenAI requests (host/server/openai/context.py): every prompt and
every choice of a request counted against one instance's page reservation, in the pages the
built-in inferlet holds at once."""
from __future__ import annotations

from host.server.openai.context import ContextLimits, context_problem, request_pages

LIMITS = ContextLimits(max_sequence_tokens=4096, max_pages=256, page_size=16)


def test_one_choice_needs_the_pages_of_prompt_plus_max_tokens() -> None:
    assert request_pages([10], 1, 6, 16) == 1
    assert request_pages([10], 1, 7, 16) == 2           # 17 tokens
    assert request_pages([16, 33], 1, 16, 16) == 2 + 4  # both prompts held at once


def test_choices_each_hold_the_prompt_pages_and_copy_the_partial_page() -> None:
    # prompt 20 tokens (2 pages, the second partial), 8 choices of up to 20 + 28 = 48 tokens:
    # 8 x 3 page ids, plus the one page a choice copies out of the shared partial page
    assert request_pages([20], 8, 28, 16) == 8 * 3 + 1
    # a prompt of whole pages shares no partial page
    assert request_pages([32], 8, 16, 16) == 8 * 3
    # forking a long prompt with few new tokens: the parent and its 8 children hold it at once
    assert request_pages([60], 8, 4, 16) == 9 * 4       # generating: 8 x 4 + 1


def test_a_request_within_one_context_but_not_in_all_its_choices_is_refused() -> None:
    assert context_problem([20], 1, 600, LIMITS) is None
    param, message = context_problem([20], 8, 600, LIMITS)
    assert param == "n"
    assert "n=8 choices" in message and "one request may hold 256 pages (4096 tokens)" in message
    assert "need 313 KV pages" in message                       # 8 x ceil(620 / 16) + 1


def test_every_prompt_of_a_list_is_counted() -> None:
    param, message = context_problem([20] * 16, 1, 300, LIMITS)   # 16 x ceil(320 / 16) = 320
    assert param == "prompt" and "16 prompt(s)" in message and "need 320 KV pages" in message
    assert context_problem([20] * 12, 1, 300, LIMITS) is None      # 240 pages


def test_the_longest_prompt_past_the_context_names_the_context_length() -> None:
    param, message = context_problem([10, 4000], 1, 100, LIMITS)
    assert param == "prompt"
    assert message == ("the context length is 4096 tokens, but 4100 were requested "
                       "(4000 in the prompt, max_tokens 100)")
