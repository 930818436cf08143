"""What a runtime's instances made the host spend outside it, per tenant: `OutboundStats`.

Requests sent (HTTP, with the bytes of their bodies out and of the answers read in), refusals
by cause (`REFUSAL_CAUSES`), MCP calls and those that failed. A refusal's cause travels on the
exception (`Refused`, an OutboundRefused with a `cause`); one raised without a cause counts as
"failed". Counters only grow; `snapshot` copies them for /metrics.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from host.errors import OutboundRefused

__all__ = ["OutboundStats", "TenantOutbound", "Refused", "REFUSAL_CAUSES", "cause_of"]

REFUSAL_CAUSES = (
    "allowlist",        # a host and port no rule of allow_hosts matches
    "private_address",  # a name resolving to a loopback / private / non-global address
    "size",             # a request body past max_request_bytes, an answer past max_response_bytes
    "timeout",          # no complete answer within timeout_s (mcp_timeout_s for MCP)
    "rate",             # the tenant's requests_per_minute
    "concurrency",      # the instance's max_concurrent
    "redirects",        # past max_redirects
    "tls",              # a certificate not accepted
    "invalid",          # a malformed request: method, headers, URL, an unknown MCP server
    "failed",           # the server could not be reached or answered badly
)


class Refused(OutboundRefused):
    """An OutboundRefused naming its cause (one of REFUSAL_CAUSES) for the counters."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause

    def __reduce__(self) -> tuple:
        return (type(self), (self.cause, str(self)))


def cause_of(error: BaseException) -> str:
    """The refusal cause of `error` ("failed" when it names none)."""
    cause = getattr(error, "cause", None)
    return cause if cause in REFUSAL_CAUSES else "failed"


@dataclass(frozen=True)
class TenantOutbound:
    """One tenant's counters since the runtime started."""

    num_requests: int = 0            # HTTP requests sent (each admitted one, its redirects not)
    num_bytes_out: int = 0           # request bodies sent
    num_bytes_in: int = 0            # answer bodies read
    refusals: dict[str, int] = field(default_factory=dict)   # cause -> HTTP and MCP refusals
    num_mcp_calls: int = 0           # MCP tool lists and calls sent
    num_mcp_errors: int = 0          # those that ended in an error (a refusal, a failure)


@dataclass
class _Counts:
    num_requests: int = 0
    num_bytes_out: int = 0
    num_bytes_in: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    num_mcp_calls: int = 0
    num_mcp_errors: int = 0


class OutboundStats:
    """The per-tenant counters of one runtime's outbound calls. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tenants: dict[str, _Counts] = {}

    def request_sent(self, tenant: str, num_bytes_out: int) -> None:
        with self._lock:
            counts = self._counts(tenant)
            counts.num_requests += 1
            counts.num_bytes_out += num_bytes_out

    def answer_read(self, tenant: str, num_bytes_in: int) -> None:
        with self._lock:
            self._counts(tenant).num_bytes_in += num_bytes_in

    def refused(self, tenant: str, error: BaseException) -> None:
        """Count one refusal by the cause `error` names."""
        cause = cause_of(error)
        with self._lock:
            refusals = self._counts(tenant).refusals
            refusals[cause] = refusals.get(cause, 0) + 1

    def mcp_sent(self, tenant: str) -> None:
        with self._lock:
            self._counts(tenant).num_mcp_calls += 1

    def mcp_failed(self, tenant: str) -> None:
        with self._lock:
            self._counts(tenant).num_mcp_errors += 1

    def snapshot(self) -> dict[str, TenantOutbound]:
        """A copy of every tenant's counters (tenants that made no call are absent)."""
        with self._lock:
            return {tenant: TenantOutbound(c.num_requests, c.num_bytes_out, c.num_bytes_in,
                                           dict(c.refusals), c.num_mcp_calls, c.num_mcp_errors)
                    for tenant, c in self._tenants.items()}

    def _counts(self, tenant: str) -> _Counts:
        counts = self._tenants.get(tenant)
        if counts is None:
            counts = self._tenants[tenant] = _Counts()
        return counts
