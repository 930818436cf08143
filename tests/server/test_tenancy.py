"""Tenancy and lifetime on a real server (real Runtime, fake engine): two tenants see nothing of
each other (programs, instances, KV exports, key-value store), quotas hold, a client that goes
away has its instances terminated and every page returned, and many clients at once all work."""
from __future__ import annotations

import pytest
import trio

from host.client import PieError, connect
from tests.server.conftest import TOKENS, scrape, wait_until_idle


async def _result(client, program: str, *args: str) -> str:
    event = await (await client.launch(program, list(args))).wait()
    assert event.kind == "result", event
    return event.data


def test_two_tenants_are_isolated(fake_server, probe_wasm) -> None:
    async def main() -> None:   # "bob" here is tenant carol, who has uploaded nothing yet
        async with connect(fake_server.url, TOKENS["alice"]) as alice, \
                connect(fake_server.url, TOKENS["carol"]) as bob:
            program = await alice.upload(probe_wasm)
            # programs: bob cannot see or launch alice's upload
            assert program not in [p["sha256"] for p in await bob.list_programs()]
            with pytest.raises(PieError, match="unknown program"):
                await bob.launch(program, ["echo"])
            # instances: invisible to bob, and bob cannot send to or terminate them
            exporter = await alice.launch(program, ["export", "shared-prefix"])
            assert (await exporter.next_event()).data == "exported"
            assert exporter.id in [i["instance_id"] for i in await alice.list_instances()]
            assert exporter.id not in [i["instance_id"] for i in await bob.list_instances()]
            for attempt in (bob.send(exporter.id, "x"), bob.terminate(exporter.id)):
                with pytest.raises(PieError, match="unknown instance"):
                    await attempt
            # exports: alice's name is "not found" for bob, found for alice
            assert await bob.upload(probe_wasm) == program
            assert await _result(bob, program, "import", "shared-prefix") == \
                "import failed: import 'shared-prefix': export 'shared-prefix' not found"
            assert (await _result(alice, program, "import", "shared-prefix")).startswith("imported ")
            await exporter.send("done")
            assert (await exporter.wait()).kind == "result"
            # key-value store: one per tenant
            assert await _result(alice, program, "store-set", "colour", "green") == "ok"
            assert await _result(alice, program, "store-get", "colour") == "green"
            assert await _result(bob, program, "store-get", "colour") == "<none>"
    trio.run(main)
    wait_until_idle(fake_server.url)


def test_instance_and_page_quotas(fake_server, probe_wasm) -> None:
    async def main() -> None:
        async with connect(fake_server.url, TOKENS["alice"]) as alice:
            program = await alice.upload(probe_wasm)
            with pytest.raises(PieError, match="KV page quota: 481 pages asked, 480 of 480"):
                await alice.launch(program, ["echo"], kv_pages=481)
            big = await alice.launch(program, ["echo"], kv_pages=400)
            with pytest.raises(PieError, match="KV page quota: 100 pages asked, 80 of 480"):
                await alice.launch(program, ["echo"], kv_pages=100)
            # an instance holding a 1-page reservation traps when it needs more
            small = await alice.launch(program, ["generate", "40"], kv_pages=1)
            final = await small.wait()
            assert final.kind == "trap" and "quota" in final.data, final
            await big.terminate()
            assert (await big.wait()).kind == "terminated"
        async with connect(fake_server.url, TOKENS["small"]) as small:
            program = await small.upload(probe_wasm)
            with pytest.raises(PieError, match="kv_pages must be positive, got 0"):
                await small.launch(program, ["echo"], kv_pages=0)
            first = await small.launch(program, ["echo"])
            assert (await small.list_instances())[0]["kv_pages"] == 4   # 4 pages / 1 instance
            with pytest.raises(PieError, match=r"instance quota reached "
                                                 r"\(1 running, of max_instances 1\)"):
                await small.launch(program, ["echo"])
            await first.send("quit")
            assert (await first.wait()).data == "bye"
            await (await small.launch(program, ["echo"])).terminate()   # the slot is free again
    trio.run(main)
    figures = wait_until_idle(fake_server.url)
    assert figures['pie_traps_total{cause="quota"}'] >= 1


def test_disconnect_mid_generation_frees_every_page(fake_server, probe_wasm) -> None:
    async def main() -> None:
        async with connect(fake_server.url, TOKENS["alice"]) as alice:
            program = await alice.upload(probe_wasm)
            instances = [await alice.launch(program, ["generate", "100000"]) for _ in range(3)]
            for instance in instances:
                assert (await instance.next_event()).kind == "message"
            assert scrape(fake_server.url)["pie_kv_pages_used"] > 0
        # the connection is closed here, mid-generation
    trio.run(main)
    figures = wait_until_idle(fake_server.url)
    assert figures["pie_kv_pages_free"] == 512


def test_many_concurrent_clients(fake_server, probe_wasm) -> None:
    num_clients = 16

    async def one_client(index: int, results: dict) -> None:
        token = TOKENS["alice"] if index % 2 else TOKENS["bob"]
        async with connect(fake_server.url, token, binary=bool(index % 3)) as client:
            program = await client.upload(probe_wasm)
            echo = await client.launch(program, ["echo"])
            generated = await client.launch(program, ["generate", "12"])
            await echo.send(f"hello {index}")
            assert (await echo.next_event()).data == f"hello {index}"
            await echo.send("quit")
            deltas = [e.data async for e in generated.events() if e.kind == "message"]
            results[index] = ((await echo.wait()).data, generated.final, "".join(deltas))

    async def main() -> dict:
        results: dict = {}
        async with trio.open_nursery() as nursery:
            for index in range(num_clients):
                nursery.start_soon(one_client, index, results)
        return results

    results = trio.run(main)
    assert len(results) == num_clients
    for echo_result, final, streamed in results.values():
        assert echo_result == "bye"
        assert final.kind == "result" and len(final.data) == 12 and streamed == final.data
    # the fake model is deterministic: the same prompt gives the same text for every tenant
    assert len({final.data for _, final, _ in results.values()}) == 1
    figures = wait_until_idle(fake_server.url)
    assert figures["pie_batch_size_sum"] > figures["pie_batch_size_count"]   # passes were batched
