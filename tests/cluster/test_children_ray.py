"""children.spawn in `pie serve --ray` (fake engine, two replicas): a child of the tenant's own
upload runs on its parent's replica, resolved through the Directory's program index; another
tenant's upload, or a child past the tenant's instance quota across the cluster, is refused
naming why."""
from __future__ import annotations

from functools import partial

import pytest
import trio

from host.client import connect
from host.server.server_config import parse_config
from tests.host.components import components  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.server.conftest import probe_wasm  # noqa: F401
from tests.server.harness import ServerThread

TOKENS = {"alice": "tok-kids-alice", "bob": "tok-kids-bob", "small": "tok-kids-small"}


@pytest.fixture(scope="module")
def kids_server(ray_cluster, tmp_path_factory):
    config = parse_config({
        "server": {"data_dir": str(tmp_path_factory.mktemp("pie-kids")), "openai": False,
                   "shutdown_grace_s": 1.0, "max_upload_bytes": 32 << 20},
        "cluster": {"enabled": True, "replicas": 2, "num_cpus": 0.0},
        "tenants": [{"name": "alice", "token": TOKENS["alice"], "max_instances": 8},
                    {"name": "bob", "token": TOKENS["bob"]},
                    {"name": "small", "token": TOKENS["small"], "max_instances": 1}]})
    engine = partial(FakeEngine, num_pages=256, page_size=16, batch_delay_s=0.002,
                     keep_log=False)
    server = ServerThread(config, engine).start()
    yield server
    server.stop()


async def _result(client, program: str, *args: str) -> str:
    event = await (await client.launch(program, list(args))).wait()
    assert event.kind == "result", event
    return event.data


def test_children_resolve_through_the_directory_within_quotas(kids_server, probe_wasm,  # noqa: F811
                                                              components) -> None:  # noqa: F811
    async def main() -> None:
        async with connect(kids_server.url, TOKENS["alice"]) as alice, \
                connect(kids_server.url, TOKENS["bob"]) as bob, \
                connect(kids_server.url, TOKENS["small"]) as small:
            program = await alice.upload(probe_wasm)
            for _ in range(2):                         # on each replica (placed by load)
                assert await _result(alice, program, "spawn", "self", "log") == "child: logged"
                assert await _result(alice, program, "spawn", program, "spawn", program,
                                     "log") == "child: child: logged"
            refused = await _result(alice, program, "spawn", "ab" * 32, "log")
            assert "no upload of tenant 'alice' has the sha256" in refused
            bobs = await bob.upload(components.component("echo"))
            refused = await _result(alice, program, "spawn", bobs, "log")
            assert f"no upload of tenant 'alice' has the sha256 '{bobs}'" in refused
            await small.upload(probe_wasm)
            refused = await _result(small, program, "spawn", "self", "log")
            assert refused.startswith("refused:")
            assert "max_instances is 1" in refused
    trio.run(main)


def test_a_tenants_store_is_one_across_replicas(kids_server, probe_wasm) -> None:  # noqa: F811
    """What an instance sets on one replica, an instance on the other reads (the Directory holds
    the store); another tenant's store stays apart."""
    async def on(client, replica_id: str, program: str, *args: str) -> str:
        for key in range(64):                 # session keys until one lands on `replica_id`
            instance = await client.launch(program, list(args), affinity=f"key-{key}")
            event = await instance.wait()
            if instance.id.startswith(replica_id + "."):
                assert event.kind == "result", event
                return event.data
        raise AssertionError(f"no key placed on {replica_id}")

    async def main() -> None:
        async with connect(kids_server.url, TOKENS["alice"]) as alice, \
                connect(kids_server.url, TOKENS["bob"]) as bob:
            program = await alice.upload(probe_wasm)
            await bob.upload(probe_wasm)
            assert await on(alice, "r0", program, "store-set", "colour", "teal") == "ok"
            assert await on(alice, "r1", program, "store-get", "colour") == "teal"
            assert await on(bob, "r1", program, "store-get", "colour") == "<none>"
    trio.run(main)
