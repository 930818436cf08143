"""The sync client, `pie submit`, /health and /metrics against the fake-engine server."""
from __future__ import annotations

import argparse
import logging

import httpx

from host.client import SyncClient
from host.server import commands
from host.client.submit import add_submit_parser
from host.server.commands import add_serve_parser
from tests.server.conftest import TOKENS, wait_until_idle


def test_sync_client_round_trip(fake_server, probe_wasm) -> None:
    with SyncClient(fake_server.url, TOKENS["bob"]) as client:
        program = client.upload(probe_wasm)
        assert program in [p["sha256"] for p in client.list_programs()]
        instance_id = client.launch(program, ["echo"])
        assert [i["instance_id"] for i in client.list_instances()] == [instance_id]
        client.send(instance_id, "ping")
        client.send(instance_id, "quit")
        events = list(client.events(instance_id))
        assert [(e.kind, e.data) for e in events] == [("message", "ping"), ("result", "bye")]
        assert client.model_info()["vocab_size"] == 259
    wait_until_idle(fake_server.url)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie")
    subparsers = parser.add_subparsers()
    add_serve_parser(subparsers)
    add_submit_parser(subparsers)
    return parser


def test_pie_submit_streams_and_reports(fake_server, probe_wasm, tmp_path, capsys) -> None:
    app = tmp_path / "probe.wasm"
    app.write_bytes(probe_wasm)
    args = _parser().parse_args(["submit", str(app), "--server", fake_server.url, "--token",
                                 TOKENS["alice"], "--", "generate", "5"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and "".join(lines[:5]) == lines[5]   # 5 deltas, then the result
    bad = _parser().parse_args(["submit", str(app), "--server", fake_server.url, "--token", "no"])
    assert bad.func(bad) == 1
    assert "authentication failed" in capsys.readouterr().err
    trap = _parser().parse_args(["submit", str(app), "--server", fake_server.url, "--token",
                                 TOKENS["alice"], "--", "forge"])
    assert trap.func(trap) == 3
    assert "trap: kv.free-pages: unknown page id 987654" in capsys.readouterr().err
    missing = _parser().parse_args(["submit", str(tmp_path / "nope.wasm"), "--token", "t"])
    assert missing.func(missing) == 2
    assert "nope.wasm" in capsys.readouterr().err


def test_pie_serve_refuses_a_bad_config(tmp_path, capsys) -> None:
    config = tmp_path / "pie.toml"
    config.write_text("[[tenants]]\nname = 'a'\ntoken = 't'\nmax_instances = -1\n")
    args = _parser().parse_args(["serve", "--config", str(config)])
    assert args.func(args) == 2
    assert "max_instances must be positive, got -1" in capsys.readouterr().err


def test_health_and_metrics(fake_server) -> None:
    health = httpx.get(f"{fake_server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok",
                                                           "model": "fake-byte-model"}
    text = httpx.get(f"{fake_server.url}/metrics").text
    for name in ("pie_instances_running", "pie_kv_pages_used", "pie_kv_pages_free",
                 "pie_kv_pages_exported",
                 "pie_scheduler_queue_depth", "pie_tokens_per_second", "pie_batch_size_bucket",
                 "pie_generated_tokens_total", "pie_instances_launched_total"):
        assert f"\n{name}" in text, name


def test_serve_shows_the_engine_line_on_stderr(capsys) -> None:
    """`pie serve` prints which kernels the engine runs (the engine logs it once at load)."""
    engine_log = logging.getLogger("pie.engine")
    handlers, level = list(engine_log.handlers), engine_log.level
    try:
        commands._show_engine_log()
        engine_log.info("engine: %s", "GGUF blocks (Q4_1) multiplied in place by the avx2 kernels")
        assert ("pie serve: engine: GGUF blocks (Q4_1) multiplied in place by the avx2 kernels"
                in capsys.readouterr().err)
    finally:
        engine_log.handlers[:] = handlers
        engine_log.setLevel(level)
