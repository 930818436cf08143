"""MCP servers reached through the official `mcp` package: `McpSessions` (outbound loop only).

One session per (tenant, configured server), opened on first use and kept: a stdio server is the
operator's command, run as a child process of the host; a URL is a streamable HTTP endpoint.
Each session lives in its own task (the `mcp` client is entered and left there); calls from any
instance of the tenant share it. Every call -- connecting included -- ends at mcp_timeout_s; a
call past it fails naming the limit and the session is closed (its process ended), so a server
that never answers costs one timeout per call and the next call starts it afresh. The answer the
guest gets is JSON text of at most max_mcp_result_chars.
"""
from __future__ import annotations

import asyncio
import json
import os
from contextlib import suppress
from typing import Any

from host.errors import OutboundRefused
from host.outbound.stats import Refused
from host.runtime_config import McpServer, OutboundLimits

__all__ = ["McpSessions", "ToolInfo"]

ToolInfo = tuple[str, str, str]        # name, description, input JSON schema (text)
_CLOSE_S = 5.0


class _Session:
    """One open MCP client, entered and left by its own task."""

    def __init__(self, spec: McpServer, timeout_s: float) -> None:
        self.spec = spec
        self.client: Any = None
        self.failure: str | None = None
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(timeout_s))

    async def _run(self, timeout_s: float) -> None:
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client
        try:
            with open(os.devnull, "w", encoding="utf-8") as errlog:
                if self.spec.url:
                    server: Any = self.spec.url
                else:
                    command, *args = self.spec.command
                    server = stdio_client(StdioServerParameters(command=command, args=args),
                                          errlog=errlog)
                async with Client(server, read_timeout_seconds=timeout_s) as client:
                    self.client = client
                    self.ready.set()
                    await self._stop.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 -- any failure to connect is the answer
            self.failure = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            self.client = None
            self.ready.set()

    async def close(self) -> None:
        """Leave the client (its process ends); cancel it if leaving takes too long."""
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), _CLOSE_S)
        except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
            self._task.cancel()
            with suppress(BaseException):
                await self._task


class McpSessions:
    """The open MCP sessions of a runtime, keyed by (tenant, server). Used on the outbound
    loop only."""

    def __init__(self) -> None:
        self._sessions: dict[tuple[str, McpServer], _Session] = {}
        self._closing: set[asyncio.Task] = set()

    async def list_tools(self, tenant: str, name: str, limits: OutboundLimits) -> list[ToolInfo]:
        """The server's tools; OutboundRefused naming the server and the cause."""
        result = await self._call(tenant, name, limits, "list_tools", lambda c: c.list_tools())
        tools = [(tool.name, tool.description or "", json.dumps(tool.input_schema))
                 for tool in result.tools]
        size = sum(len(a) + len(b) + len(c) for a, b, c in tools)
        _check_size(name, size, limits)
        return tools

    async def call_tool(self, tenant: str, name: str, tool: str, arguments: dict[str, Any],
                        limits: OutboundLimits) -> str:
        """The tool's result as JSON text ({"content": [...], "structuredContent": ...,
        "isError": bool}); OutboundRefused naming the server, the tool and the cause."""
        result = await self._call(tenant, name, limits, f"tool {tool!r}",
                                  lambda c: c.call_tool(tool, arguments))
        text = json.dumps(result.model_dump(mode="json", by_alias=True, exclude_none=True,
                                            exclude={"meta"}))
        _check_size(name, len(text), limits)
        return text

    async def close(self) -> None:
        """Close every session."""
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(session.close() for session in sessions), *self._closing)

    async def _call(self, tenant: str, name: str, limits: OutboundLimits, what: str,
                    send: Any) -> Any:
        spec = next((s for s in limits.mcp_servers if s.name == name), None)
        if spec is None:
            known = ", ".join(s.name for s in limits.mcp_servers) or "none configured"
            raise Refused("invalid", f"no MCP server {name!r} (available: {known})")
        key = (tenant, spec)
        session = self._sessions.get(key)
        if session is None or session.failure is not None:
            session = self._sessions[key] = _Session(spec, limits.mcp_timeout_s)
        try:
            async with asyncio.timeout(limits.mcp_timeout_s):
                await session.ready.wait()
                if session.client is None:
                    raise OutboundRefused(f"MCP server {name!r}: cannot connect: "
                                          f"{session.failure}")
                return await send(session.client)
        except TimeoutError:
            self._drop(key, session)
            raise Refused("timeout", f"MCP server {name!r}: no answer to {what} within "
                          f"{limits.mcp_timeout_s:g} s (mcp_timeout_s)") from None
        except OutboundRefused:
            raise
        except Exception as exc:  # noqa: BLE001 -- a protocol error of this server
            raise OutboundRefused(f"MCP server {name!r}: {what} failed: "
                                  f"{type(exc).__name__}: {exc}"[:500]) from None

    def _drop(self, key: tuple[str, McpServer], session: _Session) -> None:
        """Forget a session that did not answer and close it in the background."""
        if self._sessions.get(key) is session:
            del self._sessions[key]
        task = asyncio.get_running_loop().create_task(session.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _check_size(name: str, size: int, limits: OutboundLimits) -> None:
    if size > limits.max_mcp_result_chars:
        raise Refused("size", f"MCP server {name!r}: an answer of {size} characters is more "
                      f"than max_mcp_result_chars {limits.max_mcp_result_chars}")
