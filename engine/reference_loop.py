"""The engine's own batched greedy loop: the reference a host-driven generation is held against.

Used by `Engine.generate_greedy*` / `Engine.prompt_logits`, i.e. by the agreement tests (against
transformers) and by the benchmarks that compare generation through Wasm inferlets with the engine
driven directly; the host never calls it. Pages come from a free list local to the call (the whole
pool) and are given back when it ends, so it must not run while a host manages the same pool. One
batched forward pass per step: the first step prefills every prompt, each later step decodes one
token per prompt.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from engine.batch import GREEDY, ForwardBatch, ForwardRequest, ForwardResult
from engine.paging import last_page_len, num_pages_needed


class _Steppable(Protocol):
    """What the loop needs of an engine (engine.engine.Engine has it)."""

    page_size: int
    num_pages: int

    def forward(self, batch: ForwardBatch) -> Sequence[ForwardResult]: ...

    def logits(self, batch: ForwardBatch) -> torch.Tensor: ...

__all__ = ["generate_greedy_batch", "prompt_logits"]


def generate_greedy_batch(engine: _Steppable, prompts: list[list[int]], num_new_tokens: int,
                          adapters: Sequence[str | None] | None = None) -> list[list[int]]:
    """Greedy `num_new_tokens` after each prompt (no EOS stop) -> the new tokens per prompt.
    adapters: None, or per prompt the LoRA adapter its requests name (ForwardRequest.adapter)."""
    adapters = [None] * len(prompts) if adapters is None else list(adapters)
    if len(adapters) != len(prompts):
        raise ValueError(f"{len(adapters)} adapters for {len(prompts)} prompts")
    if num_new_tokens <= 0:
        return [[] for _ in prompts]
    if any(not prompt for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    page_size = engine.page_size
    free_page_ids = list(range(engine.num_pages - 1, -1, -1))
    pages_per_prompt = [num_pages_needed(len(p) + num_new_tokens, page_size) for p in prompts]
    if sum(pages_per_prompt) > len(free_page_ids):
        raise ValueError(f"generation needs {sum(pages_per_prompt)} pages, the pool has "
                         f"{engine.num_pages}")
    page_ids = [[free_page_ids.pop() for _ in range(n)] for n in pages_per_prompt]
    lengths = [0] * len(prompts)
    new_tokens: list[list[int]] = [[] for _ in prompts]
    step_tokens = prompts
    for _ in range(num_new_tokens):
        requests = []
        for i, tokens in enumerate(step_tokens):
            end = lengths[i] + len(tokens)
            requests.append(ForwardRequest(
                token_ids=tuple(tokens), positions=tuple(range(lengths[i], end)),
                page_ids=tuple(page_ids[i][:num_pages_needed(end, page_size)]),
                last_page_len=last_page_len(end, page_size),
                output_indices=(len(tokens) - 1,), samplers=(GREEDY,), adapter=adapters[i]))
            lengths[i] = end
        results = engine.forward(ForwardBatch(tuple(requests)))
        step_tokens = [[result.outputs[0]] for result in results]
        for i, (token,) in enumerate(step_tokens):
            new_tokens[i].append(token)
    return new_tokens


def prompt_logits(engine: _Steppable, prompt_ids: list[int], all_positions: bool = False,
                  adapter: str | None = None):
    """float32 logits of a fresh prompt: [vocab] at its last position, or [len, vocab] at all;
    `adapter`: the LoRA adapter the pass names.

    Borrows pages from the start of the pool, like generate_greedy_batch.
    """
    num_tokens = len(prompt_ids)
    outputs = tuple(range(num_tokens)) if all_positions else (num_tokens - 1,)
    request = ForwardRequest(tuple(prompt_ids), tuple(range(num_tokens)),
                             tuple(range(num_pages_needed(num_tokens, engine.page_size))),
                             last_page_len(num_tokens, engine.page_size), outputs,
                             (GREEDY,) * len(outputs), adapter=adapter)
    logits = engine.logits(ForwardBatch((request,)))
    return logits if all_positions else logits[0]
