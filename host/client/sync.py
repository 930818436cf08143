"""A small blocking wrapper over the trio client, for scripts and notebooks.

    with SyncClient("http://127.0.0.1:8080", token) as client:
        program = client.upload(open("app.wasm", "rb").read())
        instance_id = client.launch(program, ["hello"])
        for event in client.events(instance_id):
            print(event.kind, event.data)

The trio client runs on a thread of its own (its own `trio.run`); every method hops onto it with
`trio.from_thread.run` and blocks until the answer comes.
"""
from __future__ import annotations

import threading
from functools import partial
from typing import Any, Callable, Iterator

import trio

from host.client.client import Event, Instance, PieClient, connect

__all__ = ["SyncClient"]


class SyncClient:
    """Blocking client; a context manager (or call `close()`)."""

    def __init__(self, server: str, token: str, *, binary: bool = True) -> None:
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._client: PieClient | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._instances: dict[str, Instance] = {}
        self._thread = threading.Thread(target=trio.run, args=(self._main, server, token, binary),
                                        name="pie-client", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    async def _main(self, server: str, token: str, binary: bool) -> None:
        try:
            async with connect(server, token, binary=binary) as client:
                self._client, self._stop = client, trio.Event()
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # reported to the constructor's caller
            self._failure = exc
        finally:
            self._ready.set()

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return trio.from_thread.run(partial(fn, *args, **kwargs), trio_token=self._token)

    def upload(self, data: bytes) -> str:
        return self._call(self._client.upload, data)

    def launch(self, program: str, args: list[str] | tuple[str, ...] = (), *,
               kv_pages: int | None = None, affinity: str | None = None) -> str:
        instance = self._call(self._client.launch, program, args, kv_pages=kv_pages,
                              affinity=affinity)
        self._instances[instance.id] = instance
        return instance.id

    def send(self, instance_id: str, message: str) -> None:
        """Send a client message to a running instance of this tenant (PieClient.send)."""
        self._call(self._client.send, instance_id, message)

    def terminate(self, instance_id: str) -> None:
        """Ask the server to end an instance of this tenant (PieClient.terminate)."""
        self._call(self._client.terminate, instance_id)

    def logs(self, instance_id: str) -> list[str]:
        """The log lines of an instance of this tenant, running or ended (PieClient.logs)."""
        return self._call(self._client.logs, instance_id)

    def events(self, instance_id: str) -> Iterator[Event]:
        """Events of an instance this client launched, until (and including) its final one
        (events go to the launching connection only)."""
        instance = self._instances[instance_id]
        while instance.final is None:
            yield self._call(instance.next_event)

    def wait(self, instance_id: str) -> Event:
        """The final event of an instance this client launched (messages before it are
        skipped)."""
        return self._call(self._instances[instance_id].wait)

    def list_programs(self) -> list[dict[str, Any]]:
        return self._call(self._client.list_programs)

    def list_instances(self) -> list[dict[str, Any]]:
        return self._call(self._client.list_instances)

    def model_info(self) -> dict[str, Any]:
        return self._call(self._client.model_info)

    def upload_adapter(self, name: str, directory: Any) -> dict[str, Any]:
        """PieClient.upload_adapter: the tenant's LoRA adapter `name` from a PEFT directory."""
        return self._call(self._client.upload_adapter, name, directory)

    def list_adapters(self) -> list[dict[str, Any]]:
        return self._call(self._client.list_adapters)

    def delete_adapter(self, name: str) -> None:
        self._call(self._client.delete_adapter, name)

    def close(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
