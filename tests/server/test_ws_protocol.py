"""The websocket protocol on a real server (real Runtime, fake engine): auth, malformed frames,
uploads (chunked, corrupt, oversized, re-upload), unknown programs. Every refusal is an error
naming the problem, and the connection keeps working afterwards."""
from __future__ import annotations

import hashlib
import json

import msgpack
import pytest
import trio
from trio_websocket import open_websocket_url

from host.client import PieError, connect
from tests.server.conftest import TOKENS, wait_until_idle


async def _refused(coro, expected: str) -> None:
    with pytest.raises(PieError) as error:
        await coro
    assert expected in str(error.value)


def test_authentication_failures_keep_the_connection_up(fake_server) -> None:
    async def main() -> None:
        async with connect(fake_server.url, None, binary=False) as client:
            await _refused(client.list_programs(), "not authenticated")
            await _refused(client.authenticate("wrong-token"), "authentication failed: invalid token")
            await _refused(client.launch("ab" * 32), "not authenticated")
            assert await client.authenticate(TOKENS["bob"]) == "bob"
            assert isinstance(await client.list_programs(), list)
    trio.run(main)


def test_bearer_header_authenticates(fake_server) -> None:
    async def main() -> None:
        headers = [("Authorization", f"Bearer {TOKENS['alice']}")]
        async with open_websocket_url(fake_server.ws_url, extra_headers=headers) as ws:
            await ws.send_message(json.dumps({"type": "model_info", "id": 7}))
            answer = json.loads(await ws.get_message())
            assert answer["type"] == "ok" and answer["id"] == 7
            assert answer["name"] == "fake-byte-model" and answer["page_size"] == 16
        async with open_websocket_url(fake_server.ws_url,
                                      extra_headers=[("Authorization", "Bearer nope")]) as ws:
            await ws.send_message(json.dumps({"type": "model_info", "id": 8}))
            answer = json.loads(await ws.get_message())
            assert answer == {"type": "error", "id": 8, "message": answer["message"]}
            assert "not authenticated" in answer["message"]
    trio.run(main)


@pytest.mark.parametrize("frame, expected", [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "a message must be an object, got list"),
    ('{"id": 3}', "message has no 'type' field"),
    ('{"type": "fly", "id": 4}', "unknown message type 'fly'"),
    ('{"type": "launch", "program": 12, "id": 5}', "expected str, got int @ launch.program"),
    ('{"type": "launch", "id": 6}', "required field missing @ launch.program"),
    ('{"type": "send", "instance_id": "x", "message": "m", "extra": 1}', "extra fields found (extra)"),
    ('{"type": "upload_chunk", "upload_id": "u", "data": "***"}', "expected base64 text"),
    (b"\xc1\xc1", "malformed msgpack: a byte that starts no msgpack value (FormatError)"),
    (b"\x91\x01\x02", "malformed msgpack: unpack(b) received extra data. (ExtraData)"),
    (b"\xd9", "malformed msgpack: Unpack failed: incomplete input"),
    (msgpack.packb({"type": "terminate"}), "required field missing @ terminate.instance_id"),
    ('{"type": "auth", "token": "\\ud800", "id": 9}',
     "expected valid Unicode text, got a string with a lone surrogate @ auth.token"),
    ('{"type": "send", "instance_id": "x", "message": "a\\udfffb"}',
     "lone surrogate @ send.message"),
    ('{"type": "launch", "program": "p", "args": "--n 3"}',
     "expected a list of strings, got str @ launch.args"),
    ('{"type": "launch", "program": "p", "args": {"n": "3"}}',
     "expected a list of strings, got dict @ launch.args"),
    ('{"type": "launch", "program": "p", "args": ["a", 3]}',
     "item 1: expected str, got int @ launch.args"),
    (msgpack.packb({"type": "launch", "program": "p", "args": "abc"}),
     "expected a list of strings, got str @ launch.args"),
])
def test_malformed_frames_get_named_errors(fake_server, frame, expected: str) -> None:
    async def main() -> None:
        async with connect(fake_server.url, TOKENS["bob"]) as client:
            await client.send_raw(frame)
            with trio.fail_after(5):
                while not client.notices:
                    await trio.sleep(0.01)
            assert any(expected in notice for notice in client.notices), client.notices
            assert not any(notice.rstrip().endswith(":") for notice in client.notices)
            assert not any("internal error" in notice for notice in client.notices)
            assert (await client.model_info())["name"] == "fake-byte-model"   # still up
    trio.run(main)


def test_errors_carry_the_request_id(fake_server) -> None:
    async def main() -> None:
        async with open_websocket_url(fake_server.ws_url) as ws:
            await ws.send_message(json.dumps({"type": "launch", "program": 12, "id": 41}))
            answer = json.loads(await ws.get_message())
            assert answer["type"] == "error" and answer["id"] == 41
    trio.run(main)


def test_upload_is_content_addressed_and_reupload_is_a_noop(fake_server, probe_wasm) -> None:
    async def main() -> None:
        digest = hashlib.sha256(probe_wasm).hexdigest()
        async with connect(fake_server.url, TOKENS["alice"], binary=False) as client:
            assert await client.upload(probe_wasm, chunk_bytes=512 * 1024) == digest  # base64 chunks
            begin = await client.request("upload_begin", sha256=digest, size=len(probe_wasm))
            assert begin["exists"] is True and "upload_id" not in begin
            programs = await client.list_programs()
            assert programs.count({"sha256": digest, "size": len(probe_wasm)}) == 1
    trio.run(main)


def test_corrupt_and_oversized_uploads_are_refused(fake_server) -> None:
    async def main() -> None:
        data = b"\0asm" + bytes(range(256)) * 8
        async with connect(fake_server.url, TOKENS["alice"]) as client:
            begin = await client.request("upload_begin", sha256="0" * 64, size=len(data))
            await client.request("upload_chunk", upload_id=begin["upload_id"], data=data)
            await _refused(client.request("upload_end", upload_id=begin["upload_id"]),
                           "sha256 mismatch: declared " + "0" * 64)
            await _refused(client.request("upload_begin", sha256="0" * 64, size=64 * 1024 * 1024),
                           "size 67108864 out of range (1..33554432 bytes)")
            await _refused(client.request("upload_begin", sha256="XYZ", size=10),
                           "sha256 must be 64 lower-case hex digits")
            digest = hashlib.sha256(data).hexdigest()
            begin = await client.request("upload_begin", sha256=digest, size=10)
            await _refused(client.request("upload_chunk", upload_id=begin["upload_id"], data=data),
                           "more than the declared 10 bytes; upload aborted")
            await _refused(client.request("upload_end", upload_id=begin["upload_id"]),
                           f"unknown upload {begin['upload_id']!r}")
            await _refused(client.upload(data), "not a valid inferlet component")
            assert digest not in [p["sha256"] for p in await client.list_programs()]
    trio.run(main)


def test_program_quota_is_enforced(fake_server, probe_wasm) -> None:
    async def main() -> None:
        async with connect(fake_server.url, TOKENS["tiny"]) as client:
            await _refused(client.upload(probe_wasm), "program quota")
    trio.run(main)


def test_unknown_program_and_instance(fake_server) -> None:
    async def main() -> None:
        async with connect(fake_server.url, TOKENS["bob"]) as client:
            await _refused(client.launch("ab" * 32), f"unknown program {'ab' * 32!r}: upload it first")
            await _refused(client.launch("not-a-hash"), "unknown program 'not-a-hash'")
            await _refused(client.send("nope", "hi"), "unknown instance 'nope'")
            await _refused(client.terminate("nope"), "unknown instance 'nope'")
    trio.run(main)
    wait_until_idle(fake_server.url)


def test_docs_name_every_request_and_client_call() -> None:
    """docs/server.md's protocol table has a row per request type, and its client table a row
    per public call of SyncClient."""
    from pathlib import Path

    from host.client import SyncClient
    from host.server.protocol import CLIENT_MESSAGES

    text = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    for kind in CLIENT_MESSAGES:
        assert f"\n| `{kind}` |" in text, kind
    calls = [name for name in vars(SyncClient) if not name.startswith("_") and name != "close"]
    for name in calls:
        assert f"`{name}(" in text, name
