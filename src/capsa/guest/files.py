"""File operations: streamed read/write, listing, metadata, tar export and a safe tar import."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tarfile
import tempfile
from typing import Any

from capsa.guest.channel import Stream
from capsa.guest.errors import OpError, from_os_error
from capsa.guest.protocol import CHUNK_SIZE, MAX_LISTING_BYTES
from capsa.guest.results import FileInfo

__all__ = [
    "TAR_OPS",
    "file_info",
    "op_list",
    "op_mkdir",
    "op_read",
    "op_remove",
    "op_rename",
    "op_stat",
    "op_write",
]


def _path(args: dict[str, Any], key: str = "path") -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise OpError("bad_request", f"{key} must be an absolute path")
    return os.path.normpath(value) if value != "/" else "/"


def _flag(args: dict[str, Any], key: str, default: bool) -> bool:
    value = args.get(key, default)
    if not isinstance(value, bool):
        raise OpError("bad_request", f"{key} must be a boolean")
    return value


def _type_of(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def file_info(path: str, st: os.stat_result | None = None) -> dict[str, Any]:
    if st is None:
        st = os.lstat(path)
    return FileInfo(path=path, name=os.path.basename(path) or "/", type=_type_of(st.st_mode),
                    size=st.st_size, mode=stat.S_IMODE(st.st_mode), mtime=st.st_mtime).to_meta()


def _guard(what: str) -> contextlib.AbstractContextManager[None]:
    return _OsErrors(what)


class _OsErrors:
    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, OSError):
            raise from_os_error(exc, self.what) from None


def op_stat(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    path = _path(args)
    with _guard(path):
        stream.result(file_info(path))


def op_read(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    path = _path(args)
    offset = args.get("offset", 0)
    length = args.get("length")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise OpError("bad_request", "offset must be a non-negative integer")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
        raise OpError("bad_request", "length must be a non-negative integer")
    with _guard(path):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with _guard(path):
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise OpError("is_a_directory", f"{path}: is a directory")
            if offset:
                os.lseek(fd, offset, os.SEEK_SET)
        remaining = length
        sent = 0
        while remaining is None or remaining > 0:
            with _guard(path):
                chunk = os.read(fd, CHUNK_SIZE if remaining is None else min(CHUNK_SIZE, remaining))
            if not chunk:
                break
            stream.send_data(chunk)
            sent += len(chunk)
            if remaining is not None:
                remaining -= len(chunk)
        info = file_info(path, st)
        info["sent"] = sent
        stream.result(info)
    finally:
        os.close(fd)


def _mode(args: dict[str, Any]) -> int | None:
    mode = args.get("mode")
    if mode is None:
        return None
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise OpError("bad_request", "mode must be an integer between 0 and 0o7777")
    return mode


def op_write(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    """Write the streamed body to a temporary file next to ``path``, then rename it into place."""
    path = _path(args)
    mode = _mode(args)
    if path == "/":
        raise OpError("is_a_directory", "/: is a directory")
    parent = os.path.dirname(path)
    with _guard(path):
        if os.path.isdir(path) and not os.path.islink(path):
            raise OpError("is_a_directory", f"{path}: is a directory")
        ancestor = parent
        while not os.path.lexists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            raise OpError("not_a_directory", f"{ancestor}: is not a directory")
        os.makedirs(parent, exist_ok=True)
        try:
            old = os.stat(path)
        except FileNotFoundError:
            old = None
        fd, tmp = tempfile.mkstemp(prefix=".capsa-upload-", dir=parent)
    done = False
    try:
        with _guard(path):
            reader = stream.reader()
            if data:
                _write_all(fd, data)
            while chunk := reader.chunk():
                _write_all(fd, chunk)
            if mode is None:
                mode = stat.S_IMODE(old.st_mode) if old else 0o644
            os.fchmod(fd, mode)
            if old is not None and os.geteuid() == 0:
                os.fchown(fd, old.st_uid, old.st_gid)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
            done = True
            stream.result(file_info(path))
    finally:
        if fd >= 0:
            os.close(fd)
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def op_list(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    """Entries go as one JSON array in DATA frames: a directory may not fit in one frame's meta."""
    path = _path(args)
    entries = []
    with _guard(path), os.scandir(path) as it:
        for entry in it:
            full = os.path.join(path, entry.name)
            try:
                entries.append(file_info(full, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue  # removed while listing
    entries.sort(key=lambda e: e["name"])
    raw = json.dumps(entries, separators=(",", ":")).encode()
    if len(raw) > MAX_LISTING_BYTES:
        raise OpError("too_large", f"{path}: the listing of {len(entries)} entries is {len(raw)} bytes, "
                                   f"more than the {MAX_LISTING_BYTES} a listing may hold")
    stream.send_data(raw)
    stream.result({"count": len(entries)})


def op_mkdir(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    path = _path(args)
    parents = _flag(args, "parents", True)
    mode = _mode(args)
    with _guard(path):
        if parents:
            if os.path.lexists(path) and not os.path.isdir(path):
                raise OpError("already_exists", f"{path}: exists and is not a directory")
            os.makedirs(path, mode=0o755 if mode is None else mode, exist_ok=True)
        else:
            os.mkdir(path, 0o755 if mode is None else mode)
        stream.result(file_info(path))


def op_remove(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    path = _path(args)
    recursive = _flag(args, "recursive", False)
    if path == "/":
        raise OpError("bad_request", "refusing to remove /")
    with _guard(path):
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            if recursive:
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
    stream.result({})


def op_rename(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    src = _path(args, "src")
    dst = _path(args, "dst")
    with _guard(src):
        os.lstat(src)
        try:
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno != 18:  # EXDEV: across filesystems, copy then delete
                raise
            shutil.move(src, dst)
    stream.result(file_info(dst))


# -- tar -----------------------------------------------------------------------------------------


class _FrameWriter:
    """A write-only file whose bytes become DATA frames (tarfile's streaming mode writes to it)."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._buf = bytearray()
        self.total = 0

    def write(self, data: bytes) -> int:
        self._buf += data
        self.total += len(data)
        if len(self._buf) >= CHUNK_SIZE:
            self._stream.send_data(bytes(self._buf))
            self._buf.clear()
        return len(data)

    def flush(self) -> None:
        if self._buf:
            self._stream.send_data(bytes(self._buf))
            self._buf.clear()


def op_tar_export(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    path = _path(args)
    with _guard(path):
        st = os.lstat(path)
        names = sorted(os.listdir(path)) if stat.S_ISDIR(st.st_mode) else None
        out = _FrameWriter(stream)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            if names is None:
                tar.add(path, arcname=os.path.basename(path), recursive=False)
            else:
                for name in names:
                    tar.add(os.path.join(path, name), arcname=name)
        out.flush()
    stream.result({"bytes": out.total})


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _unsafe(name: str, why: str) -> OpError:
    return OpError("unsafe_archive", f"refusing archive member {name!r}: {why}")


def _check_name(name: str) -> str:
    parts = name.split("/")
    if name.startswith("/") or ".." in parts or "\0" in name:
        raise _unsafe(name, "absolute path or '..' component")
    clean = "/".join(p for p in parts if p not in ("", "."))
    return clean


def op_tar_import(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    """Extract a (possibly compressed) tar stream into ``path``, refusing anything that escapes it."""
    target = _path(args)
    with _guard(target):
        os.makedirs(target, exist_ok=True)
        root = os.path.realpath(target)
    reader = stream.reader()
    links: list[str] = []
    count = 0
    try:
        tar = tarfile.open(fileobj=reader, mode="r|*")  # type: ignore[call-overload]  # noqa: SIM115
    except tarfile.TarError as exc:
        raise OpError("bad_request", f"not a tar archive: {exc}") from None
    extract_kwargs: dict[str, Any] = {}
    if hasattr(tarfile, "fully_trusted_filter"):
        # Python >= 3.11.4 has extraction filters; every member is vetted below instead, so behave
        # the same as the guest's 3.11.2.
        extract_kwargs["filter"] = "fully_trusted"
    with tar, _guard(target):
        try:
            for member in tar:
                clean = _check_name(member.name)
                if not clean:
                    continue  # the archive root itself ("." or "./")
                dest = os.path.join(root, clean)
                parent = os.path.realpath(os.path.dirname(dest))
                if not _inside(root, parent):
                    raise _unsafe(member.name, "its directory resolves outside the target")
                if member.isdev():
                    raise _unsafe(member.name, "device nodes are not allowed")
                if member.issym():
                    if member.linkname.startswith("/"):
                        raise _unsafe(member.name, "absolute symlink target")
                    resolved = os.path.realpath(os.path.join(parent, member.linkname))
                    if not _inside(root, resolved):
                        raise _unsafe(member.name, "symlink points outside the target")
                    links.append(dest)
                elif member.islnk():
                    link_clean = _check_name(member.linkname)
                    resolved = os.path.realpath(os.path.join(root, link_clean))
                    if not _inside(root, resolved):
                        raise _unsafe(member.name, "hard link points outside the target")
                    member.linkname = link_clean
                if not member.isdir() and os.path.islink(dest):
                    os.unlink(dest)  # never write through an existing symlink
                member.name = clean
                tar.extract(member, root, **extract_kwargs)
                count += 1
        except tarfile.TarError as exc:
            raise OpError("bad_request", f"bad tar archive: {exc}") from None
        finally:
            # A later member can change what an earlier, vetted symlink resolves to; check them all
            # again, also when the import failed half way, and leave no link that leads out.
            escaped = [link for link in links
                       if os.path.lexists(link) and not _inside(root, os.path.realpath(link))]
            for link in escaped:
                os.unlink(link)
    if escaped:
        raise _unsafe(os.path.relpath(escaped[0], root), "symlink points outside the target")
    # Drain anything after the end-of-archive blocks so the host is not left waiting for credit.
    while reader.read(CHUNK_SIZE):
        pass
    stream.result({"members": count})


TAR_OPS = {"tar_export": op_tar_export, "tar_import": op_tar_import}
