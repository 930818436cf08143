"""`pie:inferlet/forward` generations: per-instance, host-kept sampling state (the tokens produced
for penalties, a grammar matcher) that samplers attach to by id. The engine's sampler advances a
generation with each token an attached output returns, in the same pass.

The table is `InstanceTables.generations` (host/sandbox/tables.py): it ends with the instance.
"""
from __future__ import annotations

from wasmtime.component import Record, Variant

from engine.constrain import GenerationState, GrammarError, GrammarSpec
from host.bindings.context import BindingContext

__all__ = ["FUNCTIONS"]

_GRAMMAR_KINDS = {"json-schema": "json_schema", "regex": "regex", "lark": "lark"}


def create_generation(ctx: BindingContext, grammar: Variant | None) -> int | str:
    """The new id (ok), or why the grammar does not compile (err)."""
    call = "forward.create-generation"
    matcher = None
    if grammar is not None:
        compiler = getattr(ctx.services.engine, "grammar", None)
        if compiler is None:
            return "this engine has no tokenizer: grammars are unavailable"
        try:
            matcher = compiler.matcher(GrammarSpec(_GRAMMAR_KINDS[grammar.tag], grammar.payload))
        except GrammarError as exc:
            return str(exc)
    return ctx.tables.generations.add(call, GenerationState(matcher))


def generation_status(ctx: BindingContext, generation_id: int) -> Record:
    status = ctx.tables.generations.get("forward.get-generation-status", generation_id).status()
    record = Record()
    setattr(record, "num-tokens", status.num_tokens)
    record.accepting = status.accepting
    record.stopped = status.stopped
    return record


def destroy_generation(ctx: BindingContext, generation_id: int) -> None:
    ctx.tables.generations.remove("forward.destroy-generation", generation_id)


FUNCTIONS = {"create-generation": create_generation, "get-generation-status": generation_status,
             "destroy-generation": destroy_generation}
