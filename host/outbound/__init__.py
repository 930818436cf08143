"""Outgoing requests of instances: HTTP under a tenant's allow_hosts (policy.py, fetch.py) and
MCP tools (mcp_sessions.py), run on one event loop per runtime (service.py), every request
bounded and charged (host.runtime_config.OutboundLimits)."""
from host.outbound.fetch import HttpRequest, HttpResponse
from host.outbound.service import InstanceOutbound, Outbound

__all__ = ["HttpRequest", "HttpResponse", "InstanceOutbound", "Outbound"]
