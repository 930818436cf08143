"""A real `pie serve` on 127.0.0.1 (ephemeral port) in a thread of the test process."""
from __future__ import annotations

import threading
from functools import partial
from typing import Any

import trio

from host.server.app import serve
from host.server.server_config import ServerConfig

__all__ = ["ServerThread"]


class ServerThread:
    """Runs `serve(config, engine=engine, port=0)` in its own trio loop; `url` once started."""

    def __init__(self, config: ServerConfig, engine: Any = None) -> None:
        self.config = config
        self.engine = engine
        self.url = ""
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._shutdown: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="pie-test-server", daemon=True)

    def start(self, timeout: float = 300.0) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("server did not start")
        if self.error is not None:
            raise self.error
        return self

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # surfaced by start() / stop()
            self.error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve, self.config, engine=self.engine, port=0,
                                                shutdown=self._shutdown))
            self.url = binds[0]
            self._ready.set()

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/ws"

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful shutdown; raises what the server raised, if anything."""
        if self._token is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._shutdown.set, trio_token=self._token)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("server did not shut down")
        if self.error is not None:
            raise self.error
