"""Tools of MCP servers (WIT `mcp`) that the operator configured for the tenant.

    for tool in inferlet.mcp.tools("calc"):
        print(tool.name, tool.description, tool.input_schema)
    result = inferlet.mcp.call("calc", "add", {"a": 2, "b": 3})
    result.text, result.structured, result.is_error

A tool's `input_schema` can constrain the model's arguments, so they always parse and match:

    args = ctx.generate(64, schema=tool.input_schema)      # JSON that fits the tool
    inferlet.mcp.call("calc", tool.name, args)

Errors (an unknown server, a timeout, a limit) raise McpError naming the server and the cause;
a tool that reports its own failure returns a result with `is_error` set.
"""
from __future__ import annotations

import json as _json

from inferlet._wit import Err, mcp
from inferlet.errors import InferletError

__all__ = ["McpError", "Tool", "ToolResult", "servers", "tools", "call"]


class McpError(InferletError):
    """An MCP call the host refused or that failed; the message names the server and cause."""


class Tool:
    """A tool of an MCP server: its name, description and arguments' JSON schema (a dict)."""

    def __init__(self, server: str, name: str, description: str, input_schema: dict) -> None:
        self.server = server
        self.name = name
        self.description = description
        self.input_schema = input_schema

    def call(self, arguments: "dict | str | None" = None) -> "ToolResult":
        """Call this tool (see `call`)."""
        return call(self.server, self.name, arguments)

    def __repr__(self) -> str:
        return f"Tool({self.server!r}, {self.name!r})"


class ToolResult:
    """A tool's answer: `content` (MCP content blocks), `text` (their text joined),
    `structured` (the structured content, if any), `is_error`, and `raw` (the whole JSON)."""

    def __init__(self, raw: dict) -> None:
        self.raw = raw
        self.content = list(raw.get("content") or [])
        self.structured = raw.get("structuredContent")
        self.is_error = bool(raw.get("isError"))

    @property
    def text(self) -> str:
        return "\n".join(block.get("text", "") for block in self.content
                         if isinstance(block, dict) and block.get("type") == "text")

    def __repr__(self) -> str:
        return f"ToolResult(is_error={self.is_error}, text={self.text[:60]!r})"


def servers() -> list[str]:
    """The MCP servers this instance may call, sorted."""
    return list(mcp.servers())


def tools(server: str) -> list[Tool]:
    """The tools of `server` (McpError when it cannot be reached)."""
    try:
        listed = mcp.tools(server)
    except Err as err:
        raise McpError(err.value) from None
    return [Tool(server, t.name, t.description, _json.loads(t.input_schema or "{}"))
            for t in listed]


def call(server: str, tool: str, arguments: "dict | str | None" = None) -> ToolResult:
    """Call `tool` of `server` with `arguments` (a dict, or JSON text such as a constrained
    generation's output); its ToolResult. McpError when the call fails."""
    text = arguments if isinstance(arguments, str) else _json.dumps(arguments or {})
    try:
        answer = mcp.call(server, tool, text)
    except Err as err:
        raise McpError(err.value) from None
    return ToolResult(_json.loads(answer))
