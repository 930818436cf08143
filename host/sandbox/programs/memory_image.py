"""The heap image of a component's one linear memory, taken out of its data segments.

Wasmtime fills a memory the host created (host/sandbox/linear_memory.py) by copying each active
data segment in at instantiation; componentize-py's CPython brings its heap in thousands of
segments, copied one by one onto a memory the pool has just zeroed whole. `split_memory_image`
moves those bytes out of the component: the segments are left in place with no bytes (their
indices, offsets and count unchanged) and the host puts the image (the segments laid out from
address 0, zeros between them) into the memory as it creates it, mapped copy-on-write from one
file per image (host/sandbox/image_files.py) or copied in one pass, and zeroes only what lies
past it, so no byte is written twice.

Only where that is provably the same memory: in the whole component (nested ones included)
exactly one core module defines a memory, one, 32-bit, unshared, with 64 KiB pages; that module
sits at the top level and is instantiated exactly once; nothing re-exports, aliases, imports or
passes a core module (so nothing else can instantiate it); each of its data segments is passive
(kept as it is) or active on that memory at an `i32.const` offset; every active segment lies
within the memory's initial size (else instantiation traps, as it still does unsplit); and the
image is at most twice its segments' bytes plus 1 MiB (the host holds it per program). Anything
else, or bytes this reader does not follow, leaves the component as it is (None).
"""
from __future__ import annotations

from dataclasses import dataclass

from host.sandbox.programs.component_names import (PREAMBLE_LEN, ByteReader, ComponentFormatError,
                                          read_extern_name, sections, skip_extern_desc)

__all__ = ["MemoryImage", "split_memory_image"]

_PAGE = 65536
_MAX_SLACK = 1 << 20              # zero bytes an image may add to its segments' own, beyond 2x
_CORE_MODULE, _CORE_INSTANCE, _COMPONENT = 1, 2, 4         # component section ids
_INSTANCE, _ALIAS, _IMPORT, _EXPORT = 5, 6, 10, 11
_MEMORY, _DATA = 5, 11                                     # core section ids
_CORE_SORT, _CORE_MODULE_SORT = 0x00, 0x11
_I32_CONST, _END = 0x41, 0x0B


@dataclass(frozen=True)
class MemoryImage:
    """What the one memory holds after its data segments: `data` from address 0 (zeros between
    the segments), then zeros up to `num_bytes`, the memory's initial size."""

    num_bytes: int
    data: bytes


class _NotSplit(Exception):
    """The component is not of the shape split_memory_image handles."""


@dataclass
class _Module:
    section: int                  # where its core module section starts (the id byte)
    start: int                    # its bytes: that section's payload
    end: int
    memory: tuple[int, int] | None = None      # its memory section's payload (start, end)
    data: tuple[int, int, int] | None = None   # its data section: (section start, payload)


def split_memory_image(component: bytes) -> tuple[bytes, MemoryImage] | None:
    """(the component with its memory's active data segments emptied, the image they wrote),
    or None when the component is not of that shape (module docstring). Never raises."""
    try:
        return _split(component)
    except (_NotSplit, ComponentFormatError, IndexError, ValueError):
        return None


def _split(component: bytes) -> tuple[bytes, MemoryImage]:
    modules: list[_Module] = []
    instantiations: dict[int, int] = {}
    nested_memories = _walk(component, PREAMBLE_LEN, len(component), modules, instantiations)
    with_memory = [index for index, module in enumerate(modules) if module.memory is not None]
    if nested_memories or len(with_memory) != 1:
        raise _NotSplit("not exactly one memory in the component")
    index = with_memory[0]
    if instantiations.get(index, 0) != 1:
        raise _NotSplit("the memory's module is not instantiated exactly once")
    module = modules[index]
    num_bytes = _memory_size(component, *module.memory)
    if module.data is None:
        raise _NotSplit("no data segments")
    emptied, segments = _empty_segments(component, *module.data[1:])
    image = _image(component, segments, num_bytes)
    data_section, _, data_end = module.data
    new_module = b"".join((component[module.start:data_section], bytes([_DATA]),
                           _u32_bytes(len(emptied)), emptied, component[data_end:module.end]))
    rewritten = b"".join((component[:module.section], bytes([_CORE_MODULE]),
                          _u32_bytes(len(new_module)), new_module, component[module.end:]))
    return rewritten, MemoryImage(num_bytes, image)


def _walk(data: bytes, start: int, end: int, modules: list[_Module] | None,
          instantiations: dict[int, int]) -> bool:
    """Walk a component's sections (`modules` None: a nested component, whose modules only
    count for defining a memory). Collects the top level's core modules and how often each is
    instantiated; returns whether a nested module defines a memory; _NotSplit where a core module
    is passed around."""
    nested_memory = False
    for section_id, section, payload, payload_end in sections(data, start, end):
        if section_id == _CORE_MODULE:
            module = _read_module(data, section, payload, payload_end)
            if modules is None:
                nested_memory |= module.memory is not None
            else:
                modules.append(module)
        elif section_id == _COMPONENT:
            nested_memory |= _walk(data, payload + PREAMBLE_LEN, payload_end, None, {})
        elif section_id == _CORE_INSTANCE and modules is not None:
            _count_instantiations(ByteReader(data, payload, payload_end), instantiations)
        elif section_id in (_INSTANCE, _ALIAS, _IMPORT, _EXPORT):
            _refuse_core_modules(ByteReader(data, payload, payload_end), section_id)
    return nested_memory


def _read_module(data: bytes, section: int, start: int, end: int) -> _Module:
    module = _Module(section, start, end)
    if data[start:start + 4] != b"\0asm":
        raise _NotSplit("a core module section without a core module")
    for section_id, inner, payload, payload_end in sections(data, start + PREAMBLE_LEN, end):
        if section_id == _MEMORY:
            module.memory = (payload, payload_end)
        elif section_id == _DATA:
            module.data = (inner, payload, payload_end)
    return module


def _count_instantiations(reader: ByteReader, instantiations: dict[int, int]) -> None:
    for _ in range(reader.u32()):
        if reader.byte() == 0x00:                 # instantiate: moduleidx, args
            module_index = reader.u32()
            instantiations[module_index] = instantiations.get(module_index, 0) + 1
            for _ in range(reader.u32()):
                reader.name()
                reader.byte()                     # 0x12: a core instance
                reader.u32()
        else:                                     # inline exports: name, core sortidx
            for _ in range(reader.u32()):
                reader.name()
                _core_sort(reader)
                reader.u32()


def _refuse_core_modules(reader: ByteReader, section_id: int) -> None:
    """_NotSplit when an instance, alias, import or export section names a core module."""
    for _ in range(reader.u32()):
        if section_id == _INSTANCE:
            kind = reader.byte()
            if kind == 0x00:
                reader.u32()                      # the component instantiated
            for _ in range(reader.u32()):
                if kind == 0x00:
                    reader.name()
                else:
                    read_extern_name(reader)
                _sort(reader)
                reader.u32()
        elif section_id == _ALIAS:
            _sort(reader)
            target = reader.byte()
            reader.u32()
            if target in (0x00, 0x01):
                reader.name()
            else:
                reader.u32()
        elif section_id == _IMPORT:
            read_extern_name(reader)
            if reader.data[reader.position] == 0x00:
                raise _NotSplit("a core module import")
            skip_extern_desc(reader)
        else:                                     # export: name, sortidx, an optional type
            read_extern_name(reader)
            _sort(reader)
            reader.u32()
            if reader.byte() == 0x01:
                skip_extern_desc(reader)


def _sort(reader: ByteReader) -> None:
    if reader.byte() == _CORE_SORT:
        _core_sort(reader)


def _core_sort(reader: ByteReader) -> None:
    if reader.byte() == _CORE_MODULE_SORT:
        raise _NotSplit("a core module passed around")


def _memory_size(data: bytes, start: int, end: int) -> int:
    reader = ByteReader(data, start, end)
    if reader.u32() != 1:
        raise _NotSplit("not one memory")
    flags = reader.byte()
    if flags not in (0x00, 0x01):                 # shared, 64-bit or custom pages: no
        raise _NotSplit("a memory of another kind")
    num_pages = reader.u32()
    return num_pages * _PAGE


def _empty_segments(data: bytes, start: int, end: int
                    ) -> tuple[bytes, list[tuple[int, int, int]]]:
    """The data section's payload with every active segment's bytes removed, and each removed
    segment's (offset, start, length) in `data`, in order."""
    reader = ByteReader(data, start, end)
    count = reader.u32()
    parts = [_u32_bytes(count)]
    segments = []
    for _ in range(count):
        head = reader.position
        flags = reader.u32()
        if flags == 1:                            # passive: kept whole
            length = reader.u32()
            reader.position += length
            parts.append(data[head:reader.position])
            continue
        if flags == 2 and reader.u32() != 0 or flags not in (0, 2):
            raise _NotSplit("a segment of another memory or kind")
        if reader.byte() != _I32_CONST:
            raise _NotSplit("an offset that is not a constant")
        offset = _s32(reader) & 0xFFFF_FFFF
        if reader.byte() != _END:
            raise _NotSplit("an offset expression of more than one instruction")
        parts.append(data[head:reader.position] + b"\0")
        length = reader.u32()
        if reader.position + length > end:
            raise _NotSplit("a segment runs past its section")
        segments.append((offset, reader.position, length))
        reader.position += length
    if reader.position != end:
        raise _NotSplit("bytes after the data segments")
    return b"".join(parts), segments


def _image(data: bytes, segments: list[tuple[int, int, int]], num_bytes: int) -> bytes:
    image_len = max((offset + length for offset, _, length in segments), default=0)
    num_segment_bytes = sum(length for _, _, length in segments)
    if image_len > num_bytes:
        raise _NotSplit("a segment past the memory's initial size")
    if image_len > 2 * num_segment_bytes + _MAX_SLACK:
        raise _NotSplit("an image mostly of zeros")
    image = bytearray(image_len)
    view = memoryview(data)
    for offset, start, length in segments:       # in order: a later segment wins, as in Wasm
        image[offset:offset + length] = view[start:start + length]
    return bytes(image)


def _s32(reader: ByteReader) -> int:
    """A signed LEB128 of at most 5 bytes."""
    result = shift = 0
    for _ in range(5):
        byte = reader.byte()
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            if byte & 0x40:
                result -= 1 << shift
            return result
    raise _NotSplit("an i32 longer than 5 bytes")


def _u32_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
