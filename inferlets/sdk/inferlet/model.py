"""The model the inferlet runs on: its info and its tokenizer (host calls, cached per instance)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from inferlet._wit import runtime, tokenize

__all__ = ["ModelInfo", "model_info", "encode", "decode", "vocabulary", "render_chat",
           "arguments", "instance_id", "host_version", "log", "suspended_ms"]


@dataclass(frozen=True)
class ModelInfo:
    """The model as this instance sees it (see wit `runtime.model-info`)."""

    name: str
    page_size: int                 # tokens per KV page
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    chat_template: str             # raw jinja2 text, "" when the model has none
    page_quota: int                # most KV pages this instance may hold at once
    max_batch_tokens: int          # most input tokens one forward pass may carry


@functools.cache
def model_info() -> ModelInfo:
    """The model and this instance's limits (one host call, then cached)."""
    info = runtime.get_model_info()
    return ModelInfo(name=info.name, page_size=info.page_size, vocab_size=info.vocab_size,
                     stop_token_ids=tuple(info.stop_token_ids), chat_template=info.chat_template,
                     page_quota=info.page_quota, max_batch_tokens=info.max_batch_tokens)


def encode(text: str) -> list[int]:
    """Token ids of `text` (no special tokens added)."""
    return list(tokenize.encode(text)) if text else []


def decode(token_ids: list[int]) -> str:
    """Text of `token_ids` (special tokens are rendered as their text)."""
    return tokenize.decode(list(token_ids)) if token_ids else ""


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """Entry i is token i's string. Large: one host call, then cached."""
    return tuple(tokenize.vocabulary())


def render_chat(messages: list[tuple[str, str]], add_generation_prompt: bool) -> str:
    """Render (role, content) pairs with the model's chat template."""
    wit_messages = [tokenize.Message(role=role, content=content) for role, content in messages]
    return tokenize.render_chat(wit_messages, add_generation_prompt)


def arguments() -> list[str]:
    """The instance's own arguments (no program name)."""
    return list(runtime.arguments())


def instance_id() -> str:
    """This instance's id, unique within the host."""
    return runtime.instance_id()


def host_version() -> str:
    """The host's version string, e.g. "pie 0.1.0"."""
    return runtime.version()


def log(message: str) -> None:
    """Write a line to the instance's log."""
    runtime.log(message)


def suspended_ms() -> int:
    """Milliseconds this instance has spent suspended so far (0 if never): when the KV pool ran
    dry its pages were moved out, and its calls waited until they were back. Nothing else of a
    suspension is visible to an inferlet."""
    return runtime.suspended_ms()
