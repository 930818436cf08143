"""`pie:inferlet/kv`: pages and host-kept sequences; checks live in host/kv/instance_pages.py."""
from __future__ import annotations

from host.bindings.context import BindingContext

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES"]

INTERFACE = "pie:inferlet/kv@0.1.0"


def allocate_pages(ctx: BindingContext, num_pages: int) -> list[int]:
    return ctx.tables.pages.allocate_pages(num_pages)


def free_pages(ctx: BindingContext, page_ids: list[int]) -> None:
    ctx.tables.pages.free_pages(page_ids)


def share_pages(ctx: BindingContext, page_ids: list[int]) -> list[int]:
    return ctx.tables.pages.share_pages(page_ids)


def copy_tokens(ctx: BindingContext, queue_id: int, src_page_id: int, dst_page_id: int,
                src_offset: int, dst_offset: int, num_tokens: int) -> None:
    priority = ctx.tables.queues.priority("kv.copy-tokens", queue_id)
    prepared = ctx.tables.pages.copy_tokens_request(src_page_id, dst_page_id, src_offset,
                                                      dst_offset, num_tokens)
    ctx.services.scheduler.submit_copy((ctx.instance_id, queue_id), priority, prepared)


def mask_tokens(ctx: BindingContext, page_id: int, offset: int, num_tokens: int, masked: bool) -> None:
    ctx.tables.pages.mask_tokens(page_id, offset, num_tokens, masked)


def export_pages(ctx: BindingContext, name: str, page_ids: list[int], persistent: bool) -> str | None:
    return ctx.tables.pages.export_pages(name, page_ids, persistent)   # None = ok, str = err


def import_pages(ctx: BindingContext, name: str) -> list[int] | str:
    return ctx.tables.pages.import_pages(name)                         # list = ok, str = err


def list_exports(ctx: BindingContext) -> list[str]:
    return ctx.tables.pages.list_exports()


def release_export(ctx: BindingContext, name: str) -> str | None:
    return ctx.tables.pages.release_export(name)


def create_sequence(ctx: BindingContext) -> int:
    return ctx.tables.pages.create_sequence()


def sequence_append(ctx: BindingContext, sequence_id: int, page_ids: list[int]) -> None:
    ctx.tables.pages.sequence_append(sequence_id, page_ids)


def sequence_remove(ctx: BindingContext, sequence_id: int, index: int, count: int) -> None:
    ctx.tables.pages.sequence_remove(sequence_id, index, count)


def sequence_pages(ctx: BindingContext, sequence_id: int) -> list[int]:
    return ctx.tables.pages.sequence_pages(sequence_id)


def destroy_sequence(ctx: BindingContext, sequence_id: int) -> None:
    ctx.tables.pages.destroy_sequence(sequence_id)


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
