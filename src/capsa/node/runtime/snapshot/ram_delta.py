"""A migration stream that carries only the RAM pages that differ from a base: snapshots of VMs whose RAM
is a private mapping of a frozen RAM file (branches) record what they changed, not their whole memory.

QEMU 7.2 cannot save "only the pages dirtied since the restore", so it writes every page of a private RAM
block into the stream and :func:`filter_stream` drops, afterwards, each page that is byte-identical to the
base at the same offset (a zero page where the base is zero too). A QEMU restoring the result maps the base
privately first, so a page the stream leaves out reads as the base's, which is what it was.

Hand-written because no library reads QEMU's stream. What it reads (migration/savevm.c and ram.c of QEMU
7.2; anything else fails with :class:`StreamFormatError` and the caller keeps the unfiltered stream):

* the header (magic ``QEVM``, version 3) and the configuration section (machine name; no subsection);
* the ``ram`` section's START (its block list), PART and END records, each a run of RAM records closed by
  the EOS flag and a section footer; a RAM record is ``be64 offset|flags``, the block name unless
  ``CONTINUE``, then a fill byte (``ZERO``) or a page (``PAGE``);
* everything after the ``ram`` section's END (the devices' state, EOF) is copied as it is.

Every page kept is written with its block name (never ``CONTINUE``): the record it continued may be gone.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["DeltaStats", "StreamFormatError", "filter_stream"]

_MAGIC = 0x5145564D
_VERSION = 3
_PAGE = 4096
# Section types (savevm.c)
_START, _PART, _END, _CONFIGURATION, _FOOTER = 0x01, 0x02, 0x03, 0x07, 0x7E
# RAM record flags (ram.c)
_ZERO, _MEM_SIZE, _PAGE_FLAG, _EOS, _CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
_KNOWN = _ZERO | _MEM_SIZE | _PAGE_FLAG | _EOS | _CONTINUE
_ZERO_PAGE = bytes(_PAGE)


class StreamFormatError(ValueError):
    """The stream is not one this filter understands; keep it whole."""


@dataclass
class DeltaStats:
    pages_kept: int = 0
    pages_dropped: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class _Reader:
    def __init__(self, src: BinaryIO) -> None:
        self._src = src
        self.read_bytes = 0

    def take(self, n: int) -> bytes:
        data = self._src.read(n)
        if len(data) != n:
            raise StreamFormatError(f"stream ends {n - len(data)} bytes early")
        self.read_bytes += n
        return data

    def u8(self) -> int:
        return self.take(1)[0]

    def be32(self) -> int:
        return int(struct.unpack(">I", self.take(4))[0])

    def be64(self) -> int:
        return int(struct.unpack(">Q", self.take(8))[0])

    def name(self) -> bytes:
        return self.take(self.u8())


def _section_header(r: _Reader, out: BinaryIO) -> None:
    """START: id, ``ram``, instance, version (copied)."""
    section_id = r.take(4)
    idstr = r.name()
    if idstr != b"ram":
        raise StreamFormatError(f"unexpected iterable section {idstr!r}")
    out.write(section_id + bytes([len(idstr)]) + idstr + r.take(8))


def _footer(r: _Reader, out: BinaryIO) -> None:
    if r.u8() != _FOOTER:
        raise StreamFormatError("missing section footer")
    out.write(bytes([_FOOTER]) + r.take(4))


def _block_list(r: _Reader, out: BinaryIO, total: int) -> None:
    """The START section's list of RAM blocks (name, used length) after the MEM_SIZE record."""
    while total > 0:
        name = r.name()
        length = r.be64()
        out.write(bytes([len(name)]) + name + struct.pack(">Q", length))
        total -= length
    if total != 0:
        raise StreamFormatError("RAM block lengths do not add up to the announced size")


def _records(r: _Reader, out: BinaryIO, keep: Callable[[bytes, int, bytes | None], bool],
             stats: DeltaStats, block: bytes) -> bytes:
    """RAM records up to and including EOS; pages ``keep`` refuses are left out. ``block``: the block the
    previous section's last record named (a record may continue it); returns this section's last."""
    while True:
        header = r.be64()
        flags, offset = header & (_PAGE - 1), header & ~(_PAGE - 1)
        if flags & ~_KNOWN:
            raise StreamFormatError(f"unsupported RAM record flags {flags:#x}")
        if flags & _MEM_SIZE:
            out.write(struct.pack(">Q", header))
            _block_list(r, out, offset)
            continue
        if flags & _EOS:
            out.write(struct.pack(">Q", header))
            return block
        if not flags & (_ZERO | _PAGE_FLAG):
            raise StreamFormatError(f"RAM record without a page ({flags:#x})")
        if not flags & _CONTINUE:
            block = r.name()
        elif not block:
            raise StreamFormatError("a RAM record continues no block")
        if flags & _ZERO:
            fill = r.take(1)
            page = None if fill == b"\0" else fill * _PAGE
            body = fill
        else:
            page = body = r.take(_PAGE)
        if keep(block, offset, page):
            stats.pages_kept += 1
            out.write(struct.pack(">Q", offset | (flags & ~_CONTINUE)) + bytes([len(block)]) + block + body)
        else:
            stats.pages_dropped += 1


def filter_stream(src: BinaryIO, out: BinaryIO, block: str, base: mmap.mmap) -> DeltaStats:
    """Copy the stream ``src`` to ``out`` without the pages of RAM block ``block`` equal to ``base`` at
    the same offset (``page`` None: a zero page). Raises :class:`StreamFormatError` on anything unexpected
    (``out`` then holds a partial copy: the caller discards it)."""
    r = _Reader(src)
    stats = DeltaStats()
    name = block.encode()
    size = len(base)

    def keep(blk: bytes, offset: int, page: bytes | None) -> bool:
        if blk != name or offset + _PAGE > size:
            return True
        return base[offset:offset + _PAGE] != (_ZERO_PAGE if page is None else page)

    if r.be32() != _MAGIC or r.be32() != _VERSION:
        raise StreamFormatError("not a QEMU migration stream (version 3)")
    out.write(struct.pack(">II", _MAGIC, _VERSION))
    if r.u8() != _CONFIGURATION:
        raise StreamFormatError("the stream has no configuration section")
    machine = r.take(r.be32())
    out.write(bytes([_CONFIGURATION]) + struct.pack(">I", len(machine)) + machine)
    last = b""
    while True:
        kind = r.u8()
        if kind == _START:
            out.write(bytes([kind]))
            _section_header(r, out)
        elif kind in (_PART, _END):
            out.write(bytes([kind]) + r.take(4))
        else:
            raise StreamFormatError(f"unexpected section type {kind:#x} before the RAM section ended")
        last = _records(r, out, keep, stats, last)
        _footer(r, out)
        if kind == _END:
            break
    while chunk := src.read(1 << 20):  # the devices' state and EOF, as they are
        r.read_bytes += len(chunk)
        out.write(chunk)
    stats.bytes_in = r.read_bytes
    stats.bytes_out = out.tell()
    return stats
