"""Read the names a component imports and exports from its binary, without compiling it.

Compiling a component is the expensive step of loading a program (slow, and a hostile one can
take far longer); what it imports is written in plain sight in the component's top-level import
section. `read_names` walks the top-level sections of the component binary format
(https://github.com/WebAssembly/component-model, Binary.md), skipping every section but import
(id 10) and export (id 11), so a component that imports an interface the host does not provide,
or exports no `run`, is refused before any compilation. Nested components and core modules are
skipped whole: their imports are satisfied inside the component.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

__all__ = ["ComponentNames", "ComponentFormatError", "ByteReader", "PREAMBLE_LEN", "read_names",
           "sections", "read_extern_name", "skip_extern_desc"]

PREAMBLE_LEN = 8                  # "\0asm", version, layer (a core module's: magic, version)
_IMPORT_SECTION = 10
_EXPORT_SECTION = 11
_MAX_NAMES = 10_000               # more imports or exports than any real inferlet has


class ComponentFormatError(ValueError):
    """The bytes are not a component binary this reader understands; the message says where."""


@dataclass(frozen=True)
class ComponentNames:
    """The top-level import and export names of a component, in binary order."""

    imports: tuple[str, ...]
    exports: tuple[str, ...]


class ByteReader:
    """Bytes, LEB128 integers and names of the component binary format, in [position, end)."""

    def __init__(self, data: bytes, position: int = 0, end: int | None = None) -> None:
        self.data = data
        self.position = position
        self.end = len(data) if end is None else end

    def byte(self) -> int:
        if self.position >= self.end:
            raise ComponentFormatError(f"unexpected end at byte {self.position}")
        value = self.data[self.position]
        self.position += 1
        return value

    def u32(self) -> int:
        """An unsigned LEB128 of at most 5 bytes."""
        result = shift = 0
        for _ in range(5):
            byte = self.byte()
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if result >= 1 << 32:
                    raise ComponentFormatError(f"u32 too large at byte {self.position}")
                return result
            shift += 7
        raise ComponentFormatError(f"u32 longer than 5 bytes at byte {self.position}")

    def name(self) -> str:
        length = self.u32()
        if self.position + length > self.end:
            raise ComponentFormatError(f"name of {length} bytes runs past its section")
        raw = self.data[self.position:self.position + length]
        self.position += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ComponentFormatError(f"name at byte {self.position - length} is not "
                                       f"UTF-8") from None


def read_names(wasm_bytes: bytes) -> ComponentNames:
    """The top-level import and export names. Raises ComponentFormatError."""
    imports: list[str] = []
    exports: list[str] = []
    for section_id, _, start, end in sections(wasm_bytes, PREAMBLE_LEN, len(wasm_bytes)):
        section = ByteReader(wasm_bytes, start, end)
        if section_id == _IMPORT_SECTION:
            imports.extend(_read_vector(section, _read_import))
        elif section_id == _EXPORT_SECTION:
            exports.extend(_read_vector(section, _read_export))
        if len(imports) + len(exports) > _MAX_NAMES:
            raise ComponentFormatError(f"more than {_MAX_NAMES} imports and exports")
    return ComponentNames(tuple(imports), tuple(exports))


def sections(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(id, where the section starts, its payload's start, its payload's end) of each section
    of a component or core module whose sections lie in [start, end). Raises
    ComponentFormatError for one that runs past `end`."""
    reader = ByteReader(data, start, end)
    while reader.position < end:
        section = reader.position
        section_id = reader.byte()
        size = reader.u32()
        payload = reader.position
        if payload + size > end:
            raise ComponentFormatError(f"section {section_id} of {size} bytes at byte {payload} "
                                       f"runs past the end")
        yield section_id, section, payload, payload + size
        reader.position = payload + size


def _read_vector(section: ByteReader, read_one) -> list[str]:
    count = section.u32()
    if count > _MAX_NAMES:
        raise ComponentFormatError(f"a section of {count} entries")
    names = [read_one(section) for _ in range(count)]
    if section.position != section.end:
        raise ComponentFormatError(f"section ends at byte {section.position}, "
                                   f"declared end {section.end}")
    return names


def read_extern_name(reader: ByteReader) -> str:
    """importname' / exportname': 0x00 name (0x01 name in binaries of older tools)."""
    kind = reader.byte()
    if kind not in (0x00, 0x01):
        raise ComponentFormatError(f"unknown name kind {kind:#x} at byte {reader.position - 1}")
    return reader.name()


def _read_import(reader: ByteReader) -> str:
    name = read_extern_name(reader)
    skip_extern_desc(reader)
    return name


def _read_export(reader: ByteReader) -> str:
    name = read_extern_name(reader)
    sort = reader.byte()          # sortidx: sort (core sorts carry one more byte), index
    if sort == 0x00:
        reader.byte()
    reader.u32()
    if reader.byte() == 0x01:     # an optional ascribed type
        skip_extern_desc(reader)
    return name


def skip_extern_desc(reader: ByteReader) -> None:
    kind = reader.byte()
    if kind == 0x00:              # core module: 0x11 typeidx
        if reader.byte() != 0x11:
            raise ComponentFormatError(f"bad core module type at byte {reader.position - 1}")
        reader.u32()
    elif kind in (0x01, 0x04, 0x05):   # func, component, instance: typeidx
        reader.u32()
    elif kind == 0x02:            # value: 0x00 valueidx | 0x01 valtype
        bound = reader.byte()
        if bound == 0x00:
            reader.u32()
        else:
            _skip_valtype(reader)
    elif kind == 0x03:            # type: 0x00 typeidx (eq) | 0x01 (sub resource)
        if reader.byte() == 0x00:
            reader.u32()
    else:
        raise ComponentFormatError(f"unknown extern kind {kind:#x} at byte {reader.position - 1}")


def _skip_valtype(reader: ByteReader) -> None:
    """A primitive value type is one byte in 0x64..0x7f; anything else is a type index."""
    first = reader.data[reader.position] if reader.position < reader.end else 0
    if 0x64 <= first <= 0x7F:
        reader.byte()
    else:
        reader.u32()
