"""A tenant's [tenants.outbound] reaches its instances on a real server (real Runtime, fake
engine): the tenant allowed the tool server gets its answer, another tenant with nothing
configured is refused naming the allowlist, and a third's requests_per_minute is its own.
Servers on 127.0.0.1 only."""
from __future__ import annotations

import json

import pytest

from host.client import SyncClient
from host.sandbox.programs.build import build_cached
from host.server.server_config import parse_config
from tests.host.fake_engine import FakeEngine
from tests.host.servers.tool_server import ToolServer, search_results
from tests.inferlets.conftest import CACHE_DIR as INFERLET_CACHE   # the probe's build, shared
from tests.server.conftest import REPO_DIR
from tests.server.harness import ServerThread

PROBE = REPO_DIR / "tests" / "inferlets" / "apps" / "outbound_probe.py"
TOKENS = {"allowed": "tok-allowed", "closed": "tok-closed", "limited": "tok-limited"}


@pytest.fixture(scope="module")
def tool_server():
    with ToolServer() as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tool_server):
    allow = [f"127.0.0.1:{tool_server.port}"]
    config = parse_config({
        "server": {"data_dir": str(tmp_path_factory.mktemp("pie-data")), "openai": False,
                   "shutdown_grace_s": 1.0},
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
