"""A tenant's spare_instances on a real server (real Runtime, fake engine): after a launch of an
upload, that many instances of it are made ahead while nothing runs; the tenant's next launches
and their children of that program take them; another tenant's launches of the same program do
not; a launch of another upload moves the spares to it; the spares count in /metrics."""
from __future__ import annotations

import time

import pytest
import trio

from host.client import connect
from host.server.server_config import parse_config
from tests.host.fake_engine import FakeEngine
from tests.server.conftest import scrape, wait_until_idle
from tests.server.harness import ServerThread

TOKENS = {"alice": "tok-alice", "bob": "tok-bob"}
NUM_SPARES = 2
SPARE_GAUGE = "pie_instances_spare"


def renamed(wasm: bytes, name: bytes) -> bytes:
    """`wasm` with a custom section `name` appended: the same program under another hash."""
    payload = bytes([len(name)]) + name
    return wasm + b"\x00" + bytes([len(payload)]) + payload


@pytest.fixture(scope="module")
def spare_server(tmp_path_factory: pytest.TempPathFactory):
    config = parse_config({
        "server": {"data_dir": str(tmp_path_factory.mktemp("pie-spares")), "openai": False,
                   "spare_builtins": 0, "shutdown_grace_s": 1.0},
        "tenants": [{"name": "alice", "token": TOKENS["alice"], "spare_instances": NUM_SPARES},
                    {"name": "bob", "token": TOKENS["bob"]}]})
    engine = FakeEngine(num_pages=256, page_size=16, batch_delay_s=0.002, keep_log=False)
    server = ServerThread(config, engine).start()
    yield server
    server.stop()


def spares_after_idle(url: str, expected: int, timeout_s: float = 20.0) -> float:
    """The spare gauge once nothing runs and it reads `expected` (or the timeout passed)."""
    wait_until_idle(url)
    deadline = time.monotonic() + timeout_s
    while (count := scrape(url)[SPARE_GAUGE]) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


async def _result(client, program: str, *args: str) -> str:
    event = await (await client.launch(program, list(args))).wait()
    assert event.kind == "result", event
    return event.data


async def _spares_while_echoing(client, program: str, url: str) -> float:
    """The spare gauge while one `echo` instance of `program` runs; it is ended after."""
    running = await client.launch(program, ["echo"])
    await running.send("ping")
    assert (await running.next_event()).data == "ping"
    count = await trio.to_thread.run_sync(lambda: scrape(url)[SPARE_GAUGE])
    await running.send("quit")
    assert (await running.wait()).data == "bye"
    return count


def test_a_tenants_launches_take_its_spares_and_no_one_elses(spare_server, probe_wasm):
    url = spare_server.url
    assert scrape(url)[SPARE_GAUGE] == 0

    async def launch_once() -> str:
        async with connect(url, TOKENS["alice"]) as alice:
            program = await alice.upload(probe_wasm)
            assert await _result(alice, program, "log") == "logged"
            return program
    program = trio.run(launch_once)
    assert spares_after_idle(url, NUM_SPARES) == NUM_SPARES

    async def launch_again() -> tuple[float, float]:
        async with connect(url, TOKENS["alice"]) as alice, \
                connect(url, TOKENS["bob"]) as bob:
            mine = await _spares_while_echoing(alice, program, url)
            assert await bob.upload(probe_wasm) == program
            theirs = await _spares_while_echoing(bob, program, url)
            return mine, theirs
    mine, theirs = trio.run(launch_again)
    assert mine == NUM_SPARES - 1          # alice's launch took one
    assert theirs == NUM_SPARES            # bob's instantiated on its own
    assert spares_after_idle(url, NUM_SPARES) == NUM_SPARES


def test_children_take_spares_and_another_upload_moves_them(spare_server, probe_wasm):
    url = spare_server.url
    other_wasm = renamed(probe_wasm, b"pie-test-other")

    async def parent_and_child() -> tuple[str, float]:
        async with connect(url, TOKENS["alice"]) as alice:
            program = await alice.upload(probe_wasm)
            assert await _result(alice, program, "log") == "logged"
            await trio.to_thread.run_sync(spares_after_idle, url, NUM_SPARES)
            parent = await alice.launch(program, ["spawn", "self", "echo"])
            with trio.fail_after(30):
                while len(await alice.list_instances()) < 2:
                    await trio.sleep(0.02)
            count = await trio.to_thread.run_sync(lambda: scrape(url)[SPARE_GAUGE])
            await parent.terminate()
            assert (await parent.wait()).kind == "terminated"
            return program, count
    program, count = trio.run(parent_and_child)
    assert count == NUM_SPARES - 2         # the parent and its child each took one
    assert spares_after_idle(url, NUM_SPARES) == NUM_SPARES

    async def move_them() -> tuple[float, float]:
        async with connect(url, TOKENS["alice"]) as alice:
            other = await alice.upload(other_wasm)
            assert other != program
            assert await _result(alice, other, "log") == "logged"
            await trio.to_thread.run_sync(spares_after_idle, url, NUM_SPARES)
            new = await _spares_while_echoing(alice, other, url)
            await trio.to_thread.run_sync(spares_after_idle, url, NUM_SPARES)
            return new, await _spares_while_echoing(alice, program, url)
    new, old = trio.run(move_them)
    assert new == NUM_SPARES - 1           # the spares were of the latest upload launched
    assert old == 0                        # launching the first again dropped them
    assert spares_after_idle(url, NUM_SPARES) == NUM_SPARES   # and made its own
