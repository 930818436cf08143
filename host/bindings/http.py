"""`pie:inferlet/http`: outgoing requests under the tenant's allowlist (host/outbound/).

`send` checks and starts a request on the runtime's outbound loop and returns a
pending-response resource at once; a refusal (a host outside allow_hosts, a limit reached) is
kept as that resource's err. `get` blocks through `Instance.wait_future` (terminate and
max_blocking_s wake it) and hands the answer over once. The instance's handles live in its
`InstanceOutbound` (tables.outbound), cleared at its end.
"""
from __future__ import annotations

from typing import Any

from wasmtime.component import Record

from host.bindings.context import BindingContext
from host.errors import TrapError
from host.outbound import HttpRequest, HttpResponse
from host.sandbox.wasm.wit_codec import HostResource

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "PENDING_RESPONSE_TYPE"]

INTERFACE = "pie:inferlet/http@0.1.0"
PENDING_RESPONSE_TYPE = 31


def send(ctx: BindingContext, method: str, url: str, headers: list[tuple[str, str]],
         body: bytes | list[int]) -> HostResource:
    request = HttpRequest(method.upper(), url, tuple((str(n), str(v)) for n, v in headers),
                          bytes(body))
    rep = ctx.tables.outbound.send("http.send", request)
    return HostResource(rep, PENDING_RESPONSE_TYPE)


def ready(ctx: BindingContext, store: Any, rep: int) -> bool:
    future = ctx.tables.outbound.future_of("pending-response.ready", rep)
    return future is None or future.done()


def get(ctx: BindingContext, store: Any, rep: int) -> Record | str:
    call = "pending-response.get"
    future = ctx.tables.outbound.future_of(call, rep)
    if future is not None and not future.done():
        try:
            ctx.wait_future(future, call)
        except TrapError:              # terminated, or max_blocking_s passed
            raise
        except Exception:  # noqa: BLE001 -- the request's own failure: take() words it
            pass
    answer = ctx.tables.outbound.take("http.send", rep)
    return answer if isinstance(answer, str) else _lower(answer)


def drop(ctx: BindingContext, rep: int) -> None:
    ctx.tables.outbound.drop(rep)


def _lower(response: HttpResponse) -> Record:
    record = Record()
    for name, value in (("status", response.status), ("headers", list(response.headers)),
                        ("body", response.body), ("url", response.url)):
        setattr(record, name, value)
    return record


FUNCTIONS = {"send": send}
METHODS = {"[method]pending-response.ready": ready, "[method]pending-response.get": get}
RESOURCES = {"pending-response": (PENDING_RESPONSE_TYPE, drop)}
