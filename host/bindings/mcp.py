"""`pie:inferlet/mcp`: tools of the MCP servers the tenant's operator configured
(OutboundLimits.mcp_servers), called through the runtime's outbound loop (host/outbound/).
A call blocks the instance through `Instance.wait_future`; every refusal or failure (an unknown
server, the tenant's requests_per_minute, mcp_timeout_s, max_mcp_result_chars, the server's own
error) is an err naming it."""
from __future__ import annotations

import json
from concurrent.futures import Future

from wasmtime.component import Record, Variant

from host.bindings.context import BindingContext
from host.errors import OutboundRefused, TrapError

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "MAX_ARGUMENT_CHARS"]

INTERFACE = "pie:inferlet/mcp@0.1.0"
MAX_ARGUMENT_CHARS = 1 << 20
MAX_NAME_CHARS = 256


def servers(ctx: BindingContext) -> list[str]:
    return sorted(server.name for server in ctx.tables.outbound.limits.mcp_servers)


def tools(ctx: BindingContext, server: str) -> list[Record] | str:
    call = "mcp.tools"
    try:
        _check_name(server, "server")
        answer = _wait(ctx, call, ctx.tables.outbound.mcp_tools(call, server))
    except OutboundRefused as exc:
        return f"{call}: {exc}"
    return [_tool(name, description, schema) for name, description, schema in answer]


def call(ctx: BindingContext, server: str, tool: str, arguments: str) -> Variant:
    """result<string, string>: both cases are text, so the case is tagged."""
    name = "mcp.call"
    try:
        _check_name(server, "server")
        _check_name(tool, "tool")
        parsed = _arguments(arguments)
        answer = _wait(ctx, name, ctx.tables.outbound.mcp_call(name, server, tool, parsed))
    except OutboundRefused as exc:
        return Variant("err", f"{name}: {exc}")
    return Variant("ok", answer)


def _wait(ctx: BindingContext, call: str, future: Future):
    try:
        return ctx.wait_future(future, call)
    except TrapError:
        raise
    except OutboundRefused:
        raise
    except Exception as exc:  # noqa: BLE001 -- a failure of the call itself
        raise OutboundRefused(f"{type(exc).__name__}: {exc}"[:500]) from None


def _arguments(text: str) -> dict:
    if len(text) > MAX_ARGUMENT_CHARS:
        raise OutboundRefused(f"arguments of {len(text)} characters, more than "
                              f"{MAX_ARGUMENT_CHARS}")
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise OutboundRefused(f"the arguments are not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise OutboundRefused(f"the arguments must be a JSON object, got {type(value).__name__}")
    return value


def _check_name(value: str, what: str) -> None:
    if not value or len(value) > MAX_NAME_CHARS:
        raise OutboundRefused(f"a {what} name must be 1..{MAX_NAME_CHARS} characters")


def _tool(name: str, description: str, schema: str) -> Record:
    record = Record()
    for field, value in (("name", name), ("description", description), ("input-schema", schema)):
        setattr(record, field, value)
    return record


FUNCTIONS = {"servers": servers, "tools": tools, "call": call}
METHODS: dict = {}
RESOURCES: dict = {}
