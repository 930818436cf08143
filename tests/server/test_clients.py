"""The sync client, `pie submit`, /health and /metrics against the fake-engine server."""
from __future__ import annotations

import argparse
import io
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from host.client import PieError, SyncClient
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


def _submit(fake_server, app, *options: str, token: str = TOKENS["alice"]) -> argparse.Namespace:
    return _parser().parse_args(["submit", str(app), "--server", fake_server.url, "--token",
                                 token, *options])


def test_pie_submit_forwards_stdin_lines_as_messages(fake_server, probe_wasm, tmp_path, capsys,
                                                     monkeypatch) -> None:
    app = tmp_path / "probe.wasm"
    app.write_bytes(probe_wasm)
    monkeypatch.setattr(sys, "stdin", io.StringIO("ping\npong\nquit\n"))
    args = _submit(fake_server, app, "--", "echo")
    assert args.func(args) == 0
    assert capsys.readouterr().out.splitlines() == ["ping", "pong", "bye"]
    wait_until_idle(fake_server.url)


@pytest.mark.parametrize("options, stdin, hint", [
    ((), "", "stdin has ended"),                      # stdin at its end before the instance reads
    (("--no-stdin",), "quit\n", "--no-stdin"),        # a line there, not forwarded
])
def test_pie_submit_says_when_the_instance_waits_and_another_connection_may_send(
        fake_server, probe_wasm, tmp_path, monkeypatch, options, stdin, hint) -> None:
    """The echo instance waits in receive(): `pie submit` says so on stderr (list_instances
    answers waiting_for_input), and a second connection of the same tenant may send to it."""
    app = tmp_path / "probe.wasm"
    app.write_bytes(probe_wasm)
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    args = _submit(fake_server, app, *options, "--", "echo")
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(args.func(args)))
    thread.start()
    try:
        with SyncClient(fake_server.url, TOKENS["alice"]) as other:
            deadline = time.monotonic() + 20
            while "is waiting for input" not in err.getvalue():
                assert time.monotonic() < deadline, err.getvalue()
                time.sleep(0.05)
            assert hint in err.getvalue()
            [listed] = other.list_instances()
            assert listed["waiting_for_input"] is True
            other.send(listed["instance_id"], "quit")
            thread.join(20)
    finally:
        thread.join(20)
    assert status == [0] and out.getvalue().splitlines() == ["bye"]
    wait_until_idle(fake_server.url)


def test_pie_submit_logs_and_the_logs_request(fake_server, probe_wasm, tmp_path,
                                              capsys, monkeypatch) -> None:
    """--logs prints the instance's inferlet.log and print lines once it has ended; the `logs`
    request answers them to its tenant only, after the end too."""
    app = tmp_path / "probe.wasm"
    app.write_bytes(probe_wasm)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    args = _submit(fake_server, app, "--logs", "--", "log")
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["logged"]
    assert "  log: from inferlet.log\n" in captured.err and "  stdout: from print\n" in captured.err
    with SyncClient(fake_server.url, TOKENS["alice"]) as client:
        instance_id = client.launch(client.upload(probe_wasm), ["log"])
        assert client.wait(instance_id).data == "logged"
        assert client.logs(instance_id) == ["log: from inferlet.log", "stdout: from print"]
    with SyncClient(fake_server.url, TOKENS["bob"]) as other:
        with pytest.raises(PieError, match="unknown instance"):
            other.logs(instance_id)
    wait_until_idle(fake_server.url)


def test_pie_submit_ctrl_c_terminates_the_instance_and_says_so(fake_server, probe_wasm,
                                                               tmp_path) -> None:
    app = tmp_path / "probe.wasm"
    app.write_bytes(probe_wasm)
    process = subprocess.Popen(
        [sys.executable, "-m", "host.cli", "submit", str(app), "--server", fake_server.url,
         "--token", TOKENS["bob"], "--no-stdin", "--", "echo"],
        cwd=Path(__file__).resolve().parents[2], stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with SyncClient(fake_server.url, TOKENS["bob"]) as client:
            deadline = time.monotonic() + 60
            while not any(i["waiting_for_input"] for i in client.list_instances()):
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.05)
            time.sleep(0.3)                 # the launch's answer read: pie submit follows it
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=30)
            assert process.returncode == 130, err
            assert "pie submit: interrupted (Ctrl-C): instance" in err and "terminated" in err
            deadline = time.monotonic() + 10
            while client.list_instances():
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
    wait_until_idle(fake_server.url)


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


def test_serve_shows_the_engine_line_and_slow_steps_on_stderr(capsys) -> None:
    """`pie serve` prints which kernels the engine runs (the engine logs it once at load), and
    each slow step of its start (the "pie.serve" log: host/progress.py lines)."""
    from host.server.builtin import _step

    logs = [logging.getLogger("pie.engine"), logging.getLogger("pie.serve")]
    saved = [(list(log.handlers), log.level) for log in logs]
    try:
        commands._show_engine_log()
        logs[0].info("engine: %s", "GGUF blocks (Q4_1) multiplied in place by the avx2 kernels")
        step = _step("compiling the built-in OpenAI inferlet")
        step.after_s = 0.0
        with step:
            time.sleep(0.01)
        err = capsys.readouterr().err
        assert "pie serve: engine: GGUF blocks (Q4_1) multiplied in place by the avx2 kernels" \
            in err
        assert "pie serve: compiling the built-in OpenAI inferlet: done in 0." in err
    finally:
        for log, (handlers, level) in zip(logs, saved):
            log.handlers[:] = handlers
            log.setLevel(level)


def test_the_served_model_has_one_name() -> None:
    """/health, model_info and /v1/models all say served_model_name: the file's name up to its
    first dot, not the GGUF's own metadata name."""
    from engine.loaders import served_model_name

    assert served_model_name("models/Llama-3.2-1B.Q4_K_M.gguf", "Llama 3.2 1B", False) == \
        "Llama-3.2-1B"
    assert served_model_name("/ckpt/SmolLM2-360M", "HuggingFaceTB/SmolLM2-360M", False) == \
        "SmolLM2-360M"
    assert served_model_name("qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5", False) == \
        "qwen2.5-0.5b-instruct-fp16"
    assert served_model_name("", "Smollm2 135M 8k Lc100K Mix1 Ep2", True) == \
        "SmolLM2-135M-Instruct"
    assert served_model_name("", "fake-byte-model", False) == "fake-byte-model"
