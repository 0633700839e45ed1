"""File copies for disks and memory files: btrfs/XFS reflinks, with a sparse plain copy as fallback.

A reflink (``FICLONE``) shares the source's extents, so a 2 GiB disk "copy" takes milliseconds and no
space until either side is written. Filesystems without CoW get a real copy that still skips holes,
because guest disks and RAM files are mostly sparse and inflating them would cost gigabytes.

Every copy is written to a temporary name next to the destination and renamed into place, so a failure
(full disk, interrupted process) never leaves a half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
from pathlib import Path

from capsa.common.errors import CapsaError

__all__ = [
    "CopyError",
    "ReflinkUnsupported",
    "copy_file",
    "probe_reflink",
    "reflink",
    "sparse_copy",
]

# _IOW(0x94, 9, int) from <linux/fs.h>; the stdlib does not export it.
_FICLONE = 0x40049409
# Errors meaning "this filesystem pair cannot share extents", as opposed to a real I/O failure.
_NO_CLONE_ERRNOS = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS})
_CHUNK = 8 * 1024 * 1024


class CopyError(CapsaError):
    code = "storage_error"
    status = 500


class ReflinkUnsupported(CopyError):
    """The source and destination cannot share extents (no CoW filesystem, or different filesystems)."""

    code = "reflink_unsupported"


def _temp_name(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.tmp-{secrets.token_hex(4)}")


def _check_source(src: Path) -> os.stat_result:
    try:
        st = src.stat()
    except FileNotFoundError:
        raise CopyError(f"cannot copy {src}: no such file") from None
    if not src.is_file():
        raise CopyError(f"cannot copy {src}: not a regular file")
    return st


def _check_destination(dst: Path, overwrite: bool) -> None:
    if not dst.parent.is_dir():
        raise CopyError(f"cannot copy to {dst}: directory {dst.parent} does not exist")
    if dst.exists() and not overwrite:
        raise CopyError(f"cannot copy to {dst}: file exists")


def reflink(src: Path, dst: Path, *, overwrite: bool = False, mode: int = 0o600) -> None:
    """Make ``dst`` share all of ``src``'s extents. Raises :class:`ReflinkUnsupported` when impossible."""
    _check_source(src)
    _check_destination(dst, overwrite)
    tmp = _temp_name(dst)
    try:
        with open(src, "rb") as fsrc:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            try:
                fcntl.ioctl(fd, _FICLONE, fsrc.fileno())
            except OSError as exc:
                if exc.errno in _NO_CLONE_ERRNOS:
                    raise ReflinkUnsupported(
                        f"cannot reflink {src} to {dst}: {os.strerror(exc.errno or 0)}"
                    ) from None
                raise CopyError(f"reflink of {src} to {dst} failed: {exc}") from exc
            finally:
                os.close(fd)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _copy_range(fin: int, fout: int, offset: int, length: int) -> None:
    end = offset + length
    pos = offset
    while pos < end:
        want = min(_CHUNK, end - pos)
        try:
            n = os.copy_file_range(fin, fout, want, pos, pos)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            n = 0
        if n == 0:
            # copy_file_range refused (or hit EOF early); fall back to plain reads for the rest.
            data = os.pread(fin, want, pos)
            if not data:
                return
            written = 0
            while written < len(data):
                written += os.pwrite(fout, data[written:], pos + written)
            n = len(data)
        pos += n


def _data_segments(fd: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of every non-hole region; the whole file if SEEK_DATA is not supported."""
    segments: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only holes from here to the end
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            segments.append((start, end - start))
            pos = end
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return [(0, size)] if size else []
    return segments


def sparse_copy(src: Path, dst: Path, *, overwrite: bool = False, mode: int = 0o600) -> None:
    """Copy ``src`` to ``dst`` byte for byte, keeping holes as holes."""
    st = _check_source(src)
    _check_destination(dst, overwrite)
    tmp = _temp_name(dst)
    try:
        fin = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fout = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            try:
                for offset, length in _data_segments(fin, st.st_size):
                    _copy_range(fin, fout, offset, length)
                os.ftruncate(fout, st.st_size)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        os.replace(tmp, dst)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise CopyError(f"copy of {src} to {dst} failed: {exc}") from exc
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def copy_file(src: Path, dst: Path, *, cow: bool = True, overwrite: bool = False, mode: int = 0o600) -> bool:
    """Reflink ``src`` to ``dst`` when ``cow`` and possible, else make a sparse copy.

    Returns True when the result shares extents with the source.
    """
    if cow:
        try:
            reflink(src, dst, overwrite=overwrite, mode=mode)
            return True
        except ReflinkUnsupported:
            pass
    sparse_copy(src, dst, overwrite=overwrite, mode=mode)
    return False


def probe_reflink(directory: Path) -> bool:
    """True when files inside ``directory`` can be reflinked to each other."""
    a = directory / f".reflink-probe-{secrets.token_hex(4)}"
    b = a.with_name(a.name + "-clone")
    try:
        a.write_bytes(b"capsa reflink probe\n")
        reflink(a, b)
        return True
    except ReflinkUnsupported:
        return False
    finally:
        for p in (a, b):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
