"""The engine's adapters: registered by name, loaded on first use, kept resident up to a budget.

`register(name, directory)` checks a PEFT adapter against the base model from its config and
safetensors header (engine.adapters.peft) and remembers where it is; the tensors are read when a
batch first names it. An adapter may be registered in a scope (a server's tenant): its engine
name (what ForwardRequest.adapter names) is then `scoped_name(scope, name)`, "scope/name",
which no unscoped name can be; `resolve(name, scope)` finds the scope's own adapter first, then
an unscoped one. Resident adapters are evicted least recently used while their bytes
exceed `memory_bytes`, never one the batch being prepared names (a batch naming more than the
budget holds runs, and the surplus goes at the next batch). The stacks of the last set of
adapters a batch used (engine.adapters.apply) are kept for the next batch naming the same set,
a decode loop's every step; they are counted apart (`stacked_bytes`).
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from engine.adapters.apply import LoraPass, StackedAdapters, stack_adapters
from engine.adapters.peft import (AdapterError, AdapterSpec, LoraAdapter, load_adapter,
                                  read_adapter_spec)
from engine.batch import ForwardRequest
from engine.engine_config import ModelConfig
from engine.errors import RequestError

__all__ = ["AdapterStore", "AdapterInfo", "ADAPTER_NAME", "check_adapter_name", "scoped_name"]

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")   # no ':' ("<base>:<adapter>")
SCOPE_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")                # a tenant's name; no '/'


def check_adapter_name(name: object) -> str:
    """`name` if it is a valid adapter name (1-64 of letters, digits, '.', '_', '-', starting
    with a letter or digit), else AdapterError."""
    if not isinstance(name, str) or ADAPTER_NAME.fullmatch(name) is None:
        raise AdapterError(str(name)[:80], "is not a valid adapter name (1-64 letters, digits, "
                           "'.', '_' or '-', starting with a letter or digit)")
    return name


def scoped_name(scope: str | None, name: str) -> str:
    """The engine name of adapter `name` in `scope` (None: unscoped, the name itself); the name
    checked as an adapter name, the scope as 1-128 letters, digits, '.', '_' or '-'
    (AdapterError)."""
    check_adapter_name(name)
    if scope is None:
        return name
    if not isinstance(scope, str) or SCOPE_NAME.fullmatch(scope) is None:
        raise AdapterError(name, f"scope {str(scope)[:80]!r} is not valid (1-128 letters, "
                           f"digits, '.', '_' or '-')")
    return f"{scope}/{name}"


@dataclass(frozen=True)
class AdapterInfo:
    """A registered adapter: its engine name (`scoped_name`), where its files are, what they
    declare, its resident size."""

    name: str
    directory: Path
    spec: AdapterSpec
    resident_bytes: int


class AdapterStore:
    """Adapters by name for one base model (see the module docstring).

    `prepare` runs on the engine's thread; register / unregister may come from another thread
    (a server's upload): one lock orders them.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 memory_bytes: int) -> None:
        if memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
        self.config = config
        self.dtype = dtype
        self.device = device
        self.memory_bytes = memory_bytes
        self._registered: dict[str, AdapterInfo] = {}
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()   # least recent first
        self._stacked: StackedAdapters | None = None
        self._lock = threading.Lock()

    def register(self, name: str, directory: str | Path, scope: str | None = None) -> AdapterInfo:
        """Check the adapter in `directory` and register it as `name` in `scope` (replacing one
        of that name; its resident copy goes). AdapterError naming the tensor or setting at
        fault, or when it alone exceeds the memory budget."""
        key = scoped_name(scope, name)
        directory = Path(directory)
        spec = read_adapter_spec(name, directory, self.config)
        size = spec.resident_bytes(torch.empty((), dtype=self.dtype).element_size())
        if size > self.memory_bytes:
            raise AdapterError(name, f"needs {size / 2**20:.1f} MiB resident, more than the "
                               f"adapter memory budget of {self.memory_bytes / 2**20:.1f} MiB")
        info = AdapterInfo(key, directory, spec, size)
        with self._lock:
            self._drop(key)
            self._registered[key] = info
        return info

    def unregister(self, name: str, scope: str | None = None) -> bool:
        """Forget `name` of `scope` (and its resident copy); False when it was not registered."""
        key = scoped_name(scope, name)
        with self._lock:
            self._drop(key)
            return self._registered.pop(key, None) is not None

    def resolve(self, name: str, scope: str | None = None) -> str | None:
        """The engine name `name` means in `scope`: the scope's own adapter, else an unscoped
        one, else None (also for a name that is not valid)."""
        if not isinstance(name, str) or ADAPTER_NAME.fullmatch(name) is None:
            return None
        if scope is not None and SCOPE_NAME.fullmatch(scope) is not None \
                and f"{scope}/{name}" in self._registered:
            return f"{scope}/{name}"
        return name if name in self._registered else None

    def names_in(self, scope: str | None) -> tuple[str, ...]:
        """The names `resolve` finds in `scope` (its own and the unscoped ones), sorted."""
        prefix = None if scope is None else f"{scope}/"
        names = set()
        for key in list(self._registered):
            if "/" not in key:
                names.add(key)
            elif prefix is not None and key.startswith(prefix):
                names.add(key[len(prefix):])
        return tuple(sorted(names))

    def __contains__(self, name: object) -> bool:
        return name in self._registered

    def info(self, name: str) -> AdapterInfo | None:
        return self._registered.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        """Registered adapters' engine names, sorted."""
        return tuple(sorted(self._registered))

    @property
    def resident_names(self) -> tuple[str, ...]:
        """Resident adapters, least recently used first."""
        return tuple(self._resident)

    @property
    def resident_bytes(self) -> int:
        return sum(adapter.num_bytes for adapter in self._resident.values())

    @property
    def stacked_bytes(self) -> int:
        return 0 if self._stacked is None else self._stacked.num_bytes

    def load(self, name: str) -> LoraAdapter:
        """The resident adapter `name`, loaded now if it is not (AdapterError, KeyError)."""
        with self._lock:
            return self._load([name])[0]

    def prepare(self, requests: Sequence[ForwardRequest],
                num_threads: int | None = None) -> LoraPass | None:
        """The adapter deltas of a pass over `requests` (a validated batch's, in order), or None
        when no request names an adapter. RequestError naming the first request of an adapter
        that is not registered or fails to load. num_threads: as LoraPass's."""
        names = [request.adapter for request in requests]
        if not any(names):
            return None
        distinct = sorted({name for name in names if name is not None})
        with self._lock:
            for name in distinct:
                if name not in self._registered:
                    raise RequestError(names.index(name), "adapter",
                                       f"adapter {name!r} is not registered")
            try:
                adapters = self._load(distinct)
            except AdapterError as error:
                raise RequestError(names.index(error.adapter), "adapter", str(error)) from None
            stacked = self._stacked
            if stacked is None or stacked.names != tuple(distinct):
                self._stacked = None                    # the old stacks go before the new come
                stacked = self._stacked = stack_adapters(adapters)
        group_of = {name: g for g, name in enumerate(distinct)}
        groups: list[list[int]] = [[] for _ in distinct]
        row = 0
        for request, name in zip(requests, names):
            num_tokens = len(request.token_ids)
            if name is not None:
                groups[group_of[name]].extend(range(row, row + num_tokens))
            row += num_tokens
        return LoraPass(stacked, groups, row, self.device, num_threads)

    def _load(self, names: Sequence[str]) -> list[LoraAdapter]:
        """The adapters `names`, resident (most recently used), loading the missing ones and
        evicting least recently used others over the budget. Under the lock."""
        keep = set(names)
        for name in names:
            if name in self._resident:
                self._resident.move_to_end(name)
                continue
            info = self._registered[name]
            self._evict(keep, self.memory_bytes - info.resident_bytes)
            self._resident[name] = load_adapter(name, info.directory, self.config, self.dtype,
                                                self.device)
        self._evict(keep, self.memory_bytes)
        return [self._resident[name] for name in names]

    def _evict(self, keep: set[str], limit: int) -> None:
        """Evict least recently used adapters not in `keep` while resident bytes exceed limit."""
        for name in list(self._resident):
            if self.resident_bytes <= limit:
                return
            if name not in keep:
                self._drop(name)

    def _drop(self, name: str) -> None:
        """Forget the resident copy of `name` and any stacks holding it. Under the lock."""
        self._resident.pop(name, None)
        if self._stacked is not None and name in self._stacked.names:
            self._stacked = None
