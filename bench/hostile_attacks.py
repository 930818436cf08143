"""The attacks bench/hostile_serve.py runs from tenant A against a real `pie serve`.

Each attack is an async function (server URL, token, programs) -> how it ended, one line: the
final event's kind and data (or the server's refusal) of the hostile instance or client. The
guests are the hostile components of tests/host/wat/ (built by tests/host/components.py) and
bench/guests/hostile_serve.py (built with `pie build`).
"""
from __future__ import annotations

import hashlib
import json
from typing import Awaitable, Callable

import trio
from trio_websocket import open_websocket_url

from host.client import PieError, connect

__all__ = ["ATTACKS", "WAT_GUESTS", "Attack"]

Attack = Callable[[str, str, dict[str, str]], Awaitable[str]]
WAT_GUESTS = ("multi_memory", "table_bomb", "store_flood", "chatty", "flood", "deaf", "hoard",
              "bad_sampler", "long_pass", "spin", "sleeper")
MiB = 1024 * 1024


def _ended(event) -> str:
    """The final event in one line: its kind, the first line of its data (where the host names
    a limit it saw hit) and, for a traceback, its last line (the exception)."""
    lines = event.data.strip().splitlines() or [""]
    shown = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{event.kind}: {shown[:200]}"


async def _one(url: str, token: str, program: str, args: list[str]) -> str:
    async with connect(url, token) as client:
        return _ended(await (await client.launch(program, args)).wait())


def guest(name: str, *args: str) -> Attack:
    """Launch one instance of `name` and wait for its final event."""
    async def attack(url: str, token: str, programs: dict[str, str]) -> str:
        return await _one(url, token, programs[name], list(args))
    return attack


def many(name: str, count: int, *args: str) -> Attack:
    """`count` instances of `name` at once; their distinct outcomes with counts."""
    async def attack(url: str, token: str, programs: dict[str, str]) -> str:
        outcomes: list[str] = []

        async def run_one() -> None:
            outcomes.append(await _one(url, token, programs[name], list(args)))
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(run_one)
        return "; ".join(f"{outcomes.count(o)} x {o}" for o in sorted(set(outcomes)))
    return attack


async def non_reading_client(url: str, token: str, programs: dict[str, str]) -> str:
    """`flood` sends 1 MiB messages forever to a client that reads nothing for 5 s; then the
    client drains: the messages it got and its one final event."""
    headers = [("Authorization", f"Bearer {token}")]
    ws_url = url.replace("http://", "ws://") + "/ws"
    async with open_websocket_url(ws_url, extra_headers=headers, message_queue_size=1,
                                  max_message_size=64 * MiB) as ws:
        await ws.send_message(json.dumps({"type": "launch", "program": programs["flood"],
                                          "args": ["m" * MiB], "id": 1}))
        await trio.sleep(5.0)
        num_messages, finals = 0, []
        with trio.move_on_after(120):
            while not finals:
                event = json.loads(await ws.get_message())
                if event.get("type") != "event":
                    continue
                if event["kind"] == "message":
                    num_messages += 1
                else:
                    finals.append(f"{event['kind']}: {event['data'][:160]}")
        with trio.move_on_after(0.5):
            while True:                       # anything after the final event is counted too
                json.loads(await ws.get_message())
                finals.append("an event after the final one")
    return f"{num_messages} messages read late, then {' | '.join(finals) or 'no final event'}"


async def unread_client_messages(url: str, token: str, programs: dict[str, str]) -> str:
    """Send 256 Ki-character messages to `deaf` (it never reads them) until the server refuses."""
    async with connect(url, token) as client:
        instance = await client.launch(programs["deaf"])
        await instance.next_event()                        # "listening"
        refusal = "never refused"
        for num_sent in range(4096):
            try:
                await instance.send("c" * (256 * 1024))
            except PieError as exc:
                refusal = f"refused after {num_sent} messages: {str(exc)[:160]}"
                break
        await instance.terminate()
        await instance.wait()
        return refusal


async def uploads_in_flight(url: str, token: str, programs: dict[str, str]) -> str:
    """8 connections each begin a 60 MiB upload and send half of it, never finishing."""
    outcomes: list[str] = []

    async def upload(index: int, opened: trio.Event, done: trio.Event) -> None:
        async with connect(url, token) as client:
            try:
                begin = await client.request("upload_begin", size=60 * MiB,
                                             sha256=hashlib.sha256(bytes([index])).hexdigest())
                for _ in range(30):
                    await client.request("upload_chunk", upload_id=begin["upload_id"],
                                         data=b"u" * MiB)
                outcomes.append("30 MiB sent, left open")
            except PieError as exc:
                outcomes.append(f"refused: {str(exc)[:160]}")
            opened.set()
            await done.wait()                  # hold the connection (and the upload) open

    done = trio.Event()
    async with trio.open_nursery() as nursery:
        events = [trio.Event() for _ in range(8)]
        for index, opened in enumerate(events):
            nursery.start_soon(upload, index, opened, done)
        for opened in events:
            await opened.wait()
        done.set()
    return "; ".join(f"{outcomes.count(o)} x {o}" for o in sorted(set(outcomes)))


def later(delay_s: float, attack: Attack) -> Attack:
    """`attack` once the others have launched (a fork bomb takes what is left of the tenant's
    instance quota)."""
    async def delayed(url: str, token: str, programs: dict[str, str]) -> str:
        await trio.sleep(delay_s)
        return await attack(url, token, programs)
    return delayed


ATTACKS: dict[str, Attack] = {
    "memory: a str doubled (Python)": guest("hostile", "memory"),
    "memory: 4 linear memories": guest("multi_memory"),
    "tables: 3 grown tables": guest("table_bomb"),
    "key-value store flood": guest("store_flood"),
    "topic flood: 1 GiB unread": guest("hostile", "topic", "2048"),
    "log flood: 20,000 x 8,000 chars": guest("hostile", "log", "20000"),
    "logs of 8 ended instances": many("chatty", 8),
    "result of 100 M characters": guest("hostile", "result", "100000000"),
    "client that does not read": non_reading_client,
    "client messages never read": unread_client_messages,
    "uploads in flight: 8 x 60 MiB": uploads_in_flight,
    "page hoarding: 4 instances": many("hoard", 4),
    "NaN temperature sampler": guest("bad_sampler"),
    "one page listed 2,048 times": guest("long_pass"),
    "compute without host calls": guest("spin"),
    "sleep in WASI": guest("sleeper"),
    "10,000 spawns, each killed": guest("hostile", "spawn-flood", "10000"),
    "fork bomb of children": later(2.0, guest("hostile", "fork-bomb")),
}
