"""One outgoing HTTP request, bounded: `fetch` (a coroutine on the outbound loop).

Every hop -- the first URL and each redirect, followed here by hand, at most max_redirects --
is checked against allow_hosts, its host resolved and every address checked (policy.py), and
the request sent to the checked address (the Host header and TLS SNI keep the name). The whole
exchange, every hop and the body included, ends at timeout_s, so a server that trickles bytes
(slow loris) is cut; the body is read as it streams and the request fails as soon as it passes
max_response_bytes, so a huge answer costs the host at most that much. Bodies travel as sent
(Accept-Encoding: identity): nothing is decompressed on the host. An https hop's certificate is
checked against the client's CAs (tls.py) for the URL's host; one not accepted is refused naming
that host.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin

import httpx

from host.outbound.policy import HostRule, Target, check_addresses, check_url
from host.outbound.stats import Refused
from host.outbound.tls import certificate_error
from host.runtime_config import OutboundLimits

__all__ = ["HttpRequest", "HttpResponse", "fetch", "check_request", "METHODS",
           "MAX_HEADERS", "MAX_HEADER_CHARS"]

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
MAX_HEADERS = 64
MAX_HEADER_CHARS = 16_384          # names and values of one request's headers together
_HOST_SET = frozenset({"host", "content-length", "transfer-encoding", "connection",
                       "accept-encoding", "te", "upgrade", "keep-alive"})
_CROSS_ORIGIN_DROPPED = frozenset({"authorization", "cookie", "proxy-authorization"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_CHUNK_BYTES = 65_536


@dataclass(frozen=True)
class HttpRequest:
    """A request as the guest asked for it (checked by check_request)."""

    method: str
    url: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True)
class HttpResponse:
    """The answer of the last hop: status, headers (lowercase names, in order), the body, and
    the URL that gave it."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    url: str


def check_request(request: HttpRequest, limits: OutboundLimits) -> None:
    """OutboundRefused naming the problem: an unknown method, too many or malformed headers, a
    header the host sets itself, a body past max_request_bytes."""
    if request.method not in METHODS:
        raise Refused("invalid", f"method {request.method[:20]!r} is not one of {sorted(METHODS)}")
    if len(request.headers) > MAX_HEADERS:
        raise Refused("invalid", f"{len(request.headers)} headers, more than {MAX_HEADERS}")
    size = sum(len(name) + len(value) for name, value in request.headers)
    if size > MAX_HEADER_CHARS:
        raise Refused("invalid", f"headers of {size} characters, more than {MAX_HEADER_CHARS}")
    for name, value in request.headers:
        if not name or not set(name) <= _TOKEN:
            raise Refused("invalid", f"header name {name[:64]!r} is not a valid token")
        if name.lower() in _HOST_SET:
            raise Refused("invalid", f"header {name!r} is set by the host")
        if any(c in value for c in "\r\n\0") or not value.isascii():
            raise Refused("invalid",
                          f"header {name!r}: the value must be ASCII without CR, LF, NUL")
    if len(request.body) > limits.max_request_bytes:
        raise Refused("size", f"request body of {len(request.body)} bytes, more than "
                      f"max_request_bytes {limits.max_request_bytes}")


async def fetch(client: httpx.AsyncClient, request: HttpRequest, limits: OutboundLimits,
                rules: tuple[HostRule, ...], ca_bundle: str | None = None) -> HttpResponse:
    """Send `request` (checked) and read its answer, following redirects; OutboundRefused
    naming the cause and the limit on any refusal or failure. `ca_bundle`: the extra CAs the
    client trusts, named in a certificate's refusal."""
    try:
        async with asyncio.timeout(limits.timeout_s):
            return await _follow(client, request, limits, rules, ca_bundle)
    except TimeoutError:
        raise Refused("timeout", f"no complete answer within {limits.timeout_s:g} s "
                      f"(timeout_s)") from None
    except httpx.HTTPError as exc:
        raise Refused("failed", f"{type(exc).__name__}: {exc}"[:500]) from None


async def _follow(client: httpx.AsyncClient, request: HttpRequest, limits: OutboundLimits,
                  rules: tuple[HostRule, ...], ca_bundle: str | None) -> HttpResponse:
    method, url, headers, body = request.method, request.url, list(request.headers), request.body
    origin = None
    for _ in range(limits.max_redirects + 1):
        target = check_url(url, rules)
        if origin is not None and (target.scheme, target.host, target.port) != origin:
            headers = [(n, v) for n, v in headers if n.lower() not in _CROSS_ORIGIN_DROPPED]
        origin = (target.scheme, target.host, target.port)
        response = await _send(client, target, method, headers, body, limits, ca_bundle)
        try:
            location = response.headers.get("location")
            if response.status_code in _REDIRECTS and location:
                url = urljoin(url, location)
                if response.status_code == 303 or (response.status_code in (301, 302)
                                                   and method == "POST"):
                    method, body = ("HEAD" if method == "HEAD" else "GET"), b""
                continue
            data = b"" if method == "HEAD" else await _read_capped(
                response, limits.max_response_bytes)
            return HttpResponse(response.status_code,
                                tuple((k.lower(), v) for k, v in response.headers.items()),
                                data, url)
        finally:
            await response.aclose()
    raise Refused("redirects", f"more than {limits.max_redirects} redirects (max_redirects)")


async def _send(client: httpx.AsyncClient, target: Target, method: str,
                headers: list[tuple[str, str]], body: bytes,
                limits: OutboundLimits, ca_bundle: str | None) -> httpx.Response:
    address = check_addresses(target, await _resolve(target))
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    sent = client.build_request(
        method, target.url_for(address),
        headers=[*headers, ("Host", target.host_header), ("Accept-Encoding", "identity")],
        content=body or None, extensions=extensions, timeout=limits.timeout_s)
    try:
        return await client.send(sent, stream=True)
    except httpx.ConnectError as exc:
        refused = certificate_error(exc, target.host, target.port, ca_bundle)
        if refused is not None:
            raise refused from None
        raise


async def _resolve(target: Target) -> list[str]:
    """The addresses of the target's host (an IP literal is its own, with no resolver call)."""
    try:
        return [str(ipaddress.ip_address(target.host))]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Refused("failed", f"{target.host}: cannot resolve ({exc.strerror})") from None
    return [info[4][0] for info in infos]


async def _read_capped(response: httpx.Response, cap: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise Refused("size", f"a response of {int(declared)} bytes is more than "
                      f"max_response_bytes {cap}")
    chunks, size = [], 0
    async for chunk in response.aiter_raw(_CHUNK_BYTES):
        size += len(chunk)
        if size > cap:
            chunks.clear()          # the error's traceback keeps this frame: drop the bytes now
            raise Refused("size", f"the response passed max_response_bytes {cap}; cut there")
        chunks.append(chunk)
    return b"".join(chunks)
