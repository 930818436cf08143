"""Child inferlets on a real server (real Runtime, fake engine): a child of the tenant's own
upload runs; a child past the tenant's instance quota, or of a program the tenant has not
uploaded, is refused naming why; the resolver never finds another tenant's upload; the tenant's
clients see its children (list_instances) and may terminate them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from host.client import PieError, connect
from host.server.server_config import parse_config
from host.server.spawning import server_spawn_hooks
from host.server.tenants import TenantRegistry
from host.server.uploads import UploadStore
from tests.server.conftest import TOKENS, scrape, wait_until_idle


async def _result(client, program: str, *args: str) -> str:
    event = await (await client.launch(program, list(args))).wait()
    assert event.kind == "result", event
    return event.data


def test_children_of_a_tenants_uploads_within_its_quotas(fake_server, probe_wasm) -> None:
    async def main() -> None:
        async with connect(fake_server.url, TOKENS["alice"]) as alice, \
                connect(fake_server.url, TOKENS["small"]) as small:
            program = await alice.upload(probe_wasm)
            assert await _result(alice, program, "store-set", "fruit", "fig") == "ok"
            assert await _result(alice, program, "spawn", "self", "store-get", "fruit") == \
                "child: fig"
            assert await _result(alice, program, "spawn", program, "store-get", "fruit") == \
                "child: fig"
            refused = await _result(alice, program, "spawn", "ab" * 32, "log")
            assert refused.startswith("refused: children.spawn: unknown program")
            assert "no upload of tenant 'alice'" in refused
            await small.upload(probe_wasm)
            refused = await _result(small, program, "spawn", "self", "log")
            assert "instance quota reached (1 running, of max_instances 1)" in refused
    trio.run(main)
    wait_until_idle(fake_server.url)


def test_the_resolver_finds_only_the_tenants_own_uploads(tmp_path) -> None:
    store = UploadStore(tmp_path)
    stored = store.put("alice", b"\\0asm-not-really")
    loaded = {}
    runtime = SimpleNamespace(programs=SimpleNamespace(get=lambda sha: loaded[sha]),
                              load_program=lambda data: loaded.setdefault("x", data))
    service = SimpleNamespace(store=store, runtime=runtime)
    tenants = TenantRegistry(parse_config({"tenants": [
        {"name": "alice", "token": "a"}, {"name": "bob", "token": "b"}]}).tenants)
    hooks = server_spawn_hooks(service, tenants, trio_token=None)
    assert hooks.resolve("alice", stored.sha256) == b"\\0asm-not-really"
    for tenant, program in (("bob", stored.sha256), ("alice", "probe"), ("bob", "")):
        with pytest.raises(LookupError, match=f"no upload of tenant '{tenant}'"):
            hooks.resolve(tenant, program)


def test_a_client_sees_its_instances_children_and_may_end_them(fake_server, probe_wasm) -> None:
    """list_instances shows a running child with its parent's id; only the tenant's clients see
    it or may terminate it; terminating it ends it (its parent sees how); /metrics counts it."""
    before = scrape(fake_server.url)

    async def main() -> None:
        async with connect(fake_server.url, TOKENS["alice"]) as alice, \
                connect(fake_server.url, TOKENS["bob"]) as bob:
            program = await alice.upload(probe_wasm)
            parent = await alice.launch(program, ["spawn", "self", "echo"])
            children = []
            with trio.fail_after(30):
                while not children:
                    listed = await alice.list_instances()
                    children = [i for i in listed if i["parent_id"] == parent.id]
                    await trio.sleep(0.02)
            (child,) = children
            mine = next(i for i in listed if i["instance_id"] == parent.id)
            assert mine["parent_id"] is None and mine["depth"] == 0
            assert child["depth"] == 1 and child["program"] == program
            assert child["kv_pages"] == mine["kv_pages"]
            live = scrape(fake_server.url)
            assert live['pie_children_live{tenant="alice"}'] == 1
            assert all(i["instance_id"] != child["instance_id"]
                       for i in await bob.list_instances())
            with pytest.raises(PieError, match="unknown instance"):
                await bob.terminate(child["instance_id"])
            await alice.terminate(child["instance_id"])
            event = await parent.wait()
            assert event.kind == "result" and event.data.startswith(
                f"refused: child {child['instance_id']}: terminated: terminated by client"), event
            with pytest.raises(PieError, match="unknown instance"):
                await alice.terminate(child["instance_id"])
    trio.run(main)
    after = wait_until_idle(fake_server.url)
    assert after['pie_children_live{tenant="alice"}'] == 0
    assert after['pie_spawns_total{tenant="alice"}'] - \
        before.get('pie_spawns_total{tenant="alice"}', 0) == 1
