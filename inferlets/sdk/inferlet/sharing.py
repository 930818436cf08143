"""A system prompt's KV shared between instances of one tenant through a named export."""
from __future__ import annotations

from inferlet.context import Context, list_exports
from inferlet.errors import InferletError

__all__ = ["shared_system_context"]


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
