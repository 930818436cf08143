"""`pie serve`: the argparse sub-command that host/cli.py registers.

    pie serve [--config pie.toml] [--host 127.0.0.1] [--port 8080] [--ray [ADDRESS]]

The parser sets `func` to a handler taking the parsed namespace and returning an exit status.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from functools import partial
from pathlib import Path

import trio

__all__ = ["add_serve_parser", "run_serve"]

_EXAMPLE_CONFIG = """\
[server]
port = 8080

[[tenants]]
name = "me"
token_env = "PIE_TOKEN"     # or: token = "a-long-secret"
"""


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="run the multi-tenant server",
                                   description="Serve pie over HTTP/websocket (see docs/server.md).")
    parser.add_argument("--config", type=Path, default=None,
                        help="TOML config (default: ./pie.toml)")
    parser.add_argument("--host", default=None, help="address to listen on (overrides config)")
    parser.add_argument("--port", type=int, default=None, help="port (overrides config; 0 = any)")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="serve engine replicas on Ray ([cluster] in the config): join the "
                             "Ray cluster at ADDRESS ('auto': the running one), or start one "
                             "here when none is given")
    parser.set_defaults(func=run_serve)
    return parser


def run_serve(namespace: argparse.Namespace) -> int:
    """Load the config and serve until SIGINT/SIGTERM (then shut down gracefully)."""
    from host.server.server_config import ConfigError, load_config

    path = namespace.config or Path("pie.toml")
    if namespace.config is None and not path.exists():
        print(f"pie serve: no config: pass --config FILE or create ./pie.toml, e.g.\n\n"
              f"{_EXAMPLE_CONFIG}", file=sys.stderr)
        return 2
    try:
        config = load_config(path)
        for tenant in config.tenants:
            tenant.resolved_token()
        if getattr(namespace, "ray", None) is not None:
            address = namespace.ray or config.cluster.address
            config = dataclasses.replace(config, cluster=dataclasses.replace(
                config.cluster, enabled=True, address=address))
    except (ConfigError, ValueError) as exc:
        print(f"pie serve: {exc}", file=sys.stderr)
        return 2
    _show_engine_log()
    trio.run(partial(_serve_until_signal, config, namespace.host, namespace.port))
    return 0


def _show_engine_log() -> None:
    """The engine's load-time lines (which kernels run, and why) and the start's slow steps
    (loading, building, compiling, warming: host/progress.py) on stderr, like `pie run`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("pie serve: %(message)s"))
    for name in ("pie.engine", "pie.serve"):
        shown = logging.getLogger(name)
        shown.addHandler(handler)
        shown.setLevel(logging.INFO)


async def _serve_until_signal(config, host: str | None, port: int | None) -> None:
    from host.server.app import serve

    shutdown = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve, config, host=host, port=port,
                                                shutdown=shutdown))
            print(f"pie serve: listening on {', '.join(binds)} (Ctrl-C to stop)", flush=True)
            async for _ in signals:
                print("pie serve: shutting down (running instances get "
                      f"{config.server.shutdown_grace_s:g} s)", flush=True)
                shutdown.set()
                break
