"""HTTPS from instances (host/outbound/tls.py, fetch.py): a local TLS server whose certificate a
CA made in the test signs. Trusted through the operator's extra CA bundle it answers; untrusted,
or issued for another name, it is refused naming the host; a redirect from https to a private
address is still refused; a bad bundle is refused naming the file."""
from __future__ import annotations

import ssl

import pytest
import trustme

from host.outbound import HttpRequest, HttpResponse, Outbound
from host.runtime_config import OutboundLimits
from tests.host.outbound_calls import fetch
from tests.host.servers.tool_server import ToolServer


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def _server_context(ca: trustme.CA, *names: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    return context


@pytest.fixture(scope="module")
def tls_server(ca):
    with ToolServer(tls=_server_context(ca, "127.0.0.1")) as running:
        yield running


def _fetch(outbound: Outbound, server: ToolServer, url: str) -> HttpResponse | str:
    limits = OutboundLimits(allow_hosts=(f"127.0.0.1:{server.port}",), timeout_s=10.0)
    handle = outbound.for_instance("t", limits)
    return fetch(handle, url)


def test_an_https_server_signed_by_the_operators_ca_answers(tls_server, ca_file):
    outbound = Outbound()
    try:
        outbound.set_ca_bundle(ca_file)
        answer = _fetch(outbound, tls_server, tls_server.url("/search?q=tls"))
        assert isinstance(answer, HttpResponse), answer
        assert answer.status == 200 and b'"query": "tls"' in answer.body
        assert answer.url.startswith("https://127.0.0.1:")
    finally:
        outbound.close()


def test_a_certificate_no_trusted_ca_signed_is_refused_naming_the_host(tls_server):
    outbound = Outbound()          # the default CAs only
    try:
        answer = _fetch(outbound, tls_server, tls_server.url("/search?q=x"))
    finally:
        outbound.close()
    assert isinstance(answer, str)
    assert f"https://127.0.0.1:{tls_server.port}: the server's TLS certificate is not " \
           f"accepted" in answer
    assert "trusted: the default CAs)" in answer


def test_a_certificate_for_another_name_is_refused(ca, ca_file):
    with ToolServer(tls=_server_context(ca, "tools.example.test")) as other:
        outbound = Outbound()
        try:
            outbound.set_ca_bundle(ca_file)
            answer = _fetch(outbound, other, other.url("/search?q=x"))
            port = other.port
        finally:
            outbound.close()
    assert isinstance(answer, str)
    assert f"https://127.0.0.1:{port}: the server's TLS certificate is not accepted" \
           in answer and "IP address mismatch" in answer and ca_file in answer


def test_a_redirect_from_https_to_a_private_address_is_refused(tls_server, ca_file):
    outbound = Outbound()
    try:
        outbound.set_ca_bundle(ca_file)
        followed = _fetch(outbound, tls_server, tls_server.url("/redirect?to=/search?q=hop"))
        assert isinstance(followed, HttpResponse) and followed.status == 200
        for to, cause in (("http://10.0.0.1/", "10.0.0.1:80 is not in allow_hosts"),
                          (f"https://localhost:{tls_server.port}/search",
                           f"localhost:{tls_server.port} is not in allow_hosts")):
            answer = _fetch(outbound, tls_server, tls_server.url(f"/redirect?to={to}"))
            assert isinstance(answer, str) and cause in answer, answer
    finally:
        outbound.close()


def test_a_name_allowed_still_never_reaches_a_private_address_over_https(tls_server, ca_file):
    outbound = Outbound()
    try:
        outbound.set_ca_bundle(ca_file)
        limits = OutboundLimits(allow_hosts=(f"127.0.0.1:{tls_server.port}",
                                             f"localhost:{tls_server.port}"), timeout_s=10.0)
        handle = outbound.for_instance("t", limits)
        url = tls_server.url(f"/redirect?to=https://localhost:{tls_server.port}/search")
        rep = handle.send("http.send", HttpRequest("GET", url, (), b""))
        handle.future_of("get", rep).exception(30)
        answer = handle.take("http.send", rep)
    finally:
        outbound.close()
    assert isinstance(answer, str)
    assert "localhost resolves to" in answer and "non-global address (loopback)" in answer


def test_a_bad_ca_bundle_is_refused_naming_the_file(tmp_path, ca_file, tls_server):
    bad = tmp_path / "not-a-ca.pem"
    bad.write_text("not a certificate\n")
    outbound = Outbound()
    try:
        for path in (str(bad), str(tmp_path / "missing.pem")):
            with pytest.raises(ValueError, match=f"outbound_ca_bundle '{path}'"):
                outbound.set_ca_bundle(path)
        _fetch(outbound, tls_server, tls_server.url("/search?q=x"))
        with pytest.raises(RuntimeError, match="requests were made already"):
            outbound.set_ca_bundle(ca_file)
    finally:
        outbound.close()


def test_pie_run_refuses_a_bad_ca_bundle_before_the_model_loads(tmp_path, ca_file, capsys):
    from host.cli import EXIT_USAGE, _check_ca_bundle, build_parser, main
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    assert main(["run", str(tmp_path / "app.py"), "--ca-bundle", str(bad)]) == EXIT_USAGE
    assert f"pie run: --ca-bundle '{bad}': not a readable PEM bundle" in capsys.readouterr().err
    _check_ca_bundle(ca_file)                                      # a good one passes
    assert build_parser().parse_args(["run", "app.py", "--ca-bundle", ca_file]).ca_bundle == \
        ca_file
