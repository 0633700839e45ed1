"""The RAM delta filter (issue 31): a QEMU 7.2 migration stream keeps only the pages that differ from a
base; anything it does not understand is refused, so the caller keeps the whole stream."""

from __future__ import annotations

import io
import mmap
import struct
from collections.abc import Callable

import pytest

from capsa.node.runtime.snapshot.ram_delta import StreamFormatError, filter_stream

PAGE = 4096
ZERO, MEM_SIZE, PAGE_F, EOS, CONT = 0x02, 0x04, 0x08, 0x10, 0x20


def _name(s: bytes) -> bytes:
    return bytes([len(s)]) + s


def _page(offset: int, data: bytes, block: bytes | None = b"mem0") -> bytes:
    flags = PAGE_F | (CONT if block is None else 0)
    return struct.pack(">Q", offset | flags) + (b"" if block is None else _name(block)) + data


def _zero(offset: int, block: bytes | None = b"mem0") -> bytes:
    flags = ZERO | (CONT if block is None else 0)
    return struct.pack(">Q", offset | flags) + (b"" if block is None else _name(block)) + b"\0"


def _stream(*parts: bytes, device: bytes = b"\x04device-state\x0f") -> bytes:
    head = struct.pack(">II", 0x5145564D, 3) + b"\x07" + struct.pack(">I", 7) + b"microvm"
    blocks = _name(b"mem0") + struct.pack(">Q", 4 * PAGE) + _name(b"pc.bios") + struct.pack(">Q", PAGE)
    start = (b"\x01" + struct.pack(">I", 2) + _name(b"ram") + struct.pack(">II", 0, 4)
             + struct.pack(">Q", 5 * PAGE | MEM_SIZE) + blocks + struct.pack(">Q", EOS) + b"\x7e"
             + struct.pack(">I", 2))
    body = b"".join(parts)
    return head + start + body + device


def _section(kind: int, *records: bytes) -> bytes:
    return (bytes([kind]) + struct.pack(">I", 2) + b"".join(records) + struct.pack(">Q", EOS) + b"\x7e"
            + struct.pack(">I", 2))


@pytest.fixture
def base() -> mmap.mmap:
    pages = mmap.mmap(-1, 4 * PAGE)
    pages[0:PAGE] = b"A" * PAGE  # page 1 and 3 stay zero, page 2 is "C"
    pages[2 * PAGE:3 * PAGE] = b"C" * PAGE
    return pages


def test_pages_equal_to_the_base_are_dropped_and_the_rest_kept_with_their_block(base: mmap.mmap) -> None:
    same_first = _page(0, b"A" * PAGE)  # equal: dropped, although the next record continues it
    changed = _page(PAGE, b"B" * PAGE, block=None)
    zero_on_zero = _zero(3 * PAGE, block=None)
    zero_on_data = _zero(2 * PAGE, block=None)  # the base has "C" there: the zeros must be kept
    bios = _page(0, b"R" * PAGE, block=b"pc.bios")  # another block: always kept
    src = _stream(_section(0x02, same_first, changed, zero_on_zero), _section(0x03, zero_on_data, bios))
    out = io.BytesIO()
    stats = filter_stream(io.BytesIO(src), out, "mem0", base)
    assert (stats.pages_kept, stats.pages_dropped) == (3, 2)
    assert stats.bytes_in == len(src) and stats.bytes_out == len(out.getvalue())
    # Kept records name their block (a record they continued may be gone); the device state is intact.
    want = _stream(_section(0x02, _page(PAGE, b"B" * PAGE)), _section(0x03, _zero(2 * PAGE), bios))
    assert out.getvalue() == want


@pytest.mark.parametrize("damage", [
    lambda s: b"XXXX" + s[4:],  # not a stream
    lambda s: s[:8] + b"\x05" + s[9:],  # a subsection in the configuration
    lambda s: s[:-40],  # cut inside the RAM records
    lambda s: s.replace(_name(b"ram"), _name(b"abc"), 1),  # another iterable section
])
def test_anything_unexpected_is_refused(base: mmap.mmap, damage: Callable[[bytes], bytes]) -> None:
    src = _stream(_section(0x02, _page(PAGE, b"B" * PAGE)), _section(0x03, _zero(0)), device=b"")
    with pytest.raises(StreamFormatError):
        filter_stream(io.BytesIO(damage(src)), io.BytesIO(), "mem0", base)


def test_a_record_continuing_no_block_is_refused(base: mmap.mmap) -> None:
    src = _stream(_section(0x02, _page(PAGE, b"B" * PAGE, block=None)), _section(0x03))
    with pytest.raises(StreamFormatError, match="continues no block"):
        filter_stream(io.BytesIO(src), io.BytesIO(), "mem0", base)
