"""The WIT bindings: one module per interface of wit/inferlet.wit, each a thin adapter (check,
translate, submit). `build_linker` registers them all, plus WASI 0.2, on one component Linker,
through `fast_calls.add_host_function` (converters built once per function and program) and
`add_host_resource`, with the value helpers of libwasmtime keeping the GIL (`gil_calls`).

Every host function is wrapped by `_host_function`: it finds the calling Instance (the one whose
thread this is), runs the adapter, stamps the instance's last host exit (the idle clock), and lets
no Python exception reach Wasmtime: a TrapError (guest misuse) or any other error is recorded as
the cause on *that* instance and re-raised as a WasmtimeError naming the instance and the cause.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from wasmtime import Engine, WasmtimeError
from wasmtime.component import Linker, ResourceType

from host.bindings import (adapters, children, forward, http, kv, mcp, messaging, queue,
                           runtime, tokenize)
from host.sandbox.wasm import gil_calls
from host.sandbox.wasm.fast_calls import add_host_function, add_host_resource
from host.errors import TrapError

__all__ = ["build_linker", "provided_items", "INTERFACE_MODULES"]

INTERFACE_MODULES = (runtime, queue, kv, forward, tokenize, messaging, adapters, children,
                     http, mcp)
_log = logging.getLogger("pie.bindings")


def provided_items() -> dict[str, frozenset[str]]:
    """Interface name -> names of the functions and resources the host defines there."""
    return {module.INTERFACE: frozenset(module.FUNCTIONS) | frozenset(module.METHODS)
            | frozenset(module.RESOURCES) for module in INTERFACE_MODULES}


def build_linker(engine: Engine, current: threading.local) -> Linker:
    """A Linker with WASI 0.2 (sandboxed per store by its WasiConfig) and every pie interface."""
    gil_calls.keep_gil_in_value_helpers()
    linker = Linker(engine)
    linker.add_wasip2()
    with linker.root() as root:
        for module in INTERFACE_MODULES:
            with root.add_instance(module.INTERFACE) as interface:
                for name, (type_id, dtor) in module.RESOURCES.items():
                    add_host_resource(interface, name, ResourceType.host(type_id),
                                      _resource_dtor(f"{name}.drop", dtor, current))
                short = module.INTERFACE.split("/")[1].split("@")[0]
                for name, impl in module.FUNCTIONS.items():
                    add_host_function(interface, name, _host_function(
                        f"{short}.{name}", impl, current, with_store=False), current)
                for name, impl in module.METHODS.items():
                    add_host_function(interface, name, _host_function(
                        f"{short}.{name}", impl, current, with_store=True), current)
    return linker


def _host_function(call: str, impl: Callable[..., Any], current: threading.local,
                   with_store: bool) -> Callable[..., Any]:
    def host_function(store: Any, *args: Any) -> Any:
        instance = getattr(current, "instance", None)
        if instance is None:
            raise WasmtimeError(f"{call}: called outside any pie instance thread")
        instance.num_host_calls_active += 1
        try:
            instance.check_not_cancelled(call)     # a terminated instance makes no more calls
            if with_store:
                return impl(instance, store, *args)
            return impl(instance, *args)
        except TrapError as exc:
            cause = str(exc)
        except WasmtimeError as exc:
            cause = f"{call}: {str(exc).strip().splitlines()[-1]}"
        except Exception as exc:  # noqa: BLE001 -- a host bug becomes this instance's trap only
            _log.exception("instance %s: host error in %s", instance.instance_id, call)
            cause = f"{call}: host error: {exc!r}"
        finally:
            instance.last_host_exit = time.monotonic()
            instance.num_host_calls_active -= 1
        if instance.trap_cause is None:
            instance.trap_cause = cause
        raise WasmtimeError(f"instance {instance.instance_id}: {cause}")
    host_function.__name__ = call
    return host_function


def _resource_dtor(call: str, impl: Callable[..., None],
                   current: threading.local) -> Callable[[Any, int], None]:
    def dtor(store: Any, rep: int) -> None:
        instance = getattr(current, "instance", None)
        if instance is None:
            return   # not on an instance thread: the instance's own table is cleared at its end
        try:
            impl(instance, rep)
        except Exception:  # noqa: BLE001
            _log.exception("instance %s: error in %s", instance.instance_id, call)
    return dtor
