"""The built-in inferlet runs once before the server listens (host/server/builtin.py,
warm_up_builtin), then once per tenant that shares chat prefixes (warm_up_prefixes): a fresh
server has generated tokens before any request and holds only those tenants' default prefixes,
which their first chats import; a warm-up that fails is logged and the server starts anyway.
AnyIO's backend, which the first streamed answer would import, is loaded before the server
listens (openai.load_stream_backend)."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import openai
import pytest

from host.sandbox.programs.build import build_cached
from host.server.builtin import builtin_source, warm_up_builtin, warm_up_prefixes
from host.server.server_config import parse_config
from host.server.tenants import Tenant
from tests.host.components import make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.host.test_instance_threads import wait_until
from tests.server.conftest import (BUILD_CACHE, REPO_DIR, scrape, seed_builtin,
                                   wait_until_idle)
from tests.server.harness import ServerThread


def _builtin_path():
    path, _ = build_cached(builtin_source(), BUILD_CACHE)
    return path


def wait_until_spares(url: str, num_spares: int) -> dict[str, float]:
    """The server's figures once `num_spares` built-ins wait instantiated (server.spare_builtins,
    made after the warm-ups while nothing runs)."""
    deadline = time.monotonic() + 30
    figures = scrape(url)
    while figures["pie_instances_spare"] != num_spares and time.monotonic() < deadline:
        time.sleep(0.05)
        figures = scrape(url)
    assert figures["pie_instances_spare"] == num_spares, figures
    return figures


def _first_chat(url: str, token: str) -> tuple[str, int, int]:
    """(answer, input tokens the engine computed for it, prompt tokens) of a greedy chat with no
    system prompt of its own."""
    before = scrape(url)["pie_input_tokens_total"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    computed = wait_until_idle(url)["pie_input_tokens_total"] - before
    return answer.choices[0].message.content, int(computed), answer.usage.prompt_tokens


@pytest.mark.slow
def test_a_fresh_server_has_run_the_builtin_and_holds_only_default_prefixes(tmp_path) -> None:
    """Before any request: the built-in has run, 8 instances of it wait instantiated
    (server.spare_builtins), nothing runs, and the only pages held are the
    default chat prefix of the tenant that shares prefixes (alice), which her first chat then
    imports (carol, prefix_cache_pages = 0, computes the whole prompt) and answers the same."""
    seed_builtin(tmp_path)
    config = parse_config({"server": {"data_dir": str(tmp_path), "openai": True,
                                      "shutdown_grace_s": 1.0},
                           "engine": {"num_pages": 64, "page_size": 16},
                           "tenants": [{"name": "alice", "token": "tok-alice"},
                                       {"name": "carol", "token": "tok-carol",
                                        "prefix_cache_pages": 0}]})
    server = ServerThread(config).start()
    try:
        figures = wait_until_spares(server.url, 8)          # no request yet
        assert figures["pie_generated_tokens_total"] >= 1
        assert figures["pie_input_tokens_total"] > 1
        assert figures["pie_instances_running"] == 0
        assert 0 < figures["pie_kv_pages_exported"] == figures["pie_kv_pages_used"] <= 2
        carol = _first_chat(server.url, "tok-carol")
        alice = _first_chat(server.url, "tok-alice")
        assert carol[1] == carol[2] + 3      # the whole prompt, then 3 of the 4 tokens as input
        assert alice[2] == carol[2] and alice[1] < carol[1] - 16  # the default prefix imported
        assert alice[0] == carol[0]
    finally:
        server.stop()


@pytest.mark.parametrize("warm_prefixes", [True, False])
def test_warm_prefixes_decides_whether_sharing_tenants_start_with_their_prefix(
        tmp_path, warm_prefixes: bool) -> None:
    """server.warm_prefixes: on, each tenant with prefix_cache_pages > 0 holds its default chat
    prefix before any request (one export each, its pages exported); off, nothing is held."""
    seed_builtin(tmp_path)
    tenants = [{"name": name, "token": f"tok-{name}"} for name in ("alice", "bob")]
    config = parse_config({"server": {"data_dir": str(tmp_path), "openai": True,
                                      "shutdown_grace_s": 1.0, "warm_prefixes": warm_prefixes},
                           "tenants": [*tenants, {"name": "carol", "token": "tok-carol",
                                                  "prefix_cache_pages": 0}]})
    server = ServerThread(config, FakeEngine(num_pages=64, page_size=16)).start()
    try:
        figures = scrape(server.url)
        assert figures["pie_instances_running"] == 0
        assert figures["pie_kv_pages_used"] == figures["pie_kv_pages_exported"]
        if warm_prefixes:       # alice's and bob's, the same tokens in two namespaces
            assert figures["pie_kv_pages_exported"] > 0
            assert figures["pie_kv_pages_exported"] % 2 == 0
        else:
            assert figures["pie_kv_pages_exported"] == 0
    finally:
        server.stop()


STREAM_BACKEND = "anyio._backends._trio"
LISTENING_SERVER = textwrap.dedent("""
    import sys
    from host.server.server_config import parse_config
    from tests.host.fake_engine import FakeEngine
    from tests.server.harness import ServerThread
    config = parse_config({"server": {"data_dir": sys.argv[1], "openai": True,
                                      "shutdown_grace_s": 1.0},
                           "tenants": [{"name": "alice", "token": "tok-alice"}]})
    print("before:", sys.argv[2] in sys.modules)
    server = ServerThread(config, FakeEngine(num_pages=64, page_size=16)).start()
    print("listening:", sys.argv[2] in sys.modules)
    server.stop()
""")


def test_a_listening_server_has_loaded_the_stream_backend(tmp_path) -> None:
    """In a fresh process (this one may have streamed already): not imported before the server
    starts, imported once it listens, before any request."""
    seed_builtin(tmp_path)
    run = subprocess.run([sys.executable, "-c", LISTENING_SERVER, str(tmp_path), STREAM_BACKEND],
                         cwd=REPO_DIR, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["before: False", "listening: True"], run.stdout


def test_a_failed_warm_up_is_logged_not_raised(caplog, make_runtime) -> None:  # noqa: F811
    runtime = make_runtime(FakeEngine(num_pages=64, page_size=16))
    program = runtime.load_program(_builtin_path().read_bytes())
    with caplog.at_level(logging.WARNING, logger="host.server.builtin"):
        # no messages: the built-in's main raises, the instance ends in error
        assert warm_up_builtin(runtime, program, {"mode": "chat"}) is False
    assert "warm-up run did not end well" in caplog.text
    assert runtime.statistics().num_running == 0
    assert runtime.statistics().pages.num_used == 0


SLOW_REQUEST = {"mode": "completion", "prompts": ["hello"], "echo": False, "max_tokens": 500,
                "temperature": 0, "top_p": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "logit_bias": [], "logprobs": None,
                "response_format": None, "tools": [], "tool_choice": "none", "seed": None,
                "stop": [], "n": 1, "stream": False, "ignore_eos": True}   # 500 x 10 ms


def test_a_warm_up_past_its_timeout_is_terminated(caplog, monkeypatch,
                                                  make_runtime) -> None:  # noqa: F811
    from host.server import builtin
    monkeypatch.setattr(builtin, "WARM_UP_TIMEOUT_S", 0.2)
    engine = FakeEngine(num_pages=64, page_size=16, batch_delay_s=0.01)
    runtime = make_runtime(engine)
    program = runtime.load_program(_builtin_path().read_bytes())
    with caplog.at_level(logging.WARNING, logger="host.server.builtin"):
        assert warm_up_builtin(runtime, program, SLOW_REQUEST) is False
    assert "took over 0.2 s: terminated" in caplog.text
    assert wait_until(lambda: runtime.statistics().num_running == 0, timeout_s=10)
    assert runtime.statistics().pages.num_used == 0


def test_prefix_runs_past_their_timeout_are_terminated(caplog, monkeypatch,
                                                       make_runtime) -> None:  # noqa: F811
    """Each sharing tenant's run (prefix_cache_pages 0: none) that outlasts its wave's deadline
    is terminated and logged; none counts as done, none keeps running, no page but the
    prefixes' exports stays held."""
    from host.server import builtin
    monkeypatch.setattr(builtin, "WARM_UP_TIMEOUT_S", 0.3)
    runtime = make_runtime(FakeEngine(num_pages=256, page_size=16, batch_delay_s=0.01))
    program = runtime.load_program(_builtin_path().read_bytes())
    request = dict(SLOW_REQUEST, mode="chat", max_tokens=1000,        # 10 s if not stopped
                   messages=[{"role": "user", "content": "hello"}])
    tenants = [Tenant(name, 2, 128, 1 << 20, prefix_cache_pages) for name, prefix_cache_pages
               in (("alice", 16), ("bob", 16), ("carol", 0))]
    with caplog.at_level(logging.WARNING, logger="host.server.builtin"):
        assert warm_up_prefixes(runtime, program, request, tenants,
                                runtime.config.limits) == 0
    assert caplog.text.count("took over 0.3 s: terminated") == 2
    assert wait_until(lambda: runtime.statistics().num_running == 0, timeout_s=5)
    assert runtime.statistics().pages.num_used == runtime.exports.num_pages()
