"""Tenants' LoRA adapters: uploaded files on disk, content-addressed, registered with the engine.

Layout under the store's root (the server's data_dir / "adapters"):
    files/<id>/adapter_config.json           an adapter's two files, stored once whoever sent
    files/<id>/adapter_model.safetensors     them (id: `adapter_id` of the two files)
    tenants/<tenant>/<name>                  the tenant's adapter `name`: the id, as text
    incoming/                                an upload being checked (a folder per upload)

A tenant sees only its own names; each is registered with the engine's AdapterStore in the
tenant's scope (engine name "tenant/name"), so an instance's `adapters.open(name)` finds its own
tenant's adapter. An upload is checked against the base model before it is kept (the engine's
validator: every tensor's name, dtype and shape, then every value finite), and counted in the
tenant's `max_adapter_bytes` (the two files' bytes of every name it holds). Files no name
refers to any more are deleted. Writes are atomic (folder renamed into place, marker replaced),
so a crash never leaves a half-written adapter under its id. The methods block (disk, the
check): the server calls them from worker threads; one lock orders them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from engine.adapters import (CONFIG_FILE, WEIGHTS_FILE, AdapterError, check_adapter_name,
                             load_adapter, scoped_name)
from engine.adapters.peft import MAX_CONFIG_BYTES

__all__ = ["AdapterUploadError", "StoredAdapter", "TenantAdapters", "adapter_id",
           "MAX_ADAPTERS_PER_TENANT", "MAX_CONFIG_BYTES"]

_log = logging.getLogger("pie.server")
MAX_ADAPTERS_PER_TENANT = 64     # names one tenant holds


class AdapterUploadError(ValueError):
    """An adapter upload, deletion or name refused; the message names the cause (the tensor
    at fault, the quota and its usage, ...)."""


@dataclass(frozen=True)
class StoredAdapter:
    """One of a tenant's adapters: its name, content id, bytes of its two files, and what its
    config declares."""

    name: str
    sha256: str
    size: int
    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "size": self.size, "rank": self.rank,
                "alpha": self.alpha, "target_modules": list(self.target_modules)}


def adapter_id(config: bytes, weights_sha256: str) -> str:
    """The content id of an adapter: sha256 over its config's sha256 and its weights' sha256
    (hex digests, joined by a newline)."""
    return hashlib.sha256(f"{hashlib.sha256(config).hexdigest()}\n{weights_sha256}".encode()
                          ).hexdigest()


class TenantAdapters:
    """Tenants' adapters over one engine's AdapterStore (see the module docstring)."""

    def __init__(self, root: Path, engine_store: Any, model_config: Any) -> None:
        self.root = Path(root)
        self.engine_store = engine_store          # engine.adapters.AdapterStore
        self.model_config = model_config
        self._lock = threading.Lock()
        for folder in ("files", "tenants", "incoming"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)

    # ---- reading ------------------------------------------------------------------------------

    def _marker(self, tenant: str, name: str) -> Path:
        return self.root / "tenants" / tenant / name

    def _files(self, sha256: str) -> Path:
        return self.root / "files" / sha256

    def _ids(self, tenant: str) -> dict[str, str]:
        """The tenant's names -> their ids, as on disk."""
        folder = self.root / "tenants" / tenant
        if not folder.is_dir():
            return {}
        return {marker.name: marker.read_text().strip() for marker in sorted(folder.iterdir())
                if not marker.name.startswith(".")}

    def _size(self, sha256: str) -> int:
        folder = self._files(sha256)
        return sum((folder / f).stat().st_size for f in (CONFIG_FILE, WEIGHTS_FILE)
                   if (folder / f).exists())

    def list(self, tenant: str) -> list[StoredAdapter]:
        """The tenant's adapters the engine holds, by name."""
        adapters = []
        for name, sha256 in self._ids(tenant).items():
            info = self.engine_store.info(scoped_name(tenant, name))
            if info is not None:
                spec = info.spec
                adapters.append(StoredAdapter(name, sha256, self._size(sha256), spec.rank,
                                              spec.alpha, spec.target_modules))
        return adapters

    def names(self, tenant: str) -> frozenset[str]:
        """The names of the tenant's adapters the engine holds."""
        return frozenset(a.name for a in self.list(tenant))

    def tenant_bytes(self, tenant: str, except_name: str | None = None) -> int:
        """Bytes of the tenant's adapters (its quota's usage), leaving out `except_name`."""
        return sum(self._size(sha256) for name, sha256 in self._ids(tenant).items()
                   if name != except_name)

    # ---- writing ------------------------------------------------------------------------------

    def begin(self) -> BinaryIO:
        """An unnamed file under incoming/ for an upload's weights as they arrive."""
        return tempfile.TemporaryFile(dir=self.root / "incoming")

    def add(self, tenant: str, max_bytes: int, name: str, config: bytes, weights: BinaryIO,
            weights_sha256: str) -> StoredAdapter:
        """Check and keep the adapter `name` of `tenant` (replacing one of that name): `config`
        the adapter_config.json bytes, `weights` the safetensors file (read from its start),
        whose sha256 was checked. AdapterUploadError naming the cause: a bad name, more than
        MAX_ADAPTERS_PER_TENANT names, over `max_bytes` with the tenant's other adapters, a
        tensor or setting the base model does not take (the tensor named), over the engine's
        adapter memory."""
        try:
            check_adapter_name(name)
        except AdapterError as error:
            raise AdapterUploadError(str(error)) from None
        if len(config) > MAX_CONFIG_BYTES:
            raise AdapterUploadError(f"adapter {name!r}: {CONFIG_FILE} has {len(config)} bytes, "
                                     f"more than {MAX_CONFIG_BYTES}")
        sha256 = adapter_id(config, weights_sha256)
        with self._lock:
            ids = self._ids(tenant)
            if name not in ids and len(ids) >= MAX_ADAPTERS_PER_TENANT:
                raise AdapterUploadError(f"tenant {tenant!r}: {MAX_ADAPTERS_PER_TENANT} adapters "
                                         f"already; delete one first")
            weights.seek(0, os.SEEK_END)
            size = len(config) + weights.tell()
            used = self.tenant_bytes(tenant, except_name=name)
            if used + size > max_bytes:
                raise AdapterUploadError(f"tenant {tenant!r}: adapter quota: {size} bytes more "
                                         f"would exceed max_adapter_bytes {max_bytes} "
                                         f"(using {used})")
            if not self._files(sha256).is_dir():
                self._write_files(name, sha256, config, weights)
            try:
                info = self.engine_store.register(name, self._files(sha256), scope=tenant)
            except AdapterError as error:
                self._collect(sha256)
                raise AdapterUploadError(str(error)) from None
            old = ids.get(name)
            _write_atomic(self._marker(tenant, name), sha256)
            if old is not None and old != sha256:
                self._collect(old)
        spec = info.spec
        return StoredAdapter(name, sha256, size, spec.rank, spec.alpha, spec.target_modules)

    def _write_files(self, name: str, sha256: str, config: bytes, weights: BinaryIO) -> None:
        """Write the two files in a folder under incoming/, check them against the base model
        (tensors loaded, every value finite), and rename the folder to files/<sha256>."""
        folder = Path(tempfile.mkdtemp(dir=self.root / "incoming"))
        try:
            (folder / CONFIG_FILE).write_bytes(config)
            weights.seek(0)
            with open(folder / WEIGHTS_FILE, "wb") as out:
                shutil.copyfileobj(weights, out, 1 << 20)
            try:
                load_adapter(name, folder, self.model_config, torch.float32,
                             torch.device("cpu"))
            except AdapterError as error:
                raise AdapterUploadError(str(error)) from None
            os.replace(folder, self._files(sha256))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def delete(self, tenant: str, name: str) -> None:
        """Forget the tenant's adapter `name` (AdapterUploadError when it has none); its files
        go when no name refers to them. Instances that opened it fail their later passes with
        it (the engine no longer knows the name)."""
        with self._lock:
            sha256 = self._ids(tenant).get(name)
            if sha256 is None:
                raise AdapterUploadError(f"unknown adapter {name!r}: not uploaded by this tenant")
            self.engine_store.unregister(name, scope=tenant)
            self._marker(tenant, name).unlink(missing_ok=True)
            self._collect(sha256)

    def _collect(self, sha256: str) -> None:
        """Delete the files of `sha256` when no tenant's name refers to them. Under the lock."""
        for folder in (self.root / "tenants").iterdir():
            if folder.is_dir() and sha256 in self._ids(folder.name).values():
                return
        shutil.rmtree(self._files(sha256), ignore_errors=True)

    def restore(self) -> int:
        """Register every tenant's stored adapters with the engine (a server's start); one that
        no longer fits the base model is logged and left unregistered. Returns how many were
        registered."""
        count = 0
        with self._lock:
            for folder in sorted((self.root / "tenants").iterdir()):
                for name, sha256 in self._ids(folder.name).items():
                    try:
                        self.engine_store.register(name, self._files(sha256), scope=folder.name)
                        count += 1
                    except AdapterError as error:
                        _log.warning("tenant %s: stored adapter not registered: %s",
                                     folder.name, error)
        return count


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
