"""Beam search over forks: each beam is a Context; a step scores every beam's top tokens.

A step submits one pass per live beam (each on its own queue, all in flight) asking for the
`beam_width` most likely next tokens, keeps the `beam_width` best continuations by total log
probability, forks a parent that is continued more than once, and closes dropped beams.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from inferlet.errors import InferletError
from inferlet.generation import wait_outputs
from inferlet.model import decode
from inferlet.sampling import Sampler

__all__ = ["Beam", "beam_search"]


@dataclass(frozen=True)
class Beam:
    """A finished beam: its generated tokens, text and total log probability."""

    token_ids: tuple[int, ...]
    text: str
    log_prob: float


def _root_beam(ctx):
    """A fork of `ctx` whose last token is still pending (its pass gives the first scores)."""
    if not ctx.pending_token_ids:
        raise InferletError("beam_search: fill the prompt first (its last token must be pending)")
    last_token = ctx.pending_token_ids.pop()
    ctx.token_ids.pop()
    root = ctx.fork()
    ctx.accept(last_token)
    root.accept(last_token)
    return root


def _top_tokens(ctx, sampler: Sampler):
    """Submit the beam's pending tokens; return its future."""
    return ctx.submit(ctx.take_pending(), sampler)


def _collect(future) -> list[tuple[int, float]]:
    dist = wait_outputs(future)[0].value
    return [(t, math.log(p)) for t, p in zip(dist.token_ids, dist.probs) if p > 0.0]


def beam_search(ctx, beam_width: int, max_tokens: int, *, length_penalty: float = 1.0) -> list[Beam]:
    """Beam search from `ctx` (left unchanged); returns the beams best first.

    A beam finishes at a stop token or at `max_tokens`. Scores are log_prob / len**length_penalty.
    """
    if beam_width <= 0 or max_tokens <= 0:
        raise ValueError(f"beam_width and max_tokens must be positive, got {beam_width}, {max_tokens}")
    sampler = Sampler("distribution", temperature=1.0, num_top=beam_width)
    live = [(_root_beam(ctx), [], 0.0)]    # (context, generated ids, log prob)
    finished: list[Beam] = []
    while live:
        futures = [_top_tokens(beam_ctx, sampler) for beam_ctx, _, _ in live]
        candidates = []
        for (beam_ctx, ids, score), future in zip(live, futures):
            beam_ctx.passes_done()
            for token_id, log_p in _collect(future):
                candidates.append((score + log_p, token_id, beam_ctx, ids))
        candidates.sort(key=lambda c: c[0], reverse=True)
        next_live, used = [], set()
        for score, token_id, beam_ctx, ids in candidates:
            if len(next_live) >= beam_width:
                break
            new_ids = ids + [token_id]
            if token_id in ctx.stop_token_ids or len(new_ids) >= max_tokens:
                text_ids = ids if token_id in ctx.stop_token_ids else new_ids
                finished.append(Beam(tuple(text_ids), decode(text_ids), score))
                continue
            child = beam_ctx.fork() if id(beam_ctx) in used else beam_ctx
            used.add(id(beam_ctx))
            next_live.append((child, new_ids, score, token_id))
        for beam_ctx, _, _ in live:
            if id(beam_ctx) not in used:
                beam_ctx.close()
        for child, _, _, token_id in next_live:
            child.accept(token_id)
        live = [(c, ids, s) for c, ids, s, _ in next_live]
        if len(finished) >= beam_width:
            for beam_ctx, _, _ in live:
                beam_ctx.close()
            break
    return sorted(finished, key=lambda b: b.log_prob / max(1, len(b.token_ids)) ** length_penalty,
                  reverse=True)[:beam_width]
