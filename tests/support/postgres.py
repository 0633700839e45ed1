"""A throwaway PostgreSQL 15 server in a temporary directory, run as the ``postgres`` user."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PG_BIN", "PgCluster", "postgres_missing_reason", "temporary_postgres"]

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def postgres_missing_reason() -> str | None:
    if not (PG_BIN / "initdb").exists():
        return f"PostgreSQL 15 binaries not found in {PG_BIN}"
    if shutil.which("runuser") is None:
        return "runuser not found"
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        return "no postgres user"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(*args: str) -> None:
    subprocess.run(["runuser", "-u", "postgres", "--", *args], check=True, capture_output=True, timeout=120)


class PgCluster:
    def __init__(self, port: int, sock: Path) -> None:
        self.port = port
        self.sock = sock
        self._count = 0

    def new_database(self) -> str:
        """Create an empty database and return its asyncpg SQLAlchemy URL."""
        self._count += 1
        name = f"capsa_{self._count}"
        _as_postgres(str(PG_BIN / "createdb"), "-h", str(self.sock), "-p", str(self.port), name)
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{name}"


@contextlib.contextmanager
def temporary_postgres() -> Iterator[PgCluster]:
    """Yields a fresh cluster (trust auth on 127.0.0.1); stops and removes it afterwards."""
    root = Path(tempfile.mkdtemp(prefix="capsa-pg-"))
    os.chmod(root, 0o755)
    shutil.chown(root, "postgres", "postgres")
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    shutil.chown(sock, "postgres", "postgres")
    port = _free_port()
    started = False
    try:
        _as_postgres(str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        _as_postgres(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(data),
            "-w",
            "-t",
            "60",
            "-l",
            str(root / "log"),
            "-o",
            f"-p {port} -k {sock} -c listen_addresses='127.0.0.1' -c fsync=off",
            "start",
        )
        started = True
        yield PgCluster(port, sock)
    finally:
        if started:
            with contextlib.suppress(subprocess.SubprocessError):
                _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
