"""The `pie serve` a bench runs against, with the default model: in a process of its own
(`ServeProcess`, as a user runs it: the bench's client then shares no interpreter lock with the
server) or in a thread of the bench's process (`InProcessServer`: the bench reaches into its
runtime). Both take the same config (`bench_config`) and give `url` and `token` once listening.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from functools import partial
from pathlib import Path

import trio

__all__ = ["ServeProcess", "InProcessServer", "bench_config", "toml_text"]

REPO_DIR = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
READY_TIMEOUT_S = 600.0        # a CUDA engine warms its kernels before it listens
STOP_TIMEOUT_S = 60.0
LISTENING = "pie serve: listening on "


def bench_config(num_pages: int, max_instances: int, spare_builtins: int = 8,
                 engine: dict | None = None, data_dir: Path | None = None,
                 outbound: dict | None = None) -> dict:
    """The benches' server config as pie.toml's tables: one tenant "bench" (TOKEN) with
    `max_instances` and every page; `engine`: more [engine] fields (device, dtype, act8);
    `data_dir`: the server's (default ~/.cache/pie/bench-server, which keeps the built-in's
    build); `outbound`: the tenant's [tenants.outbound] (what its inferlets may reach)."""
    data_dir = data_dir or Path.home() / ".cache" / "pie" / "bench-server"
    return {
        "server": {"data_dir": str(data_dir), "openai": True, "shutdown_grace_s": 2.0,
                   "spare_builtins": spare_builtins},
        "engine": {"num_pages": num_pages, "page_size": 16, **(engine or {})},
        # The store outlives a run (it keeps the built-in's build), so every earlier build
        # of an example stays counted: a quota far above one run's few programs.
        "tenants": [{"name": "bench", "token": TOKEN, "max_instances": max_instances,
                     "max_kv_pages": num_pages, "max_program_bytes": 4 * 1024 ** 3,
                     **({"outbound": outbound} if outbound else {})}]}


def toml_text(config: dict) -> str:
    """`config` (tables of scalars, lists of scalars, sub-tables and arrays of tables, as
    bench_config makes) as TOML. A JSON scalar or list of scalars is TOML too."""
    lines: list[str] = []
    _table(lines, [], config)
    return "\n".join(lines) + "\n"


def _table(lines: list[str], path: list[str], table: dict) -> None:
    nested = []
    for key, value in table.items():
        if isinstance(value, dict) or (isinstance(value, list) and value
                                       and all(isinstance(v, dict) for v in value)):
            nested.append((key, value))
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in nested:
        if isinstance(value, dict):
            lines.append(f"\n[{'.'.join(path + [key])}]")
            _table(lines, path + [key], value)
            continue
        for item in value:
            lines.append(f"\n[[{'.'.join(path + [key])}]]")
            _table(lines, path + [key], item)


class ServeProcess:
    """`pie serve --config` in a child process (this interpreter, the repo's host package),
    listening on a free port of 127.0.0.1; stopped with SIGTERM (graceful), then killed. Its
    start-up lines (the engine's kernels, progress) go to this process's stderr unless
    `quiet`; RuntimeError with its last lines when it exits before listening."""

    def __init__(self, config: dict, quiet: bool = False) -> None:
        self.config = config
        self.token = config["tenants"][0]["token"]
        self.url = ""
        self.quiet = quiet
        self._dir: tempfile.TemporaryDirectory | None = None
        self._process: subprocess.Popen | None = None
        self._last_lines: deque[str] = deque(maxlen=20)

    def __enter__(self) -> "ServeProcess":
        self._dir = tempfile.TemporaryDirectory(prefix="pie-bench-")
        config_path = Path(self._dir.name) / "pie.toml"
        config_path.write_text(toml_text(self.config))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "host.cli", "serve", "--config", str(config_path),
             "--host", "127.0.0.1", "--port", "0"],
            cwd=REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            self.url = self._wait_listening()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    @property
    def pid(self) -> int:
        return self._process.pid

    def _wait_listening(self) -> str:
        timer = threading.Timer(READY_TIMEOUT_S, self._process.kill)
        timer.start()
        try:
            for line in self._process.stdout:
                self._last_lines.append(line.rstrip())
                if line.startswith(LISTENING):
                    return line[len(LISTENING):].split()[0].rstrip(",")
                if not self.quiet:
                    print(line.rstrip(), file=sys.stderr, flush=True)
        finally:
            timer.cancel()
        last = "\n".join(self._last_lines)
        raise RuntimeError(f"pie serve exited (status {self._process.wait()}) before it "
                           f"listened; its last lines:\n{last}")

    def _drain(self) -> None:
        """Read the server's later output (its pipe must never fill), keeping the last lines."""
        for line in self._process.stdout:
            self._last_lines.append(line.rstrip())

    def __exit__(self, *exc_info) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._dir is not None:
            self._dir.cleanup()


class InProcessServer:
    """`pie serve` in a thread of this process (a trio loop of its own), for benches that reach
    into its runtime; the arguments are bench_config's."""

    def __init__(self, num_pages: int, max_instances: int, spare_builtins: int = 8,
                 engine: dict | None = None, data_dir: Path | None = None,
                 outbound: dict | None = None) -> None:
        from host.server.server_config import parse_config
        config = bench_config(num_pages, max_instances, spare_builtins, engine, data_dir,
                              outbound)
        self.token = config["tenants"][0]["token"]
        self.config = parse_config(config)
        self.url = ""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        from host.server.app import serve
        self._token = trio.lowlevel.current_trio_token()
        self._shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            self.url = (await nursery.start(partial(serve, self.config, port=0,
                                                    shutdown=self._shutdown)))[0]
            self._ready.set()

    def __enter__(self) -> "InProcessServer":
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc_info) -> None:
        trio.from_thread.run_sync(self._shutdown.set, trio_token=self._token)
        self._thread.join(60)
