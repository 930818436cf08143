"""Per-tenant and server limits on a real server (real Runtime, fake engine): deeply nested frames,
a client that does not read (its instance is cut off, and it still gets the final event), uploads
in flight bounded per tenant, and KV shares between tenants. Beside each attack a well-behaved
instance of another tenant produces exactly its solo output, and every page comes back."""
from __future__ import annotations

import json

import msgpack
import pytest
import trio
from trio_websocket import open_websocket_url

from host.client import PieError, connect
from host.server.server_config import ConfigError, parse_config
from host.server.tenants import resolve_kv_shares
from tests.host.components import ComponentBuilder
from tests.host.fake_engine import FakeEngine
from tests.server.conftest import TOKENS, scrape, wait_until_idle
from tests.server.harness import ServerThread

BACKLOG_BYTES = 1024 * 1024
UPLOAD_BYTES = 48 * 1024 * 1024   # the Python probe component is ~18 MiB


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory):
    """32 pages of 16 slots; tenants alice and bob with the default equal shares (16 each)."""
    config = parse_config({
        "server": {"data_dir": str(tmp_path_factory.mktemp("pie-limits")), "openai": False,
                   "shutdown_grace_s": 1.0, "max_client_backlog_bytes": BACKLOG_BYTES,
                   "max_tenant_upload_bytes": UPLOAD_BYTES},
        "tenants": [{"name": "alice", "token": TOKENS["alice"], "max_instances": 4,
                     "max_kv_pages": 32},
                    {"name": "bob", "token": TOKENS["bob"], "max_instances": 4,
                     "max_kv_pages": 32}]})
    server = ServerThread(config, FakeEngine(num_pages=32, page_size=16, batch_delay_s=0.001,
                                             keep_log=False)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guests() -> ComponentBuilder:
    return ComponentBuilder()


async def _result(client, program: str, *args: str) -> str:
    event = await (await client.launch(program, list(args))).wait()
    assert event.kind == "result", event
    return event.data


@pytest.mark.parametrize("frame", [
    "[" * 100_000 + "]" * 100_000,                         # too deep for the JSON parser itself
    json.dumps({"type": "send", "instance_id": "x", "message": [[[[[[[[["m"]]]]]]]]]}),
    msgpack.packb({"type": "send", "message": [[[[[[[[["m"]]]]]]]]]}),
])
def test_deeply_nested_frames_get_a_named_error(fake_server, frame) -> None:
    async def main() -> None:
        async with connect(fake_server.url, TOKENS["bob"]) as client:
            await client.send_raw(frame)
            with trio.fail_after(5):
                while not client.notices:
                    await trio.sleep(0.01)
            assert any("nested deeper than 8 levels" in notice for notice in client.notices), \
                client.notices
            assert (await client.model_info())["name"] == "fake-byte-model"   # still up
    trio.run(main)


def test_client_that_does_not_read_is_cut_off_and_gets_the_final_event(
        limited_server, guests, probe_wasm) -> None:
    flood = guests.component("flood")

    async def main() -> None:
        async with connect(limited_server.url, TOKENS["bob"]) as polite:
            probe = await polite.upload(probe_wasm)
            solo = await _result(polite, probe, "generate", "8")
            async with connect(limited_server.url, TOKENS["alice"]) as setup:
                program = await setup.upload(flood)
            headers = [("Authorization", f"Bearer {TOKENS['alice']}")]
            async with open_websocket_url(limited_server.ws_url, extra_headers=headers,
                                          message_queue_size=1) as ws:
                await ws.send_message(json.dumps({"type": "launch", "program": program,
                                                  "args": ["m" * 65536], "id": 1}))
                # the client reads nothing now; another tenant's instance runs meanwhile
                assert await _result(polite, probe, "generate", "8") == solo
                await trio.sleep(1.0)
                finals, num_messages = [], 0
                with trio.fail_after(60):
                    while not finals:
                        event = json.loads(await ws.get_message())
                        if event["type"] == "ok":                # the launch answer
                            continue
                        if event["kind"] == "message":
                            num_messages += 1
                        else:
                            finals.append(event)
                with trio.move_on_after(0.5):          # nothing after the final event
                    finals.append(json.loads(await ws.get_message()))
        assert len(finals) == 1 and finals[0]["kind"] == "terminated", finals
        assert "client not reading" in finals[0]["data"]
        assert f"over server.max_client_backlog_bytes ({BACKLOG_BYTES})" in finals[0]["data"]
        assert num_messages * 65536 < 64 * BACKLOG_BYTES   # bounded by the cap + socket buffers
    trio.run(main)
    wait_until_idle(limited_server.url)


def test_uploads_in_flight_are_bounded_per_tenant(limited_server) -> None:
    async def main() -> None:
        size = UPLOAD_BYTES // 2 + 1
        async with connect(limited_server.url, TOKENS["alice"]) as first, \
                connect(limited_server.url, TOKENS["alice"]) as second:
            begin = await first.request("upload_begin", sha256="1" * 64, size=size)
            await first.request("upload_chunk", upload_id=begin["upload_id"], data=b"x" * 1000)
            with pytest.raises(PieError) as error:
                await second.request("upload_begin", sha256="2" * 64, size=size)
            assert (f"has {size} bytes of uploads in progress; {size} more would pass "
                    f"server.max_tenant_upload_bytes ({UPLOAD_BYTES})") in str(error.value)
        async with connect(limited_server.url, TOKENS["alice"]) as again:
            with trio.fail_after(5):                     # the first one left: its bytes are free
                while True:
                    try:
                        begin = await again.request("upload_begin", sha256="2" * 64, size=size)
                        break
                    except PieError:
                        await trio.sleep(0.05)
            assert begin["exists"] is False
    trio.run(main)


def test_tenant_within_its_share_suspends_a_tenant_over_it(limited_server, guests) -> None:
    """bob, within its share, needs pages while alice holds more than hers and the pool is full:
    alice's instance is suspended (its pages out of the pool: never written, they are not
    copied but given fresh on restore, server.restore "auto"), not terminated as before suspend
    and restore, and it is served again once bob's are back."""
    holder = guests.component("holder")

    async def main() -> None:
        async with connect(limited_server.url, TOKENS["alice"]) as alice, \
                connect(limited_server.url, TOKENS["bob"]) as bob:
            program = await alice.upload(holder)
            assert await bob.upload(holder) == program
            hog = await alice.launch(program, ["x" * 24], kv_pages=32)   # 8 over its 16
            assert (await hog.next_event()).data == "holding"
            polite = await bob.launch(program, ["x" * 8], kv_pages=16)
            assert (await polite.next_event()).data == "holding"
            await polite.send("x" * 8)                   # bob: 16 of its 16; the pool is full
            assert (await polite.next_event()).data == "holding"
            figures = scrape(limited_server.url)
            assert figures["pie_suspensions_total"] >= 1
            assert figures["pie_instances_suspended"] == 1
            await polite.send("")
            assert (await polite.wait()).data == "released"
            with trio.fail_after(10):                    # restored once bob's pages are back
                while scrape(limited_server.url)["pie_restores_total"] < 1:
                    await trio.sleep(0.05)
            await hog.send("")                           # (before it ends: it needs no pass)
            final = await hog.wait()
            assert final.kind == "result" and final.data == "released"
    trio.run(main)
    wait_until_idle(limited_server.url)


@pytest.mark.parametrize("section, field, value", [
    ("server", "max_client_backlog_bytes", 0), ("server", "max_tenant_upload_bytes", -1),
    ("scheduler", "max_tokens_per_owner", 0)])
def test_limit_settings_are_validated(section, field, value) -> None:
    with pytest.raises(ConfigError, match=f"{section}.{field} must be positive"):
        parse_config({section: {field: value}, "tenants": [{"name": "a", "token": "t"}]})


def test_kv_shares_resolve_and_must_fit_the_pool() -> None:
    tenants = parse_config({"tenants": [
        {"name": "a", "token": "ta", "kv_share_pages": 10},
        {"name": "b", "token": "tb"}, {"name": "c", "token": "tc", "max_kv_pages": 2}]}).tenants
    assert resolve_kv_shares(tenants, 32) == (("a", 10), ("b", 11), ("c", 2))
    with pytest.raises(ValueError, match="kv_share_pages sum to 10, more than the pool of 8"):
        resolve_kv_shares(tenants, 8)
    with pytest.raises(ConfigError, match="kv_share_pages must be >= 0"):
        parse_config({"tenants": [{"name": "a", "token": "t", "kv_share_pages": -1}]})


def test_a_full_client_inbox_is_a_service_error_naming_the_limit() -> None:
    """Runtime.send's LimitError (an instance that never reads its client messages) reaches the
    client as a ServiceError with the limit's message, not as an internal error."""
    from types import SimpleNamespace

    from host.errors import LimitError
    from host.server.service import PieService, ServiceError

    message = "messaging: 4194304 characters of client messages unread (max_client_chars)"

    def refuse(_instance_id: str, _message: str) -> bool:
        raise LimitError(message)

    service = SimpleNamespace(find=lambda tenant, instance_id: SimpleNamespace(instance_id="i1"),
                              runtime=SimpleNamespace(send=refuse))
    with pytest.raises(ServiceError, match="max_client_chars"):
        PieService.send(service, SimpleNamespace(name="a"), "i1", "hello")
    service.runtime = SimpleNamespace(send=lambda _id, _message: False)
    with pytest.raises(ServiceError, match="has ended"):
        PieService.send(service, SimpleNamespace(name="a"), "i1", "hello")


def _service_with_sink(terminate, max_backlog_bytes: int = 1000):
    """A PieService over a stand-in runtime (only `terminate`), and a handle with a sink."""
    from types import SimpleNamespace

    from host.server.service import InstanceHandle, PieService
    from host.server.sinks import EventSink

    service = PieService(SimpleNamespace(terminate=terminate), store=None,
                         metrics=SimpleNamespace(count_event=lambda kind, data: None),
                         limits=None, max_upload_bytes=1, model={},
                         max_backlog_bytes=max_backlog_bytes)
    service.start()
    return service, InstanceHandle(key="k", tenant="a", program="p", sink=EventSink(), kv_pages=1)


def test_a_backlog_filled_before_launch_returns_cuts_off_the_event_s_instance() -> None:
    """An instance can flood its client before `launch` has returned to the launching task
    (handle.instance_id still empty): the cut-off terminates the instance the events came from,
    and an unknown instance (forgotten meanwhile) is no error."""
    from host.sandbox.events import InstanceEvent

    terminated: list[tuple[str, str]] = []

    def terminate(instance_id: str, reason: str) -> bool:
        if instance_id != "i1":
            raise KeyError(f"unknown instance {instance_id!r}")
        terminated.append((instance_id, reason))
        return True

    async def main() -> None:
        service, handle = _service_with_sink(terminate)
        for _ in range(3):
            await trio.to_thread.run_sync(service._on_event_threaded, handle,
                                          InstanceEvent("i1", "message", "m" * 600))
        assert handle.cut_off and [instance_id for instance_id, _ in terminated] == ["i1"]
        assert "over server.max_client_backlog_bytes (1000)" in terminated[0][1]
        gone = _service_with_sink(terminate)[1]
        await trio.to_thread.run_sync(service._on_event_threaded, gone,
                                      InstanceEvent("i2", "message", "m" * 2000))
        assert gone.cut_off
    trio.run(main)


def test_events_in_flight_to_a_stalled_trio_loop_count_toward_the_backlog() -> None:
    """With the trio loop stalled, an instance's events on their way to it are counted when
    queued: the instance is cut off from its own thread once they pass the cap, later messages
    are dropped at the source, and its final event still arrives, once, last."""
    import threading
    import time

    from host.sandbox.events import InstanceEvent

    terminated: list[str] = []

    async def main() -> None:
        service, handle = _service_with_sink(lambda _id, reason: terminated.append(reason),
                                             max_backlog_bytes=100_000)
        emitted = threading.Event()

        def instance_thread() -> None:
            for _ in range(1000):                      # 1000 x ~10 kB: 100x the cap
                service._on_event_threaded(handle, InstanceEvent("i1", "message", "m" * 10_000))
            service._on_event_threaded(handle, InstanceEvent("i1", "terminated", "cut off"))
            emitted.set()

        threading.Thread(target=instance_thread).start()
        while not emitted.is_set():                    # the loop runs no callback meanwhile
            time.sleep(0.001)
        assert len(terminated) == 1 and "over server.max_client_backlog_bytes (100000)" in \
            terminated[0]
        assert handle.sink.num_bytes <= 100_000 + 64 + len("cut off")
        kinds = []
        with trio.fail_after(5):
            async for event in handle.sink:
                kinds.append(event.kind)
                if event.kind == "terminated":
                    break
        assert kinds == ["message"] * 9 + ["terminated"]
        assert handle.sink.num_bytes == 0 and handle.final_kind == "terminated"
        late = InstanceEvent("i1", "message", "late")      # a message behind the final event
        handle.sink.reserve(late)
        service._deliver(handle, late, handle.sink)          # dropped, and no longer counted
        assert handle.sink.num_bytes == 0
    trio.run(main)


def test_instances_still_blocked_in_wasi_count_toward_the_instance_quota() -> None:
    """An instance abandoned in a WASI call keeps its Store until the call returns: its tenant
    cannot launch past max_instances by leaving such instances behind."""
    from host.server.tenants import QuotaBook, QuotaExceeded, Tenant

    tenant = Tenant("a", max_instances=3, max_kv_pages=30, max_program_bytes=1 << 20)
    book = QuotaBook()
    book.add(tenant, "i1", 10)
    book.check_launch(tenant, 10, num_lingering=1)               # 1 + 1 + 1 fits in 3
    with pytest.raises(QuotaExceeded, match=r"\(1 running and 2 ended but still blocked in a "
                                            r"WASI call, of max_instances 3\)"):
        book.check_launch(tenant, 10, num_lingering=2)


def test_max_receive_wait_s_is_set_per_tenant_over_the_limits_section() -> None:
    """[limits] max_receive_wait_s reaches every instance's InstanceLimits; a tenant's own
    setting overrides it for that tenant's launches."""
    from types import SimpleNamespace

    from host.server.service import PieService
    from host.server.setup import build_runtime
    from host.server.tenants import TenantRegistry

    config = parse_config({"limits": {"max_receive_wait_s": 60.0}, "tenants": [
        {"name": "a", "token": "ta", "max_receive_wait_s": 0.5}, {"name": "b", "token": "tb"}]})
    runtime = build_runtime(config, FakeEngine(num_pages=16, page_size=4))
    try:
        limits = runtime.config.limits
    finally:
        runtime.close()
    assert limits.max_receive_wait_s == 60.0
    launched: list = []

    def launch(_program, _args, **fields) -> str:
        launched.append(fields["limits"])
        return f"i{len(launched)}"

    stand_in = SimpleNamespace(num_lingering=lambda _tenant: 0, launch=launch)
    metrics = SimpleNamespace(instances_launched=SimpleNamespace(inc=lambda: None))

    async def main() -> None:
        service = PieService(stand_in, store=None, metrics=metrics, limits=limits,
                             max_upload_bytes=1, model={})
        service.start()
        registry = TenantRegistry(config.tenants)
        for token in ("ta", "tb"):
            await service.launch(registry.authenticate(token), object(), "p", (), None)
    trio.run(main)
    assert [limits.max_receive_wait_s for limits in launched] == [0.5, 60.0]
    with pytest.raises(ConfigError, match="max_receive_wait_s must be positive"):
        parse_config({"tenants": [{"name": "a", "token": "t", "max_receive_wait_s": 0}]})
    with pytest.raises(ConfigError, match="limits.max_receive_wait_s must be positive"):
        parse_config({"limits": {"max_receive_wait_s": -1}, "tenants": [{"name": "a",
                                                                          "token": "t"}]})
