"""Which servers' certificates an instance's HTTPS request accepts: `tls_context`.

The default CAs (certifi's bundle, what httpx trusts) and, when the operator names one, an extra
PEM bundle (pie.toml `server.outbound_ca_bundle`: a private CA of the operator's own services).
Hostnames are checked against the certificate as usual (the request goes to the checked address,
the TLS server name stays the URL's host). A certificate not accepted is an OutboundRefused
naming the host and the reason (`certificate_error`).
"""
from __future__ import annotations

import ssl

import certifi

from host.outbound.stats import Refused

__all__ = ["tls_context", "certificate_error"]


def tls_context(ca_bundle: str | None = None) -> ssl.SSLContext:
    """A verifying client context: the default CAs plus those of `ca_bundle` (a PEM file);
    ValueError naming the file when it cannot be read or holds no certificate."""
    context = ssl.create_default_context(cafile=certifi.where())
    if ca_bundle:
        try:
            context.load_verify_locations(cafile=ca_bundle)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"outbound_ca_bundle {ca_bundle!r}: not a readable PEM bundle of "
                             f"CA certificates ({exc})") from None
    return context


def certificate_error(exc: BaseException, host: str, port: int,
                      ca_bundle: str | None) -> Refused | None:
    """An OutboundRefused naming `host` when `exc` (or what caused it) is a certificate that
    was not accepted, else None."""
    seen = exc
    for _ in range(8):
        if isinstance(seen, ssl.SSLCertVerificationError):
            reason = seen.verify_message or seen.reason or str(seen)
            trusted = "the default CAs" + (f" and {ca_bundle}" if ca_bundle else "")
            return Refused("tls", f"https://{host}:{port}: the server's TLS certificate is not "
                           f"accepted ({reason}; trusted: {trusted})")
        nxt = seen.__cause__ or seen.__context__
        if nxt is None:
            return None
        seen = nxt
    return None
