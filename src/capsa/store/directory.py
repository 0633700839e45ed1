"""The directory backend: a key is a file under the root (a shared mount such as NFS, or a local directory).

Writes go to a temporary name in the target directory, are fsynced and renamed into place, so a reader
(another node on the same mount) never sees half an object and a crash leaves at most a ``.tmp-`` file,
which :meth:`DirectoryStore.list` does not show and a later write of the same key does not trip over.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from capsa.store.objects import ObjectInfo, ObjectMissing, StoreError, check_key

__all__ = ["DirectoryStore"]

_TMP = ".tmp-"


class DirectoryStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"store directory {root} cannot be made: {e.strerror}") from e

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write(self, key: str, write: bytes | Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP, dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                if isinstance(write, bytes):
                    f.write(write)
                else:
                    with write.open("rb") as src:
                        shutil.copyfileobj(src, f, 4 * 1024 * 1024)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def put(self, key: str, data: bytes) -> None:
        self._write(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self._write(key, path)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"no object {key} in {self.url}") from None

    def get_file(self, key: str, path: Path) -> None:
        src = self._path(key)
        tmp = path.with_name(path.name + ".part")
        try:
            shutil.copyfile(src, tmp)
        except FileNotFoundError:
            raise ObjectMissing(f"no object {key} in {self.url}") from None
        os.replace(tmp, path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self.root / check_key(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        out: list[ObjectInfo] = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(_TMP):
                    continue
                full = Path(dirpath) / name
                try:
                    st = full.stat()
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(full.relative_to(self.root).as_posix(), st.st_size, st.st_mtime))
        return sorted(out, key=lambda o: o.key)

    def check(self) -> str:
        """The root is a directory this process can write: a hidden temporary file (which :meth:`list`
        never shows) is made and removed in it."""
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TMP + "check-", dir=self.root)
        except OSError as e:
            raise StoreError(f"store directory {self.root} is not writable: {e.strerror}") from e
        os.close(fd)
        os.unlink(tmp)
        return f"directory {self.root} is writable"
