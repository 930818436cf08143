"""The program store: uploaded components, content-addressed by sha256, owned per tenant.

Layout under the store's root:
    programs/<sha256>.wasm           the bytes, stored once whoever uploaded them
    tenants/<tenant>/<sha256>        an (empty) marker: the tenant owns this program
    incoming/                        uploads in progress (`PendingUpload`: on disk, not in memory;
                                     unnamed temporary files, gone when closed or on a crash)

A tenant sees only the programs it uploaded itself; a program uploaded by two tenants is stored once
but each must send its bytes (so a tenant cannot probe which hashes another one holds). Writes are
atomic (temporary file + rename), so a crash never leaves a half-written program under its hash.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["StoredProgram", "UploadStore", "UnknownProgramError", "PendingUpload", "is_sha256"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def is_sha256(text: str) -> bool:
    """True for a lower-case hex sha256 digest."""
    return bool(_SHA256.match(text))


class UnknownProgramError(KeyError):
    """The tenant holds no program with this hash."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class StoredProgram:
    sha256: str
    size: int


class UploadStore:
    """Content-addressed program bytes on disk with per-tenant ownership. Not thread-safe for
    concurrent writers of the *same tenant* (the server serialises them); atomic renames keep
    the files consistent in every case."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "programs").mkdir(parents=True, exist_ok=True)
        (self.root / "tenants").mkdir(parents=True, exist_ok=True)
        (self.root / "incoming").mkdir(parents=True, exist_ok=True)

    def begin(self, tenant: str, sha256: str, size: int) -> "PendingUpload":
        """A new upload in progress, spilled to an unnamed file under incoming/."""
        return PendingUpload(tenant, sha256, size,
                             tempfile.TemporaryFile(dir=self.root / "incoming"))

    def _blob(self, sha256: str) -> Path:
        return self.root / "programs" / f"{sha256}.wasm"

    def _marker(self, tenant: str, sha256: str) -> Path:
        return self.root / "tenants" / tenant / sha256

    def owns(self, tenant: str, sha256: str) -> bool:
        """Whether `tenant` has uploaded the program `sha256` (and its bytes are present)."""
        return (is_sha256(sha256) and self._marker(tenant, sha256).exists()
                and self._blob(sha256).exists())

    def list(self, tenant: str) -> list[StoredProgram]:
        """The tenant's programs, sorted by hash."""
        folder = self.root / "tenants" / tenant
        if not folder.is_dir():
            return []
        programs = []
        for marker in sorted(folder.iterdir()):
            blob = self._blob(marker.name)
            if is_sha256(marker.name) and blob.exists():
                programs.append(StoredProgram(marker.name, blob.stat().st_size))
        return programs

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes of all the tenant's programs (what its program quota counts)."""
        return sum(program.size for program in self.list(tenant))

    def read(self, tenant: str, sha256: str) -> bytes:
        """The bytes of a program the tenant owns (UnknownProgramError otherwise)."""
        if not self.owns(tenant, sha256):
            raise UnknownProgramError(f"unknown program {sha256!r}: not uploaded by this tenant")
        return self._blob(sha256).read_bytes()

    def put(self, tenant: str, data: bytes) -> StoredProgram:
        """Store `data` for `tenant` under its sha256; storing it again is a no-op."""
        sha256 = hashlib.sha256(data).hexdigest()
        blob = self._blob(sha256)
        if not blob.exists():
            _write_atomic(blob, data)
        marker = self._marker(tenant, sha256)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return StoredProgram(sha256, len(data))

    def remove(self, tenant: str, sha256: str) -> None:
        """Drop the tenant's ownership (the bytes stay while another tenant owns them)."""
        self._marker(tenant, sha256).unlink(missing_ok=True)


class PendingUpload:
    """An upload in progress: its bytes go to a temporary file as they arrive (host memory holds
    one chunk at a time), hashed on the way. `close` drops it (idempotent)."""

    def __init__(self, tenant: str, sha256: str, size: int, file: BinaryIO) -> None:
        self.tenant = tenant
        self.sha256 = sha256
        self.size = size
        self.num_received = 0
        self._file = file
        self._hasher = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self._hasher.update(data)
        self.num_received += len(data)

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()

    @property
    def file(self) -> BinaryIO:
        """The file the bytes went to (read it from its start)."""
        return self._file

    def read_all(self) -> bytes:
        """Every byte received so far."""
        self._file.seek(0)
        return self._file.read()

    def close(self) -> None:
        self._file.close()


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{id(data)}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
