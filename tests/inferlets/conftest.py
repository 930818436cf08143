"""End-to-end fixtures for inferlets: the real model, one Runtime, components built once.

Builds (componentize-py, ~10-20 s each) and compiled artifacts (Wasmtime, ~10-25 s each) are
cached on disk under .cache/pie-test (gitignored), keyed by content hash, so only the first
session after a change to the SDK or an example pays for them.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "inferlets" / "examples"
TEST_APPS = Path(__file__).resolve().parent / "apps"
CACHE_DIR = REPO / ".cache" / "pie-test"
RUN_TIMEOUT_S = 240.0


@dataclass
class Run:
    """What one instance did: its outcome and the messages it sent, in order."""

    status: str
    value: str
    messages: list[str] = field(default_factory=list)

    def json(self):
        assert self.status == "ok", f"instance ended {self.status}: {self.value}"
        return json.loads(self.value)


@pytest.fixture(scope="session")
def engine():
    """The real default model (SmolLM2-135M-Instruct), loaded once, in float32: with bf16,
    computing a prompt in one pass or in two (prefix, then suffix) can flip a near-tie."""
    from engine.engine import load_default_engine
    return load_default_engine(progress=False, seed=0, dtype="float32")   # exact across pass splits


@pytest.fixture(scope="session")
def runtime(engine):
    from host.runtime_config import RuntimeConfig
    from host.runtime import Runtime
    with Runtime(engine, RuntimeConfig(cache_dir=CACHE_DIR)) as rt:
        yield rt


@pytest.fixture(scope="session")
def component_path():
    """name -> path of the built component (an example, or a test app under apps/)."""
    from host.sandbox.programs.build import build_cached
    built: dict[str, Path] = {}
    lock = threading.Lock()

    def get(name: str) -> Path:
        with lock:
            if name not in built:
                source = EXAMPLES / f"{name}.py"
                if not source.is_file():
                    source = TEST_APPS / f"{name}.py"
                built[name], _ = build_cached(source, CACHE_DIR / "builds")
            return built[name]
    return get


@pytest.fixture(scope="session")
def program(runtime, component_path):
    """name -> a loaded (compiled or cache-loaded) Program."""
    return lambda name: runtime.load_program(component_path(name).read_bytes())


@pytest.fixture(scope="session")
def run_inferlet(runtime, program):
    """Run an inferlet to its end; `on_message(instance_id, message)` may answer it."""
    def run(name: str, args=(), *, on_message=None, limits=None, send=()) -> Run:
        """`send`: client messages delivered right after the launch."""
        messages: list[str] = []
        instance_ids: list[str] = []
        started = threading.Event()

        def on_event(event) -> None:
            if event.kind == "message":
                messages.append(event.data)
                if on_message is not None:
                    started.wait(10)
                    on_message(instance_ids[0], event.data)
        instance_id = runtime.launch(program(name), list(args), on_event=on_event, limits=limits)
        instance_ids.append(instance_id)
        started.set()
        for message in send:
            runtime.send(instance_id, message)
        outcome = runtime.wait(instance_id, timeout=RUN_TIMEOUT_S)
        return Run(outcome.status, outcome.value, messages)
    return run


@pytest.fixture(scope="session")
def greedy_oracle(runtime, engine):
    """Engine.generate_greedy_batch on the idle pool (it borrows pages without the host)."""
    def oracle(prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
        stats = runtime.statistics()
        assert stats.num_running == 0 and stats.pages.num_used == 0, "the pool must be idle"
        return engine.generate_greedy_batch(prompts, num_new_tokens)
    return oracle


@pytest.fixture(scope="session")
def cli_env():
    """Environment for `pie` subprocesses sharing the session's caches."""
    env = dict(os.environ)
    env["PIE_CACHE_DIR"] = str(CACHE_DIR)
    return env


def truncate_at_stop(token_ids: list[int], stop_ids) -> list[int]:
    """The ids before the first stop token (what a generation returns)."""
    for index, token_id in enumerate(token_ids):
        if token_id in stop_ids:
            return token_ids[:index]
    return token_ids
