"""A decode loop straight on the engine (no host), for the grammar / log-prob / drafting tests:
one sequence, pages borrowed from the start of the idle pool, one pass per step (or a verify
pass carrying drafts)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from engine.batch import ForwardBatch, ForwardRequest, SamplerSpec, Verified


class DecodeLoop:
    """Feeds tokens to the engine and returns each pass's outputs."""

    def __init__(self, engine, prompt_ids: Sequence[int]) -> None:
        self.engine = engine
        self.kv_len = 0
        self.pending = list(prompt_ids)
        self.page_ids = tuple(range(engine.num_pages))

    def _request(self, token_ids: list[int], output_indices: tuple[int, ...],
                 samplers: tuple[SamplerSpec, ...], num_drafted: int = 0) -> ForwardRequest:
        end = self.kv_len + len(token_ids)
        num_pages = -(-end // self.engine.page_size)
        return ForwardRequest(tuple(token_ids), tuple(range(self.kv_len, end)),
                              self.page_ids[:num_pages], (end - 1) % self.engine.page_size + 1,
                              output_indices, samplers, num_drafted=num_drafted)

    def step(self, spec: SamplerSpec):
        """Compute the pending tokens, return the output after the last one (not accepted)."""
        request = self._request(self.pending, (len(self.pending) - 1,), (spec,))
        (result,) = self.engine.forward(ForwardBatch((request,)))
        self.kv_len += len(self.pending)
        self.pending = []
        return result.outputs[0]

    def accept(self, token_id: int) -> None:
        self.pending.append(token_id)

    def verify(self, spec: SamplerSpec, draft_ids: list[int]) -> Verified:
        """One verify pass over the pending token(s) and the drafts; rejected slots rolled back."""
        token_ids = self.pending + list(draft_ids)
        k = len(draft_ids)
        outputs = tuple(range(len(token_ids) - k - 1, len(token_ids)))
        request = self._request(token_ids, outputs, (spec,) * (k + 1), num_drafted=k)
        (result,) = self.engine.forward(ForwardBatch((request,)))
        verified = result.outputs[0]
        self.kv_len += len(self.pending) + verified.num_accepted     # rejected drafts dropped
        self.pending = [verified.token_ids[-1]]
        return verified


def generate(engine, prompt_ids: Sequence[int], spec: SamplerSpec, max_tokens: int,
             stop_ids: Sequence[int] = ()) -> list:
    """Outputs of up to max_tokens steps (token outputs accepted; stops at a stop token)."""
    loop, outputs = DecodeLoop(engine, prompt_ids), []
    for _ in range(max_tokens):
        output = loop.step(spec)
        outputs.append(output)
        token = output if isinstance(output, int) else output.token_id
        if token in stop_ids:
            break
        loop.accept(token)
    return outputs


def generate_drafted(engine, prompt_ids: Sequence[int], spec: SamplerSpec, max_tokens: int,
                     drafter: Callable[[list[int]], list[int]]) -> tuple[list[int], list[int]]:
    """(tokens, accepted count per verify pass) with a drafter proposing from the context."""
    loop = DecodeLoop(engine, prompt_ids)
    first = loop.step(spec)
    tokens, accepted = [first], []
    loop.accept(first)
    while len(tokens) < max_tokens:
        drafts = drafter(list(prompt_ids) + tokens)[:max_tokens - len(tokens) - 1]
        if not drafts:
            output = loop.step(spec)
            tokens.append(output)
            loop.accept(output)
            continue
        verified = loop.verify(spec, drafts)
        accepted.append(verified.num_accepted)
        tokens.extend(verified.token_ids)
    return tokens[:max_tokens], accepted


__all__ = ["DecodeLoop", "generate", "generate_drafted", "replace"]
