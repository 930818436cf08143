"""A tenant's [tenants.outbound] reaches its instances on a real server (real Runtime, fake
engine): the tenant allowed the tool server gets its answer, another tenant with nothing
configured is refused naming the allowlist, and a third's requests_per_minute is its own;
HTTPS to a server under the operator's CA (server.outbound_ca_bundle); /metrics counts each
tenant's requests, bytes and refusals by cause. Servers on 127.0.0.1 only."""
from __future__ import annotations

import json
import ssl

import pytest
import trustme

from host.client import SyncClient
from host.sandbox.programs.build import build_cached
from host.server.server_config import ConfigError, parse_config
from tests.host.fake_engine import FakeEngine
from tests.host.servers.tool_server import ToolServer, search_results
from tests.inferlets.conftest import CACHE_DIR as INFERLET_CACHE   # the probe's build, shared
from tests.server.conftest import REPO_DIR, scrape
from tests.server.harness import ServerThread

PROBE = REPO_DIR / "tests" / "inferlets" / "apps" / "outbound_probe.py"
TOKENS = {"allowed": "tok-allowed", "closed": "tok-closed", "limited": "tok-limited"}


@pytest.fixture(scope="module")
def tool_server():
    with ToolServer() as server:
        yield server


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tls_server(ca):
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    with ToolServer(tls=context) as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tool_server, tls_server, ca_file):
    allow = [f"127.0.0.1:{tool_server.port}", f"127.0.0.1:{tls_server.port}"]
    config = parse_config({
        "server": {"data_dir": str(tmp_path_factory.mktemp("pie-data")), "openai": False,
                   "shutdown_grace_s": 1.0, "outbound_ca_bundle": ca_file},
        "tenants": [
            {"name": "allowed", "token": TOKENS["allowed"], "outbound": {"allow_hosts": allow}},
            {"name": "closed", "token": TOKENS["closed"]},
            {"name": "limited", "token": TOKENS["limited"],
             "outbound": {"allow_hosts": allow, "requests_per_minute": 1}}]})
    engine = FakeEngine(num_pages=256, page_size=16, batch_delay_s=0.002, keep_log=False)
    running = ServerThread(config, engine).start()
    yield running
    running.stop()


def _run(server, tenant: str, args: list[str]) -> dict:
    with SyncClient(server.url, TOKENS[tenant]) as client:
        program = client.upload(build_cached(PROBE, INFERLET_CACHE / "builds")[0].read_bytes())
        final = client.wait(client.launch(program, args))
    assert final.kind == "result", final
    return json.loads(final.data)


def test_each_tenant_reaches_what_its_operator_allowed(server, tool_server):
    url = tool_server.url("/search?q=tenant")
    allowed = _run(server, "allowed", ["get", url])
    assert allowed["status"] == 200 and json.loads(allowed["text"])["results"] == \
        search_results("tenant")
    closed = _run(server, "closed", ["get", url])
    assert f"127.0.0.1:{tool_server.port} is not in allow_hosts (none allowed)" in closed["error"]
    assert _run(server, "limited", ["get", url])["status"] == 200
    refused = _run(server, "limited", ["get", url])
    assert "its limit (requests_per_minute 1)" in refused["error"]
    assert _run(server, "allowed", ["get", url])["status"] == 200    # the others' own minute


def test_https_reaches_a_server_under_the_operators_ca(server, tls_server):
    answer = _run(server, "allowed", ["get", tls_server.url("/search?q=tls")])
    assert answer["status"] == 200 and json.loads(answer["text"])["results"] == \
        search_results("tls")
    assert answer["url"].startswith("https://127.0.0.1:")


def test_metrics_count_each_tenants_requests_bytes_and_refusals(server, tool_server):
    before = scrape(server.url)
    url = tool_server.url("/search?q=metrics")
    answer = _run(server, "allowed", ["get", url])
    _run(server, "allowed", ["get", "http://example.com/"])
    _run(server, "closed", ["get", url])
    after = scrape(server.url)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    assert grew('pie_outbound_requests_total{tenant="allowed"}') == 1
    assert grew('pie_outbound_bytes_in_total{tenant="allowed"}') == len(answer["text"])
    assert grew('pie_outbound_refusals_total{cause="allowlist",tenant="allowed"}') == 1
    assert grew('pie_outbound_refusals_total{cause="allowlist",tenant="closed"}') == 1
    assert grew('pie_outbound_requests_total{tenant="closed"}') == 0


def test_a_ca_bundle_that_holds_no_certificate_stops_the_config(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("no certificate here\n")
    for path in (bad, tmp_path / "missing.pem"):
        with pytest.raises(ConfigError, match=f"server.outbound_ca_bundle '{path}': not a "
                                              f"readable PEM bundle"):
            parse_config({"server": {"outbound_ca_bundle": str(path)},
                          "tenants": [{"name": "a", "token": "t"}]})
