"""Graceful shutdown: new launches are refused, running instances get the grace period, then are
terminated; the server returns cleanly."""
from __future__ import annotations

import time

import pytest
import trio

from host.client import PieError, connect
from tests.host.fake_engine import FakeEngine
from tests.server.conftest import TOKENS, server_config
from tests.server.harness import ServerThread


def test_graceful_shutdown(tmp_path, probe_wasm) -> None:
    server = ServerThread(server_config(tmp_path, shutdown_grace_s=1.5),
                          FakeEngine(num_pages=64, page_size=16, keep_log=False)).start()

    async def main() -> None:
        async with connect(server.url, TOKENS["alice"]) as client:
            program = await client.upload(probe_wasm)
            finisher = await client.launch(program, ["echo"])
            lingerer = await client.launch(program, ["echo"])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, server.stop)
                with trio.fail_after(5):
                    while True:   # until the server refuses new work
                        try:
                            await (await client.launch(program, ["echo"])).terminate()
                        except PieError as exc:
                            assert "shutting down" in str(exc)
                            break
                started = time.monotonic()
                await finisher.send("quit")   # finishes within the grace period
                assert (await finisher.wait()).kind == "result"
                final = await lingerer.wait()  # does not: terminated when the grace is over
                assert final.kind == "terminated" and "shutting down" in final.data
                assert time.monotonic() - started > 1.0
    trio.run(main)
    assert server.error is None
