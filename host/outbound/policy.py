"""Where an instance may send a request: its `allow_hosts` and the addresses a name resolves to.

A rule is "HOST[:PORT]" (that host exactly) or ".SUFFIX[:PORT]" (the suffix and its subdomains);
no port means 80 and 443. A URL passes `check_url` when some rule matches its host and port; then
every address its host resolves to must pass `check_addresses`: a loopback, link-local, private
or otherwise non-global address (IPv4-mapped IPv6 included) is refused unless the rule that
matched is that very IP literal. A name therefore never reaches a private range, whatever it
resolves to today (DNS rebinding), and the request goes to the address that was checked.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from host.outbound.stats import Refused
from host.runtime_config import split_host_rule

__all__ = ["HostRule", "Target", "parse_rules", "check_url", "check_addresses", "MAX_URL_CHARS"]

MAX_URL_CHARS = 8192
_DEFAULT_PORTS = {"http": 80, "https": 443}
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class HostRule:
    """One allow_hosts entry: a host (or a ".suffix") and a port (None: 80 and 443)."""

    host: str
    port: int | None

    @property
    def literal(self) -> IpAddress | None:
        """The IP address when the rule names one exactly, else None."""
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    def matches(self, host: str, port: int) -> bool:
        if self.port is None and port not in (80, 443) or self.port not in (None, port):
            return False
        if self.host.startswith("."):
            return host == self.host[1:] or host.endswith(self.host)
        return host == self.host or _same_ip(host, self.host)


@dataclass(frozen=True)
class Target:
    """A checked URL: scheme, host (lowercase, IPv6 without brackets), port, path with query."""

    scheme: str
    host: str
    port: int
    path: str
    rule: HostRule

    @property
    def host_header(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return shown if _DEFAULT_PORTS[self.scheme] == self.port else f"{shown}:{self.port}"

    def url_for(self, address: IpAddress) -> str:
        """The URL with the host replaced by the checked address it is sent to."""
        shown = f"[{address}]" if address.version == 6 else str(address)
        return f"{self.scheme}://{shown}:{self.port}{self.path}"


def parse_rules(allow_hosts: tuple[str, ...]) -> tuple[HostRule, ...]:
    """The rules of allow_hosts (validated already by OutboundLimits)."""
    return tuple(HostRule(*split_host_rule(rule)) for rule in allow_hosts)


def check_url(url: str, rules: tuple[HostRule, ...]) -> Target:
    """The Target of `url`, or OutboundRefused naming why: not http(s), credentials in it, too
    long, or a host and port no rule of allow_hosts matches."""
    if len(url) > MAX_URL_CHARS:
        raise Refused("invalid", f"the URL is {len(url)} characters, more than {MAX_URL_CHARS}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise Refused("invalid", f"not a valid URL: {url[:200]!r} ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise Refused("invalid", f"only http and https URLs are allowed, got {url[:200]!r}")
    if parts.username is not None or parts.password is not None:
        raise Refused("invalid", "credentials in the URL are not allowed; send a header")
    host = (parts.hostname or "").rstrip(".")
    if not host or any(ord(c) < 33 or ord(c) > 126 for c in host):
        raise Refused("invalid", f"the URL {url[:200]!r} has no valid host")
    port = _DEFAULT_PORTS[scheme] if port is None else port
    rule = next((r for r in rules if r.matches(host, port)), None)
    if rule is None:
        raise Refused("allowlist", f"{host}:{port} is not in allow_hosts"
                              + ("" if rules else " (none allowed)"))
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(scheme, host, port, path, rule)


def check_addresses(target: Target, addresses: list[str]) -> IpAddress:
    """The first address to connect to, after checking every one `target.host` resolved to;
    OutboundRefused naming a non-global address no IP literal of allow_hosts lists."""
    if not addresses:
        raise Refused("failed", f"{target.host} resolves to no address")
    checked = []
    for text in addresses:
        address = ipaddress.ip_address(text.split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        effective = mapped or address
        if not effective.is_global or effective.is_multicast:
            if target.rule.literal is None or not _same_ip(str(effective), target.rule.host):
                raise Refused(
                    "private_address", f"{target.host} resolves to {effective}, a non-global "
                    f"address ({_kind(effective)}): only an IP literal in allow_hosts reaches one")
        checked.append(effective)
    return checked[0]


def _same_ip(host: str, rule_host: str) -> bool:
    try:
        return ipaddress.ip_address(host) == ipaddress.ip_address(rule_host)
    except ValueError:
        return False


def _kind(address: IpAddress) -> str:
    for name in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
        if getattr(address, f"is_{name}"):
            return name.replace("_", "-")
    return "non-global"
