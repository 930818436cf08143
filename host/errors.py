"""Exceptions the host raises when a guest misuses its resources.

Every message names the WIT call and the id or cause, e.g. "kv.free-pages: page id 17 was already
freed". The binding layer turns a `TrapError` into a trap of the offending instance only; the engine
and the other instances never see it.
"""
from __future__ import annotations

__all__ = ["TrapError", "OutOfPagesError", "QuotaError", "Cancelled", "LimitError",
           "SpawnRefused", "OutboundRefused"]


class TrapError(Exception):
    """A guest misuse (forged / stale id, double free, bad length, read-only write, ...)."""


class OutOfPagesError(TrapError):
    """The page pool is exhausted and nothing could be reclaimed ("out of KV pages: ...")."""


class QuotaError(TrapError):
    """The instance asked for more pages than its quota allows."""


class Cancelled(TrapError):
    """A blocking call or a pending submission was cut short: the instance was terminated or the
    scheduler / channel was closed. The message says which call and why."""


class LimitError(TrapError):
    """A bounded store of the host is full (a tenant's key-value store, an instance's unread
    client messages, its subscriptions, ...). The message names the call or store and the limit.
    Inside a WIT call it traps the calling instance; from a client (Runtime.send) it is the
    refusal of that one request."""


class SpawnRefused(Exception):
    """A child inferlet was not launched (children.spawn): an unknown program, or a limit
    reached. The message names the program or the limit; the guest gets it as an err."""


class OutboundRefused(Exception):
    """An outgoing HTTP request or MCP call was refused or failed (host/outbound/): a host
    outside allow_hosts, a private address, a limit reached, a timeout, an unreachable server.
    The message names the cause and the limit; the guest gets it as an err, not a trap."""
