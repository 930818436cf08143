"""`pie:inferlet/forward` generations: per-instance, host-kept sampling state (the tokens produced
for penalties, a grammar matcher) that samplers attach to by id. The engine's sampler advances a
generation with each token an attached output returns, in the same pass.

The table is `InstanceTables.generations` (host/bindings/tables.py): it ends with the instance.
"""
from __future__ import annotations

import threading

from wasmtime.component import Record, Variant

from engine.constrain import GenerationState, GrammarError, GrammarSpec
from host.bindings.context import BindingContext
from host.errors import TrapError

__all__ = ["FUNCTIONS", "GenerationTable", "MAX_GENERATIONS"]

MAX_GENERATIONS = 4096     # per instance, at once


class GenerationTable:
    """Generation id -> GenerationState of one instance. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[int, GenerationState] = {}
        self._next_id = 1

    def add(self, call: str, state: GenerationState) -> int:
        with self._lock:
            if len(self._states) >= MAX_GENERATIONS:
                raise TrapError(f"{call}: {MAX_GENERATIONS} generations alive; destroy some first")
            generation_id = self._next_id
            self._next_id += 1
            self._states[generation_id] = state
            return generation_id

    def get(self, call: str, generation_id: int) -> GenerationState:
        with self._lock:
            state = self._states.get(generation_id)
        if state is None:
            raise TrapError(f"{call}: unknown generation {generation_id}")
        return state

    def remove(self, call: str, generation_id: int) -> None:
        with self._lock:
            if self._states.pop(generation_id, None) is None:
                raise TrapError(f"{call}: unknown generation {generation_id}")


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
