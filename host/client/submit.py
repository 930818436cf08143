"""`pie submit`: upload an inferlet to a server, launch it and stream its messages.

    pie submit app.wasm --server URL --token T [--no-stdin] [--logs] [-- args...]

Like `pie run`: each line read on stdin is sent to the instance as a client message (unless
--no-stdin); whenever the instance waits in `receive()` with nothing queued for it, stderr says so
once (the server's `list_instances` answers `waiting_for_input`, asked after a second without
events); Ctrl-C terminates the instance and says so. With --logs the instance's log (its
`inferlet.log` lines and print output) goes to stderr once it has ended.

The parser sets `func` to a handler taking the parsed namespace and returning an exit status
(host/cli.py registers it). An `app.py` is built first (host/sandbox/programs/build.py, imported
only then); the rest speaks to the server through this room's client.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import trio

__all__ = ["add_submit_parser", "run_submit", "SubmitOptions", "EXIT_INTERRUPTED"]

EXIT_INTERRUPTED = 130
QUIET_BEFORE_ASKING_S = 1.0     # no event for this long: ask whether the instance waits for input
ASK_EVERY_S = 0.5


@dataclass(frozen=True)
class SubmitOptions:
    """What `pie submit` does besides streaming the messages."""

    forward_stdin: bool = True     # send each stdin line as a client message
    show_logs: bool = False        # print the instance's log to stderr once it has ended


def _add_submit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=os.environ.get("PIE_SERVER", "http://127.0.0.1:8080"),
                        help="server URL (default: $PIE_SERVER or http://127.0.0.1:8080)")
    parser.add_argument("--token", default=os.environ.get("PIE_TOKEN"),
                        help="API token (default: $PIE_TOKEN)")
    parser.add_argument("--no-stdin", dest="stdin", action="store_false",
                        help="do not send stdin lines to the instance")
    parser.add_argument("--logs", action="store_true",
                        help="print the instance's log (inferlet.log lines, print output) to "
                             "stderr once it has ended")


def add_submit_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("submit", help="upload and run an inferlet on a server",
                                   description="Upload a component (or build an app.py first), "
                                   "launch it and stream its messages, like `pie run`: stdin "
                                   "lines are sent to it as client messages (--no-stdin: not), "
                                   "stderr says when it waits for input, Ctrl-C terminates it.")
    parser.add_argument("program", type=Path, help="app.wasm (or app.py, built first)")
    _add_submit_options(parser)
    # REMAINDER takes everything after the program (options too); run_submit splits it at "--"
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the inferlet's arguments")
    parser.set_defaults(func=run_submit)
    return parser


def _split_submit_args(namespace: argparse.Namespace) -> list[str]:
    """Parse the options left in the remainder (before "--"); return the inferlet's arguments."""
    rest = list(namespace.args)
    own, inferlet_args = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest \
        else (rest, [])
    options = argparse.ArgumentParser(prog="pie submit", add_help=False)
    _add_submit_options(options)
    options.set_defaults(stdin=namespace.stdin, logs=namespace.logs)
    options.parse_args(own, namespace=namespace)
    return inferlet_args


def _program_bytes(path: Path) -> bytes:
    if path.suffix == ".py":
        from host.progress import progress
        from host.sandbox.programs.build import build_cached
        with progress("pie submit", f"building {path} (componentize-py; cached afterwards)"):
            path, _ = build_cached(path)
    return path.read_bytes()


def run_submit(namespace: argparse.Namespace) -> int:
    """Upload, launch, stream the messages to stdout; the exit status says how it ended."""
    from host.client import PieError

    args = _split_submit_args(namespace)
    if not namespace.token:
        print("pie submit: no token: pass --token or set PIE_TOKEN", file=sys.stderr)
        return 2
    try:
        data = _program_bytes(namespace.program)
    except OSError as exc:
        print(f"pie submit: {namespace.program}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # host.sandbox.programs.build.BuildError, named by its message
        print(f"pie submit: {exc}", file=sys.stderr)
        return 2
    options = SubmitOptions(forward_stdin=namespace.stdin, show_logs=namespace.logs)
    try:
        return trio.run(_submit, namespace.server, namespace.token, data, args, options)
    except PieError as exc:
        print(f"pie submit: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pie submit: cannot reach {namespace.server}: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:      # Ctrl-C before the instance was launched
        if not _is_interrupt(exc):
            raise
        print("\npie submit: interrupted (Ctrl-C) before the instance was launched",
              file=sys.stderr)
        return EXIT_INTERRUPTED


def _is_interrupt(exc: BaseException) -> bool:
    """A KeyboardInterrupt, or an exception group of nothing else (trio's nurseries wrap)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_interrupt(inner) for inner in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


class _Follow:
    """What the tasks following one instance share (the trio thread only)."""

    def __init__(self) -> None:
        self.last_activity = time.monotonic()   # an event arrived, or a line was sent
        self.stdin_open = True
        self.told_waiting = False

    def active(self) -> None:
        self.last_activity = time.monotonic()
        self.told_waiting = False


async def _submit(server: str, token: str, data: bytes, args: list[str],
                  options: SubmitOptions = SubmitOptions()) -> int:
    from host.client import connect

    async with connect(server, token) as client:
        program = await client.upload(data)
        instance = await client.launch(program, args)
        try:
            with _interrupts() as interrupts:
                status = await _follow_until_interrupted(client, instance, options, interrupts)
        except BaseException as exc:      # Ctrl-C before the receiver was in place
            if not _is_interrupt(exc):
                raise
            status = None
        if status is None:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await instance.terminate()
            print(f"\npie submit: interrupted (Ctrl-C): instance {instance.id} terminated",
                  file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        if options.show_logs:
            _print_log(instance.id, await client.logs(instance.id), sys.stderr)
        return status


def _interrupts() -> Any:
    """SIGINT as a stream of trio's, where Python delivers signals (the main thread; elsewhere,
    as in a test's thread, None)."""
    if threading.current_thread() is threading.main_thread():
        return trio.open_signal_receiver(signal.SIGINT)
    return nullcontext(None)


async def _follow_until_interrupted(client: Any, instance: Any, options: SubmitOptions,
                                    interrupts: Any) -> int | None:
    """_follow's exit status, or None when a SIGINT from `interrupts` (None: none) came
    first. Ctrl-C is taken as a signal here, not as a KeyboardInterrupt raised wherever the
    process happens to be (inside the connection's reader, it left the connection unable to
    close)."""
    statuses: list[int] = []
    async with trio.open_nursery() as nursery:
        async def follow() -> None:
            statuses.append(await _follow(client, instance, options))
            nursery.cancel_scope.cancel()

        async def first_interrupt() -> None:
            async for _ in interrupts:
                nursery.cancel_scope.cancel()
                return
        nursery.start_soon(follow)
        if interrupts is not None:
            nursery.start_soon(first_interrupt)
    return statuses[0] if statuses else None


async def _follow(client: Any, instance: Any, options: SubmitOptions) -> int:
    """Stream the instance's events to stdout, forwarding stdin and saying when it waits for
    input, until its final event; the exit status of `pie run` for it."""
    state = _Follow()
    async with trio.open_nursery() as nursery:
        if options.forward_stdin:
            nursery.start_soon(_forward_stdin, instance, state)
        else:
            state.stdin_open = False
        nursery.start_soon(_tell_when_waiting, client, instance, state, options.forward_stdin)
        status = await _stream(instance, state)
        nursery.cancel_scope.cancel()
    return status


async def _stream(instance: Any, state: _Follow) -> int:
    async for event in instance.events():
        state.active()
        if event.kind == "message":
            print(event.data, flush=True)
        elif event.kind == "result":
            if event.data:
                print(event.data, flush=True)
            return 0
        else:   # the exit status of `pie run`: 1 error, 3 trap, 4 terminated
            print(f"pie submit: instance {instance.id} {event.kind}: {event.data}",
                  file=sys.stderr)
            return {"error": 1, "trap": 3, "terminated": 4}.get(event.kind, 1)
    return 1


async def _forward_stdin(instance: Any, state: _Follow) -> None:
    """Send each stdin line (without its newline) to the instance; stop at end of input or at
    the first refusal (named on stderr)."""
    from host.client import PieError

    while True:
        try:
            line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        except (OSError, ValueError):      # no readable stdin (closed, or a test's capture)
            line = ""
        if not line:
            state.stdin_open = False
            return
        try:
            await instance.send(line.rstrip("\n"))
        except PieError as refused:
            print(f"pie submit: stdin no longer forwarded: {refused}", file=sys.stderr)
            state.stdin_open = False
            return
        state.active()


async def _tell_when_waiting(client: Any, instance: Any, state: _Follow,
                             forwarding: bool) -> None:
    """Once per quiet spell, say on stderr that the instance waits in receive() for input."""
    while True:
        await trio.sleep(ASK_EVERY_S)
        if state.told_waiting or time.monotonic() - state.last_activity < QUIET_BEFORE_ASKING_S:
            continue
        try:
            listed = await client.list_instances()
        except Exception:  # noqa: BLE001 -- a hint only; the stream reports real failures
            return
        if not any(entry["instance_id"] == instance.id and entry.get("waiting_for_input")
                   for entry in listed):
            continue
        state.told_waiting = True
        if state.stdin_open:
            how = "type a line" if sys.stdin.isatty() else "stdin is read line by line"
        elif forwarding:
            how = "stdin has ended; another client of this tenant may send to it, or Ctrl-C"
        else:
            how = "--no-stdin: another client of this tenant may send to it, or Ctrl-C"
        print(f"pie submit: instance {instance.id} is waiting for input ({how})",
              file=sys.stderr, flush=True)


def _print_log(instance_id: str, lines: list[str], out: TextIO) -> None:
    """The instance's log on `out`, each line indented under a heading."""
    print(f"pie submit: log of instance {instance_id} ({len(lines)} lines):", file=out)
    for line in lines:
        print(f"  {line}", file=out)
    out.flush()
