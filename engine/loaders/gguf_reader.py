"""A fast reader of a GGUF file's metadata and tensor table, over a memory map.

`gguf.GGUFReader` builds a numpy view per field part, which on a large vocabulary costs more
than a model's whole load should. This reader parses the same layout (GGUF v2/v3,
little-endian) with `struct` and leaves tensor data as zero-copy views of the map.
Any inconsistency (bad magic, a length running past the end of the file, a tensor whose data
lies beyond the end) raises ModelLoadError naming the file.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.loaders.common import ModelLoadError

__all__ = ["GGUFFile", "GGUFTensorInfo", "read_gguf"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry: `shape` in GGUF order (ne0 first, i.e. [in, out] for a linear)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    data: np.ndarray   # [num_bytes] uint8, a view of the file's memory map
    file_offset: int   # where `data` starts in the file


@dataclass(frozen=True)
class GGUFFile:
    """Metadata (key -> Python value; arrays as lists) and tensors of one GGUF file."""

    path: Path
    fields: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    mapped: mmap.mmap

    def release_pages(self, tensor: GGUFTensorInfo) -> None:
        """Drop the pages of `tensor`'s data from this process's memory (they stay in the page
        cache): without this, a load's peak RSS holds the whole file on top of the weights."""
        start = tensor.file_offset - tensor.file_offset % mmap.PAGESIZE
        length = tensor.file_offset + tensor.data.nbytes - start
        if hasattr(mmap, "MADV_DONTNEED") and length > 0:
            self.mapped.madvise(mmap.MADV_DONTNEED, start, length)


class _Cursor:
    """Reads little-endian values from a buffer, checking every read against its end."""

    def __init__(self, path: Path, buffer: memoryview) -> None:
        self.path, self.buffer, self.offset = path, buffer, 0

    def need(self, num_bytes: int, what: str) -> None:
        if num_bytes < 0 or self.offset + num_bytes > len(self.buffer):
            raise ModelLoadError(self.path, f"truncated or corrupt GGUF: {what} at byte "
                                            f"{self.offset} runs past the end of the file "
                                            f"({len(self.buffer)} bytes)")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("<Q", what)
        self.need(length, what)
        raw = bytes(self.buffer[self.offset:self.offset + length])
        self.offset += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ModelLoadError(self.path, f"corrupt GGUF: {what} is not UTF-8 ({error})") from None

    def value(self, value_type: int, what: str) -> Any:
        value_type = self.value_type(value_type, what)
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type == GGUFValueType.ARRAY:
            return self.array(what)
        return self.scalar(_SCALAR_FORMATS[value_type], what)

    def array(self, what: str) -> list:
        item_type = self.value_type(self.scalar("<I", what), what)
        count = self.scalar("<Q", what)
        if item_type == GGUFValueType.STRING:
            return self.string_array(count, what)
        if item_type == GGUFValueType.ARRAY:
            return [self.array(what) for _ in range(count)]
        fmt = _SCALAR_FORMATS[item_type]
        size = struct.calcsize(fmt)
        self.need(size * count, what)
        items = np.frombuffer(self.buffer, dtype=np.dtype(fmt), count=count, offset=self.offset)
        self.offset += size * count
        return items.tolist()

    def string_array(self, count: int, what: str) -> list[str]:
        """`count` strings; the hot loop of vocabulary parsing, so kept minimal."""
        buffer, offset, end = self.buffer, self.offset, len(self.buffer)
        unpack_length = struct.Struct("<Q").unpack_from
        items = []
        for _ in range(count):
            if offset + 8 > end:
                self.offset = offset
                self.need(8, what)
            (length,) = unpack_length(buffer, offset)
            offset += 8
            if offset + length > end:
                self.offset = offset
                self.need(length, what)
            items.append(str(buffer[offset:offset + length], "utf-8", "replace"))
            offset += length
        self.offset = offset
        return items

    def value_type(self, raw: int, what: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelLoadError(self.path, f"corrupt GGUF: {what} has unknown value type {raw}") from None


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header, metadata and tensor table of the GGUF at `path` (memory-mapped)."""
    try:
        with open(path, "rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:   # mmap of an empty file
        raise ModelLoadError(path, "the file is empty") from None
    except OSError as error:
        raise ModelLoadError(path, f"cannot read the file ({error.strerror or error})") from None
    cursor = _Cursor(path, memoryview(mapped))
    if cursor.buffer[:4].tobytes() != _MAGIC:
        raise ModelLoadError(path, f"not a GGUF file (magic {cursor.buffer[:4].tobytes()!r})")
    cursor.offset = 4
    version = cursor.scalar("<I", "version")
    if version not in (2, 3):
        raise ModelLoadError(path, f"unsupported GGUF version {version} (2 and 3 are read; "
                                   "a huge number means a big-endian file)")
    num_tensors = cursor.scalar("<Q", "tensor count")
    num_fields = cursor.scalar("<Q", "metadata count")
    fields: dict[str, Any] = {}
    for index in range(num_fields):
        key = cursor.string(f"metadata key #{index}")
        fields[key] = cursor.value(cursor.scalar("<I", f"type of {key!r}"), f"metadata {key!r}")
    entries = [_read_tensor_entry(cursor, index) for index in range(num_tensors)]
    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cursor.offset // alignment) * alignment
    buffer = np.frombuffer(mapped, dtype=np.uint8)
    tensors = [_tensor_view(path, buffer, data_start, entry) for entry in entries]
    return GGUFFile(path=path, fields=fields, tensors=tensors, mapped=mapped)


def _read_tensor_entry(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string(f"name of tensor #{index}")
    num_dims = cursor.scalar("<I", f"rank of tensor {name!r}")
    shape = tuple(cursor.scalar("<Q", f"shape of tensor {name!r}") for _ in range(num_dims))
    raw_type = cursor.scalar("<I", f"type of tensor {name!r}")
    offset = cursor.scalar("<Q", f"offset of tensor {name!r}")
    return name, shape, raw_type, offset


def _tensor_view(path: Path, buffer: np.ndarray, data_start: int,
                 entry: tuple[str, tuple[int, ...], int, int]) -> GGUFTensorInfo:
    name, shape, raw_type, offset = entry
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ModelLoadError(path, f"tensor {name!r} has unknown quantization type {raw_type}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_elements = int(np.prod(shape, dtype=np.int64))
    if num_elements % block_size:
        raise ModelLoadError(path, f"tensor {name!r} of shape {shape} is not a whole number of "
                                   f"{qtype.name} blocks of {block_size}")
    num_bytes = num_elements // block_size * type_size
    start = data_start + offset
    if start + num_bytes > len(buffer):
        raise ModelLoadError(path, f"truncated GGUF: tensor {name!r} needs bytes up to "
                                   f"{start + num_bytes} but the file has {len(buffer)}")
    return GGUFTensorInfo(name=name, shape=shape, qtype=qtype, data=buffer[start:start + num_bytes],
                          file_offset=start)
