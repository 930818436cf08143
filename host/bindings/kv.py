"""`pie:inferlet/kv`: pages and host-kept sequences; checks live in host/resources.py."""
from __future__ import annotations

from typing import Any

from host.bindings.queue import queue_priority

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES"]

INTERFACE = "pie:inferlet/kv@0.1.0"


def allocate_pages(instance: Any, num_pages: int) -> list[int]:
    return instance.resources.allocate_pages(num_pages)


def free_pages(instance: Any, page_ids: list[int]) -> None:
    instance.resources.free_pages(page_ids)


def share_pages(instance: Any, page_ids: list[int]) -> list[int]:
    return instance.resources.share_pages(page_ids)


def copy_tokens(instance: Any, queue_id: int, src_page_id: int, dst_page_id: int,
                src_offset: int, dst_offset: int, num_tokens: int) -> None:
    priority = queue_priority(instance, "kv.copy-tokens", queue_id)
    prepared = instance.resources.copy_tokens_request(src_page_id, dst_page_id, src_offset,
                                                      dst_offset, num_tokens)
    instance.services.scheduler.submit_copy((instance.instance_id, queue_id), priority, prepared)


def mask_tokens(instance: Any, page_id: int, offset: int, num_tokens: int, masked: bool) -> None:
    instance.resources.mask_tokens(page_id, offset, num_tokens, masked)


def export_pages(instance: Any, name: str, page_ids: list[int], persistent: bool) -> str | None:
    return instance.resources.export_pages(name, page_ids, persistent)   # None = ok, str = err


def import_pages(instance: Any, name: str) -> list[int] | str:
    return instance.resources.import_pages(name)                         # list = ok, str = err


def list_exports(instance: Any) -> list[str]:
    return instance.resources.list_exports()


def release_export(instance: Any, name: str) -> str | None:
    return instance.resources.release_export(name)


def create_sequence(instance: Any) -> int:
    return instance.resources.create_sequence()


def sequence_append(instance: Any, sequence_id: int, page_ids: list[int]) -> None:
    instance.resources.sequence_append(sequence_id, page_ids)


def sequence_remove(instance: Any, sequence_id: int, index: int, count: int) -> None:
    instance.resources.sequence_remove(sequence_id, index, count)


def sequence_pages(instance: Any, sequence_id: int) -> list[int]:
    return instance.resources.sequence_pages(sequence_id)


def destroy_sequence(instance: Any, sequence_id: int) -> None:
    instance.resources.destroy_sequence(sequence_id)


FUNCTIONS = {
    "allocate-pages": allocate_pages, "free-pages": free_pages, "share-pages": share_pages,
    "copy-tokens": copy_tokens, "mask-tokens": mask_tokens, "export-pages": export_pages,
    "import-pages": import_pages, "list-exports": list_exports,
    "release-export": release_export, "create-sequence": create_sequence,
    "sequence-append": sequence_append, "sequence-remove": sequence_remove,
    "sequence-pages": sequence_pages, "destroy-sequence": destroy_sequence,
}
METHODS: dict = {}
RESOURCES: dict = {}
