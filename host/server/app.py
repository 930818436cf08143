"""The ASGI app (Starlette) and `serve`: one process, Hypercorn on trio, the runtime inside.

Routes: GET /health, GET /metrics, websocket /ws (see ws.py), and when enabled the OpenAI API
(GET /v1/models, POST /v1/completions, POST /v1/chat/completions; see openai.py).

`serve(config)` builds the engine (unless one is given), the runtime, the program store and the
service, starts Hypercorn, and reports the bound addresses through `task_status` (so tests can
bind port 0). Setting the `shutdown` event starts a graceful shutdown: the listeners close, new
launches are refused, running instances get `server.shutdown_grace_s` to finish and are then
terminated, and the runtime is closed (every page returned).
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from host.server.metrics import CONTENT_TYPE, ServerMetrics
from host.server.server_config import ServerConfig
from host.server.setup import ServerContext, build_context
from host.server.ws import Connection

__all__ = ["build_app", "serve"]

_log = logging.getLogger(__name__)


def build_app(context: ServerContext) -> Starlette:
    """The Starlette app over a started service."""

    async def health(_: Request) -> Response:
        status = "shutting down" if context.service.closing.is_set() else "ok"
        return JSONResponse({"status": status, "model": context.service.model_info()["name"]},
                            status_code=503 if status != "ok" else 200)

    async def metrics(_: Request) -> Response:
        return Response(context.metrics.render(), media_type=CONTENT_TYPE)

    async def websocket(ws: WebSocket) -> None:
        connection = Connection(ws, context.service, context.tenants,
                                max_chunk_bytes=context.config.server.max_chunk_bytes,
                                grace_s=context.config.server.shutdown_grace_s)
        await connection.run()

    routes: list = [Route("/health", health), Route("/metrics", metrics),
                    WebSocketRoute("/ws", websocket)]
    if context.openai is not None:
        routes += context.openai.routes()
    return Starlette(routes=routes)


def _hypercorn_config(config: ServerConfig, host: str, port: int) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [f"{host}:{port}"]
    hc.websocket_max_message_size = config.server.max_message_bytes
    hc.graceful_timeout = config.server.shutdown_grace_s + 5.0
    hc.accesslog = None
    hc.errorlog = _log
    return hc


async def _sample_metrics(metrics: ServerMetrics) -> None:
    while True:
        metrics.sample()
        await trio.sleep(1.0)


async def serve(config: ServerConfig, *, engine: Any = None, host: str | None = None,
                port: int | None = None, shutdown: trio.Event | None = None,
                task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
    """Run the server until `shutdown` is set (or forever); `task_status.started(urls)`."""
    shutdown = trio.Event() if shutdown is None else shutdown
    context = await build_context(config, engine)
    hc = _hypercorn_config(config, host or config.server.host,
                           config.server.port if port is None else port)
    app = build_app(context)

    async def trigger() -> None:
        await shutdown.wait()
        context.service.closing.set()      # websocket handlers start draining their instances

    try:
        async with trio.open_nursery() as outer:
            outer.start_soon(_sample_metrics, context.metrics)
            async with trio.open_nursery() as inner:
                binds = await inner.start(partial(hypercorn_serve, app, hc,
                                                  shutdown_trigger=trigger))
                task_status.started(binds)
            outer.cancel_scope.cancel()    # hypercorn returned: listeners closed, connections done
    finally:
        with trio.CancelScope(shield=True):
            await context.service.shutdown(config.server.shutdown_grace_s)
