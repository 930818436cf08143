"""`pie submit`: upload an inferlet to a server, launch it and stream its messages.

    pie submit app.wasm --server URL --token T [-- args...]

The parser sets `func` to a handler taking the parsed namespace and returning an exit status
(host/cli.py registers it). An `app.py` is built first (host/sandbox/programs/build.py, imported
only then); the rest speaks to the server through this room's client.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import trio

__all__ = ["add_submit_parser", "run_submit"]


def _add_submit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=os.environ.get("PIE_SERVER", "http://127.0.0.1:8080"),
                        help="server URL (default: $PIE_SERVER or http://127.0.0.1:8080)")
    parser.add_argument("--token", default=os.environ.get("PIE_TOKEN"),
                        help="API token (default: $PIE_TOKEN)")


def add_submit_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("submit", help="upload and run an inferlet on a server",
                                   description="Upload a component (or build an app.py first), "
                                   "launch it and stream its messages, like `pie run`.")
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
    options.parse_args(own, namespace=namespace)
    return inferlet_args


def _program_bytes(path: Path) -> bytes:
    if path.suffix == ".py":
        from host.sandbox.programs.build import build_cached
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
    try:
        return trio.run(_submit, namespace.server, namespace.token, data, args)
    except PieError as exc:
        print(f"pie submit: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pie submit: cannot reach {namespace.server}: {exc}", file=sys.stderr)
        return 1


async def _submit(server: str, token: str, data: bytes, args: list[str]) -> int:
    from host.client import connect

    async with connect(server, token) as client:
        program = await client.upload(data)
        instance = await client.launch(program, args)
        try:
            async for event in instance.events():
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
        except KeyboardInterrupt:
            with trio.CancelScope(shield=True):
                await instance.terminate()
            return 130
    return 1
