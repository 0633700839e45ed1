"""Frozen RAM that many VMs map privately and none can write: sealed memfds, one per RAM file and sharing
domain.

QEMU 7.2 opens a ``memory-backend-file`` read-write even when it maps it privately (``share=off``), so a VM
given a snapshot's RAM file could, once its QEMU is compromised from inside the guest, write the file and
poison every VM restored from it later. Instead the node copies the file's non-zero pages into a memfd once,
seals it (no write, no resize, no further seal change) and hands the descriptor to each QEMU, which maps
``/proc/self/fd/N`` privately: the kernel refuses ``write``, ``fallocate`` and writable shared mappings of a
write-sealed memfd for every process, root included, while a private mapping still lets each guest write its
own copy-on-write pages. Clean pages are one shmem copy for every VM of the memfd, so they are shared
physical memory: only VMs of one *domain* (a tenant, or the sandboxes of one branch set) get the same memfd.

Memory: a memfd holds the file's non-zero pages in RAM (shmem) for as long as any VM of it runs; the last
:meth:`SealedRam.release` closes the node's descriptor and the pages go with the last QEMU's mapping.
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SEALS", "SealedRam", "SealedRamError", "sealed_copy"]

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
"""The seals every frozen RAM memfd carries: nobody can write it, resize it or lift the seals."""

_PAGE = 4096
_CHUNK = 1 << 20


class SealedRamError(OSError):
    """A frozen RAM file could not be copied into a sealed memfd."""


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of the parts of the file that hold data (holes read as zeros and are skipped)."""
    extents: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        extents.append((start, min(end, size) - start))
        pos = end
    return extents


def _copy_nonzero(src: int, dst: int, offset: int, length: int) -> int:
    """Copy the non-zero pages of ``src[offset:offset+length]`` to the same offsets of ``dst``; the bytes
    written. A zero page is left as a hole: it costs the memfd nothing and reads as zeros."""
    written = 0
    zero = bytes(_PAGE)
    end = offset + length
    while offset < end:
        chunk = os.pread(src, min(_CHUNK, end - offset), offset)
        if not chunk:
            break
        view = memoryview(chunk)
        run_start = -1
        for page in range(0, len(chunk), _PAGE):
            piece = view[page:page + _PAGE]
            nonzero = piece != zero[:len(piece)]
            if nonzero and run_start < 0:
                run_start = page
            elif not nonzero and run_start >= 0:
                written += os.pwrite(dst, view[run_start:page], offset + run_start)
                run_start = -1
        if run_start >= 0:
            written += os.pwrite(dst, view[run_start:], offset + run_start)
        offset += len(chunk)
    return written


def _copy_extent(src: int, dst: int, offset: int, length: int) -> None:
    """Copy ``src[offset:offset+length]`` to the same offsets of ``dst`` in the kernel (sendfile)."""
    os.lseek(dst, offset, os.SEEK_SET)
    end = offset + length
    while offset < end:
        sent = os.sendfile(dst, src, offset, end - offset)
        if sent == 0:
            break
        offset += sent


def sealed_copy(path: Path, name: str = "capsa-ram", *, sparse: bool = True) -> int:
    """A new memfd holding the contents of ``path`` (same size), sealed with :data:`SEALS`. The caller owns
    the descriptor (close-on-exec; pass it to a child explicitly).

    ``sparse``: zero pages inside the file's data are left as holes too (a Python scan: a 256 MiB guest's
    RAM, 107 MiB of data of which 87 MiB non-zero, copies in ~80 ms); else the data is copied whole in the
    kernel (~45 ms, the zero pages held). Templates, copied once per tenant and kept, are copied sparse;
    a branch set's snapshot, copied on the branch's path and dropped with its last branch, whole."""
    src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(src).st_size
        dst = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(dst, size)
            copy = _copy_nonzero if sparse else _copy_extent
            for offset, length in _data_extents(src, size):
                copy(src, dst, offset, length)
            fcntl.fcntl(dst, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(dst)
            raise
    except OSError as exc:
        raise SealedRamError(exc.errno, f"cannot copy {path} into a sealed memfd: {exc.strerror}") from exc
    finally:
        os.close(src)
    return dst


@dataclass
class _Entry:
    fd: int
    users: set[str] = field(default_factory=set)


class SealedRam:
    """The node's sealed memfds, one per (RAM file, domain), each kept while a VM uses it. Thread-safe:
    the runtime lays out VM files in worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int, int, str], _Entry] = {}

    def acquire(self, ram: Path, sandbox_id: str, domain: str, *, sparse: bool = True) -> int:
        """The memfd of ``ram`` for VMs of ``domain`` (made on first use, ``sparse`` as in
        :func:`sealed_copy`), now also used by ``sandbox_id``. The descriptor stays the node's: pass it to
        QEMU, do not close it; :meth:`release` does."""
        st = ram.stat()
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, domain)
        with self._lock:  # one copy per key even when branches restore concurrently
            entry = self._entries.get(key)
            if entry is None:
                fd = sealed_copy(ram, f"capsa-ram-{domain}"[:60], sparse=sparse)
                entry = self._entries[key] = _Entry(fd)
            entry.users.add(sandbox_id)
            return entry.fd

    def release(self, sandbox_id: str) -> None:
        """``sandbox_id`` no longer runs; memfds nobody uses any more are closed (idempotent)."""
        with self._lock:
            for key, entry in list(self._entries.items()):
                entry.users.discard(sandbox_id)
                if not entry.users:
                    del self._entries[key]
                    os.close(entry.fd)
