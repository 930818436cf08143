"""The outgoing requests of a runtime's instances: `Outbound` (one per Runtime) and the
`InstanceOutbound` handle each instance gets from it.

Requests and MCP calls run as coroutines on one event loop of the runtime, in its own thread
(`pie-outbound`, started on the first request): a slow server holds a coroutine, never an
instance's thread or another instance's request. A guest's `send` returns at once with a handle;
its `get` waits on a concurrent.futures.Future (Instance.wait_future: terminate and
max_blocking_s wake it).

Charged before anything is sent: requests_per_minute per tenant (a 60 s sliding window, every
request and MCP call of its instances), max_concurrent per instance (requests in flight or
answered but not read: what bounds the host memory an instance's answers hold to max_concurrent
* max_response_bytes). A refusal is an err naming the limit; it touches no other instance.

Counted per tenant (`stats`, stats.py): requests sent and their bytes, answers' bytes read,
refusals by cause, MCP calls and their errors.

HTTPS: the client trusts the default CAs and the operator's extra bundle, if any
(`set_ca_bundle`, before the first request: tls.py).
"""
from __future__ import annotations

import asyncio
import collections
import ssl
import threading
import time
from concurrent.futures import Future
from typing import Any, Coroutine

import httpx

from host.errors import OutboundRefused, TrapError
from host.outbound.fetch import HttpRequest, HttpResponse, check_request, fetch
from host.outbound.mcp_sessions import McpSessions
from host.outbound.policy import check_url, parse_rules
from host.outbound.stats import OutboundStats, Refused
from host.outbound.tls import tls_context
from host.runtime_config import OutboundLimits

__all__ = ["Outbound", "InstanceOutbound", "MAX_LIVE_RESPONSES"]

MAX_LIVE_RESPONSES = 1024      # pending-response handles one instance may hold (refused ones too)
_WINDOW_S = 60.0
_CLOSE_S = 10.0


class Outbound:
    """The runtime's outbound loop, its HTTP client, its MCP sessions and the tenants' request
    windows. Thread-safe; `close` ends the loop (requests in flight fail)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._mcp: McpSessions | None = None
        self._windows: dict[str, collections.deque[float]] = {}
        self._closed = False
        self.stats = OutboundStats()
        self._ca_bundle: str | None = None
        self._tls: ssl.SSLContext | None = None      # made with the client, unless set before

    @property
    def ca_bundle(self) -> str | None:
        """The extra CA bundle HTTPS requests trust (None: the default CAs only)."""
        return self._ca_bundle

    def set_ca_bundle(self, ca_bundle: str | None) -> None:
        """Trust the CAs of `ca_bundle` (a PEM file) besides the default ones; before the first
        request (RuntimeError after it). ValueError naming the file when it holds none."""
        context = tls_context(ca_bundle)
        with self._lock:
            if self._loop is not None:
                raise RuntimeError("set_ca_bundle: requests were made already")
            self._ca_bundle, self._tls = ca_bundle or None, context

    def for_instance(self, tenant: str, limits: OutboundLimits) -> "InstanceOutbound":
        """The handle of one instance of `tenant`, bound by `limits`."""
        return InstanceOutbound(self, tenant, limits)

    def charge(self, tenant: str, limits: OutboundLimits) -> None:
        """Count one request of `tenant`; OutboundRefused when its last minute is full."""
        now = time.monotonic()
        with self._lock:
            window = self._windows.setdefault(tenant, collections.deque())
            while window and now - window[0] >= _WINDOW_S:
                window.popleft()
            if len(window) >= limits.requests_per_minute:
                raise Refused("rate", f"{len(window)} requests of this tenant in the last "
                              f"minute, its limit (requests_per_minute "
                              f"{limits.requests_per_minute})")
            window.append(now)

    def submit(self, make: Any) -> Future:
        """Run `make(client, mcp)`'s coroutine on the loop; its Future."""
        loop = self._started()
        return asyncio.run_coroutine_threadsafe(self._with_parts(make), loop)

    def close(self) -> None:
        """Close the MCP sessions and the client, stop the loop and its thread (idempotent)."""
        with self._lock:
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        done = asyncio.run_coroutine_threadsafe(self._close_parts(), loop)
        try:
            done.result(_CLOSE_S)
        except Exception:  # noqa: BLE001 -- closing goes on regardless
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_CLOSE_S)
        if not thread.is_alive():
            loop.close()

    async def _with_parts(self, make: Any) -> Any:
        if self._client is None:
            self._client = httpx.AsyncClient(
                trust_env=False, follow_redirects=False, verify=self._tls or tls_context(),
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
            self._mcp = McpSessions()
        coroutine: Coroutine = make(self._client, self._mcp)
        return await coroutine

    async def _close_parts(self) -> None:
        if self._mcp is not None:
            await self._mcp.close()
        if self._client is not None:
            await self._client.aclose()
        await asyncio.get_running_loop().shutdown_asyncgens()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise Refused("failed", "the runtime is closing: no outgoing requests")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="pie-outbound",
                                          daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop


class _Pending:
    """A pending-response: its future (None when refused at once) and its error, if refused."""

    __slots__ = ("future", "error", "counted")

    def __init__(self, future: Future | None, error: str | None) -> None:
        self.future = future
        self.error = error
        self.counted = future is not None      # holds one of max_concurrent


class InstanceOutbound:
    """One instance's outgoing requests: its pending-responses (rep -> entry) and MCP calls.
    Used from the instance's thread only; `clear` at its end cancels what is in flight."""

    def __init__(self, outbound: Outbound, tenant: str, limits: OutboundLimits) -> None:
        self.tenant = tenant
        self.limits = limits
        self._outbound = outbound
        self._rules = parse_rules(limits.allow_hosts)
        self._pending: dict[int, _Pending] = {}
        self._next_rep = 1
        self._num_counted = 0

    @property
    def num_in_flight(self) -> int:
        """Requests in flight or answered and not yet read."""
        return self._num_counted

    def send(self, call: str, request: HttpRequest) -> int:
        """Start `request`; the rep of its pending-response (a refusal is kept as its err).
        TrapError past MAX_LIVE_RESPONSES handles."""
        if len(self._pending) >= MAX_LIVE_RESPONSES:
            raise TrapError(f"{call}: {MAX_LIVE_RESPONSES} pending-responses alive; drop some")
        rep = self._next_rep
        self._next_rep += 1
        try:
            self._admit(call, request)
            future = self._outbound.submit(lambda client, _mcp: self._fetch(client, request))
        except OutboundRefused as exc:
            self._outbound.stats.refused(self.tenant, exc)
            self._pending[rep] = _Pending(None, f"{call}: {exc}")
            return rep
        self._outbound.stats.request_sent(self.tenant, len(request.body))
        self._pending[rep] = _Pending(future, None)
        self._num_counted += 1
        return rep

    def future_of(self, call: str, rep: int) -> Future | None:
        """The future of a pending-response (None: refused at once); TrapError on an unknown
        rep or one already read."""
        entry = self._pending.get(rep)
        if entry is None:
            raise TrapError(f"{call}: unknown or already read pending-response {rep}")
        return entry.future

    def take(self, call: str, rep: int) -> HttpResponse | str:
        """The answer (after its future resolved) or the err text; the handle is then spent
        and its max_concurrent slot free."""
        entry = self._pending.pop(rep, None)
        if entry is None:
            raise TrapError(f"{call}: unknown or already read pending-response {rep}")
        self._release(entry)
        if entry.error is not None:
            return entry.error
        assert entry.future is not None
        try:
            return entry.future.result(0)
        except OutboundRefused as exc:
            return f"{call}: {exc}"
        except Exception as exc:  # noqa: BLE001 -- anything else the request raised
            return f"{call}: {type(exc).__name__}: {exc}"[:500]

    def drop(self, rep: int) -> None:
        """The guest dropped the handle: cancel it if in flight."""
        entry = self._pending.pop(rep, None)
        if entry is not None:
            self._release(entry)

    def mcp_tools(self, call: str, server: str) -> Future:
        """A future of the server's tools ((name, description, schema) tuples); charged as one
        request (OutboundRefused when the tenant's minute is full)."""
        tenant, limits = self.tenant, self.limits
        return self._mcp(server, lambda mcp: mcp.list_tools(tenant, server, limits))

    def mcp_call(self, call: str, server: str, tool: str, arguments: dict) -> Future:
        """A future of the tool's JSON result text; charged as one request."""
        tenant, limits = self.tenant, self.limits
        return self._mcp(server, lambda mcp: mcp.call_tool(tenant, server, tool, arguments,
                                                           limits))

    def clear(self) -> None:
        """At the instance's end: every request in flight cancelled, every answer dropped."""
        for entry in self._pending.values():
            self._release(entry)
        self._pending.clear()

    async def _fetch(self, client: httpx.AsyncClient, request: HttpRequest) -> HttpResponse:
        """`fetch` with its answer's bytes or its refusal counted (on the outbound loop)."""
        stats = self._outbound.stats
        try:
            response = await fetch(client, request, self.limits, self._rules,
                                   self._outbound.ca_bundle)
        except Exception as exc:
            stats.refused(self.tenant, exc)
            raise
        stats.answer_read(self.tenant, len(response.body))
        return response

    def _mcp(self, server: str, make: Any) -> Future:
        """Check, charge, count and start one MCP call `make(sessions)`."""
        stats, tenant = self._outbound.stats, self.tenant
        stats.mcp_sent(tenant)
        try:
            self._check_server(server)
            self._outbound.charge(tenant, self.limits)
        except OutboundRefused as exc:
            stats.refused(tenant, exc)
            stats.mcp_failed(tenant)
            raise

        async def counted(_client: httpx.AsyncClient, sessions: McpSessions) -> Any:
            try:
                return await make(sessions)
            except Exception as exc:
                stats.refused(tenant, exc)
                stats.mcp_failed(tenant)
                raise
        return self._outbound.submit(counted)

    def _check_server(self, server: str) -> None:
        if not any(spec.name == server for spec in self.limits.mcp_servers):
            known = ", ".join(s.name for s in self.limits.mcp_servers) or "none configured"
            raise Refused("invalid", f"no MCP server {server[:64]!r} (available: {known})")

    def _admit(self, call: str, request: HttpRequest) -> None:
        check_request(request, self.limits)
        if self._num_counted >= self.limits.max_concurrent:
            raise Refused("concurrency", f"{self._num_counted} requests of this instance in "
                          f"flight or unread, its limit (max_concurrent "
                          f"{self.limits.max_concurrent})")
        check_url(request.url, self._rules)
        self._outbound.charge(self.tenant, self.limits)

    def _release(self, entry: _Pending) -> None:
        if entry.counted:
            entry.counted = False
            self._num_counted -= 1
        if entry.future is not None and not entry.future.done():
            entry.future.cancel()

