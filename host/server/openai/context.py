"""Whether an OpenAI request fits one instance's context, checked before anything launches.

The built-in inferlet (inferlets/builtin/openai_completions.py) computes each prompt's KV once,
forks it into the request's `n` choices and generates all of them in parallel in one instance, so
the request fits when (a) every prompt plus max_tokens fits one sequence's context and (b) the KV
pages of every choice of every prompt, held at once, fit the instance's page reservation. A forked
choice holds its own page ids for the shared prompt pages (the reservation counts page ids), and
each choice copies the shared partial last page before writing into it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["ContextLimits", "request_pages", "context_problem", "prompt_lengths"]


@dataclass(frozen=True)
class ContextLimits:
    """What one OpenAI request may hold: tokens in one sequence and KV pages in all of them."""

    max_sequence_tokens: int    # the model's context, the pool's and the reservation's, smallest
    max_pages: int              # the instance's page reservation (never more than the pool)
    page_size: int


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def request_pages(prompt_lengths: Sequence[int], num_choices: int, max_tokens: int,
                  page_size: int) -> int:
    """The most KV page ids the built-in inferlet holds at once for these prompts (in tokens),
    each generating `num_choices` choices of up to `max_tokens` tokens: the larger of the peak
    while forking (the prompts forked so far, plus the prompt being forked held by its parent
    and its children) and the peak while generating (every choice at full length, plus one page
    a choice copies out of the shared partial last page)."""
    forking, held = 0, 0
    for length in prompt_lengths:
        prompt_pages = _pages(length, page_size)
        copies = num_choices + 1 if num_choices > 1 else 1
        forking = max(forking, held + copies * prompt_pages)
        held += num_choices * prompt_pages
    generating = sum(num_choices * _pages(length + max_tokens, page_size)
                     for length in prompt_lengths)
    if num_choices > 1 and any(length % page_size for length in prompt_lengths):
        generating += 1
    return max(forking, generating)


def context_problem(prompt_lengths: Sequence[int], num_choices: int, max_tokens: int,
                    limits: ContextLimits) -> tuple[str, str] | None:
    """None when the request fits, else (the parameter at fault, a message naming the limit)."""
    longest = max(prompt_lengths)
    if longest + max_tokens > limits.max_sequence_tokens:
        return "prompt", (f"the context length is {limits.max_sequence_tokens} tokens, but "
                          f"{longest + max_tokens} were requested ({longest} in the prompt, "
                          f"max_tokens {max_tokens})")
    needed = request_pages(prompt_lengths, num_choices, max_tokens, limits.page_size)
    if needed <= limits.max_pages:
        return None
    return "n" if num_choices > 1 else "prompt", (f"{len(prompt_lengths)} prompt(s) x n={num_choices} choices of up to "
                 f"{longest + max_tokens} tokens each need {needed} KV pages of "
                 f"{limits.page_size} tokens at once, but one request may hold {limits.max_pages} "
                 f"pages ({limits.max_pages * limits.page_size} tokens): the context length of "
                 f"all choices together")


def prompt_lengths(parsed: dict, encode: Callable[[str], list[int]],
                   render_chat: Callable[[list, bool], str]) -> list[int] | None:
    """The prompts' lengths in tokens, counted as the built-in inferlet will encode them; None
    when the chat cannot be rendered (the inferlet renders it and reports why)."""
    if parsed["mode"] == "chat":
        counted = [{"role": "user" if m["role"] == "tool" else m["role"],
                    "content": m.get("content") or ""} for m in parsed["messages"]]
        try:
            return [len(encode(render_chat(counted, True)))]
        except ValueError:
            return None
    return [len(encode(text)) for text in parsed["prompts"]]
