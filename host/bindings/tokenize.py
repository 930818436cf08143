"""`pie:inferlet/tokenize`: the model's tokenizer and chat template."""
from __future__ import annotations

from wasmtime.component import Record

from host.bindings.context import BindingContext
from host.errors import TrapError

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES"]

INTERFACE = "pie:inferlet/tokenize@0.1.0"


def encode(ctx: BindingContext, text: str) -> list[int]:
    return list(ctx.services.engine.tokenizer.encode(text))


def decode(ctx: BindingContext, token_ids: list[int]) -> str:
    vocab_size = ctx.services.model_info.vocab_size
    for token_id in token_ids:
        if token_id >= vocab_size:
            raise TrapError(f"tokenize.decode: token id {token_id} outside the vocabulary "
                            f"of {vocab_size}")
    return ctx.services.engine.tokenizer.decode(token_ids)


def vocabulary(ctx: BindingContext) -> list[str]:
    return list(ctx.services.engine.tokenizer.token_strings())


def render_chat(ctx: BindingContext, messages: list[Record], add_generation_prompt: bool) -> str:
    turns = [{"role": message.role, "content": message.content} for message in messages]
    try:
        return ctx.services.engine.tokenizer.render_chat(turns, add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 -- a template error names the call, traps the guest
        raise TrapError(f"tokenize.render-chat: cannot render the chat template: {exc}") from None


FUNCTIONS = {"encode": encode, "decode": decode, "vocabulary": vocabulary,
             "render-chat": render_chat}
METHODS: dict = {}
RESOURCES: dict = {}
