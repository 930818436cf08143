"""`pie:inferlet/runtime`: who the instance is and what model it runs on."""
from __future__ import annotations

from typing import Any

from wasmtime.component import Record

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES"]

INTERFACE = "pie:inferlet/runtime@0.1.0"
MAX_LOG_CHARS = 8192


def version(instance: Any) -> str:
    return instance.services.version


def instance_id(instance: Any) -> str:
    return instance.instance_id


def arguments(instance: Any) -> list[str]:
    return list(instance.args)


def get_model_info(instance: Any) -> Record:
    info = instance.services.model_info
    record = Record()
    for name, value in (("name", info.name), ("page-size", info.page_size),
                        ("vocab-size", info.vocab_size),
                        ("stop-token-ids", list(info.stop_token_ids)),
                        ("chat-template", info.chat_template),
                        ("page-quota", instance.resources.page_quota),
                        ("max-batch-tokens", info.max_batch_tokens)):
        setattr(record, name, value)
    return record


def log(instance: Any, message: str) -> None:
    instance.log(f"log: {message[:MAX_LOG_CHARS]}")


FUNCTIONS = {"version": version, "instance-id": instance_id, "arguments": arguments,
             "get-model-info": get_model_info, "log": log}
METHODS: dict = {}
RESOURCES: dict = {}
