"""`pie:inferlet/runtime`: who the instance is and what model it runs on."""
from __future__ import annotations

from wasmtime.component import Record

from host.bindings.context import BindingContext

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES"]

INTERFACE = "pie:inferlet/runtime@0.1.0"
MAX_LOG_CHARS = 8192


def version(ctx: BindingContext) -> str:
    return ctx.services.version


def instance_id(ctx: BindingContext) -> str:
    return ctx.instance_id


def arguments(ctx: BindingContext) -> list[str]:
    return list(ctx.args)


def get_model_info(ctx: BindingContext) -> Record:
    info = ctx.services.model_info
    record = Record()
    for name, value in (("name", info.name), ("page-size", info.page_size),
                        ("vocab-size", info.vocab_size),
                        ("stop-token-ids", list(info.stop_token_ids)),
                        ("chat-template", info.chat_template),
                        ("page-quota", ctx.tables.pages.page_quota),
                        ("max-batch-tokens", info.max_batch_tokens)):
        setattr(record, name, value)
    return record


def log(ctx: BindingContext, message: str) -> None:
    ctx.log(f"log: {message[:MAX_LOG_CHARS]}")


def suspended_ms(ctx: BindingContext) -> int:
    """u64: the time this instance has spent suspended (host/kv/instance_pages.py's gate)."""
    return ctx.tables.pages.suspended_ms()


FUNCTIONS = {"version": version, "instance-id": instance_id, "arguments": arguments,
             "get-model-info": get_model_info, "log": log,
             "suspended-ms": suspended_ms}
METHODS: dict = {}
RESOURCES: dict = {}
