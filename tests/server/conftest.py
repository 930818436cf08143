"""Fixtures of the server tests: a real `pie serve` on 127.0.0.1 (ephemeral port) in-process.

`fake_server` runs the real Runtime over the fake engine (protocol and tenancy do not depend on
the model); `model_server` runs the real engine (SmolLM2-135M) with the OpenAI API. Both are
session-scoped; tests leave them with no instance running and every page free.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from host.sandbox.programs.build import build_cached
from host.server.builtin import builtin_source
from host.server.server_config import parse_config
from tests.host.fake_engine import FakeEngine
from tests.server.harness import ServerThread

REPO_DIR = Path(__file__).resolve().parents[2]
BUILD_CACHE = REPO_DIR / ".cache" / "test-inferlets"
TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "tiny": "tok-tiny", "small": "tok-small",
          "carol": "tok-carol"}   # carol: test_two_tenants_are_isolated; no prefix cache on the model


def seed_builtin(data_dir: Path) -> None:
    """Put the built-in inferlet, built once into the tests' cache, in data_dir's own cache (a
    server on data_dir then starts without building it)."""
    built, _ = build_cached(builtin_source(), BUILD_CACHE)
    (data_dir / "builtin").mkdir()
    shutil.copy(built, data_dir / "builtin" / built.name)


def server_config(data_dir: Path, **server: object) -> object:
    return parse_config({
        "server": {"data_dir": str(data_dir), "max_upload_bytes": 32 * 1024 * 1024,
                   "shutdown_grace_s": 1.0, "openai": False, **server},
        "tenants": [
            {"name": "alice", "token": TOKENS["alice"], "max_instances": 24, "max_kv_pages": 480},
            {"name": "bob", "token": TOKENS["bob"]},
            {"name": "tiny", "token": TOKENS["tiny"], "max_instances": 1, "max_kv_pages": 4,
             "max_program_bytes": 1024 * 1024},
            {"name": "small", "token": TOKENS["small"], "max_instances": 1, "max_kv_pages": 4},
            {"name": "carol", "token": TOKENS["carol"]},
        ]})


@pytest.fixture(scope="session")
def probe_wasm() -> bytes:
    """tests/server/apps/server_probe.py built into a component (cached on disk)."""
    path, _ = build_cached(REPO_DIR / "tests" / "server" / "apps" / "server_probe.py", BUILD_CACHE)
    return path.read_bytes()


@pytest.fixture(scope="session")
def fake_server(tmp_path_factory: pytest.TempPathFactory, probe_wasm: bytes):
    engine = FakeEngine(num_pages=512, page_size=16, batch_delay_s=0.002, keep_log=False)
    server = ServerThread(server_config(tmp_path_factory.mktemp("pie-data")), engine).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def model_server(tmp_path_factory: pytest.TempPathFactory):
    """The real model with the OpenAI API; the built-in inferlet is pre-built into the cache.
    Only alice shares chat prefixes (the exported pages the prefix tests read are hers alone:
    her default prefix from the start-up, then her requests')."""
    data_dir = tmp_path_factory.mktemp("pie-model-data")
    seed_builtin(data_dir)
    config = parse_config({
        "server": {"data_dir": str(data_dir), "openai": True, "shutdown_grace_s": 1.0},
        "engine": {"num_pages": 256, "page_size": 16, "max_batch_tokens": 1024},
        "tenants": [{"name": "alice", "token": TOKENS["alice"]},
                    {"name": "tiny", "token": TOKENS["tiny"], "max_instances": 1,
                     "prefix_cache_pages": 0, "max_adapter_bytes": 6 * 2**20},
                    {"name": "carol", "token": TOKENS["carol"], "prefix_cache_pages": 0}]})
    server = ServerThread(config).start()
    yield server
    server.stop()


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {name{labels}: value} (comments skipped)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    figures = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            figures[name] = float(value)
    return figures


def wait_until_idle(url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no instance runs and no KV page is used but by exports (the
    built-in's shared chat prefixes); returns the last figures."""
    import time
    deadline = time.monotonic() + timeout_s
    while True:
        figures = scrape(url)
        held = figures["pie_kv_pages_used"] - figures["pie_kv_pages_exported"]
        if figures["pie_instances_running"] == 0 and held == 0:
            return figures
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout_s} s: "
                                 f"{figures['pie_instances_running']} instances, "
                                 f"{held} pages used besides exports")
        time.sleep(0.05)
