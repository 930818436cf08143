"""KV shared between instances of one tenant through named exports: a system prompt's
(`shared_system_context`), or a prompt's leading pages named by their tokens (`prefix_context`)."""
from __future__ import annotations

import hashlib

from inferlet.context import Context, list_exports, release_export
from inferlet.errors import InferletError

__all__ = ["PREFIX_EXPORT", "prefix_context", "prefix_export_name", "shared_system_context"]


def shared_system_context(system: str, export_name: str) -> tuple[Context, bool]:
    """(a context holding the system prompt, whether its KV was imported).

    With `export_name` set, an existing export of that name is imported (nothing recomputed);
    otherwise the prompt is computed and exported, persistent, for the next instance. A lost race
    (another instance exported it first) keeps this instance's own copy. An empty name: no sharing.
    """
    if export_name and export_name in list_exports():
        return Context.from_import(export_name), True
    ctx = Context()
    ctx.fill_system(system)
    if export_name:
        try:
            ctx.export(export_name, persistent=True)
        except InferletError:
            pass   # another instance exported it first; this one computed its own copy
    return ctx, False


PREFIX_EXPORT = "pie.prefix."   # name prefix of the exports `prefix_context` makes


def prefix_context(token_ids: list[int], num_shared: int, max_exports: int) -> Context:
    """A context holding `token_ids`, whose first `num_shared` tokens' KV is shared between the
    instances of one tenant through a persistent export named by those tokens' hash.

    The prompt is always computed in the same two parts (the shared tokens, then the rest), so
    a request's outputs do not depend on whether its prefix was imported or computed. When the
    tenant already holds `max_exports` such exports, the first by name (an arbitrary one: names
    are hashes) is released to make room; a lost race (another instance exported or released the
    same name first) only costs this instance the sharing. `num_shared` 0: no export, one part.
    """
    if num_shared <= 0:
        ctx = Context()
        ctx.fill(token_ids)
        return ctx
    shared = token_ids[:num_shared]
    name = prefix_export_name(shared)
    names = [n for n in list_exports() if n.startswith(PREFIX_EXPORT)]
    ctx = _imported(name, shared) if name in names else None
    if ctx is None:
        ctx = Context()
        ctx.fill(shared)
        for old in sorted(names)[:max(0, len(names) - max_exports + 1)]:
            try:
                release_export(old)
            except InferletError:
                pass       # released by another instance meanwhile
        try:
            ctx.export(name, persistent=True)
        except InferletError:
            ctx.flush()    # exported by another instance first: keep this copy, same two parts
    ctx.fill(token_ids[num_shared:])
    return ctx


def prefix_export_name(token_ids: list[int]) -> str:
    """The export name `prefix_context` gives these shared tokens."""
    return PREFIX_EXPORT + hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def _imported(name: str, token_ids: list[int]) -> Context | None:
    """The export's context when it holds exactly `token_ids` (an instance of the tenant may have
    published other tokens under the name), else None."""
    try:
        ctx = Context.from_import(name)
    except InferletError:
        return None        # released between the listing and the import
    if ctx.token_ids != token_ids:
        ctx.close()
        return None
    return ctx
