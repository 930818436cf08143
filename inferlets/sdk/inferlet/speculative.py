"""Speculative decoding on a context: one verify pass checks a drafter's guesses.

A step submits the last token plus k drafts with forward.submit-verify; the host accepts the
longest prefix of drafts the sampler agrees with (greedy: the argmax; sampling: standard
speculative sampling, same distribution as plain sampling) and samples one more token. The KV
slots of the rejected drafts are dropped from the context (`drop_tail`), so the next pass
overwrites them. Greedy output is token for token the same as without drafting.
"""
from __future__ import annotations

from inferlet._wit import forward, kv
from inferlet.generation import wait_outputs

__all__ = ["draft_step", "submit_verify", "drop_tail"]


def submit_verify(ctx, token_ids: list[int], num_drafted: int, sampler,
                  options: forward.SamplerOptions) -> forward.ForwardFuture:
    """Submit `token_ids` (their last `num_drafted` are drafts) as one verify pass on `ctx`."""
    ctx._check_open()
    positions = list(range(ctx.next_position, ctx.next_position + len(token_ids)))
    ctx.reserve(len(token_ids))
    future = forward.submit_verify(ctx.queue_id, ctx.sequence_id, token_ids, positions,
                                   ctx.last_page_len, num_drafted, sampler.to_wit(), options)
    ctx.next_position += len(token_ids)
    ctx.note_submitted()
    return future


def drop_tail(ctx, num_tokens: int) -> None:
    """Forget the last `num_tokens` computed KV slots of `ctx` (pages left empty are freed)."""
    if num_tokens <= 0:
        return
    new_len = ctx.kv_len - num_tokens
    num_pages = -(-new_len // ctx.page_size)
    dropped = ctx.page_ids[num_pages:]
    if dropped:
        kv.sequence_remove(ctx.sequence_id, num_pages, len(dropped))
        kv.free_pages(dropped)
        del ctx.page_ids[num_pages:]
        del ctx._page_masks[num_pages:]
    ctx.last_page_len = new_len - (num_pages - 1) * ctx.page_size if num_pages else 0
    ctx.next_position -= num_tokens


def draft_step(gen) -> str:
    """One step of Generation `gen` with its drafter; returns the new final text."""
    ctx = gen.ctx
    remaining = gen.max_tokens - len(gen.token_ids)
    pending = ctx.pending_token_ids
    drafts = list(gen.drafter(ctx.token_ids))[:max(0, remaining - 1)] if len(pending) == 1 else []
    if not drafts or gen.sampler.logprobs is not None:
        return gen.receive(gen.submit())
    options = gen.sampler.options_wit(gen.generation_id)
    future = submit_verify(ctx, ctx.take_pending() + drafts, len(drafts), gen.sampler, options)
    (output,) = wait_outputs(future, sampled=True)
    ctx.passes_done()
    token_ids = list(output.value)
    num_accepted = len(token_ids) - 1
    drop_tail(ctx, len(drafts) - num_accepted)
    gen.num_drafted += len(drafts)
    gen.num_accepted += num_accepted
    gen.num_verify_passes += 1
    delta = ""
    for index, token_id in enumerate(token_ids):
        computed = index < num_accepted
        delta += gen.accept(token_id, computed=computed)
        if gen.done:       # stopped inside the accepted drafts: their later slots go too
            drop_tail(ctx, num_accepted - index - 1 if computed else 0)
            break
    return delta
