"""File operations and tar import/export through the real guest daemon (a host process)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import GuestError
from capsa.node.statuses import status_of
from tests.support.local_guest import guest_client, local_guest

__all__ = ["guest_client", "local_guest"]


async def test_binary_empty_and_large_round_trips(guest_client: GuestClient, tmp_path: Path) -> None:
    every_byte = bytes(range(256)) * 257
    info = await guest_client.write_file(f"{tmp_path}/bin", every_byte)
    assert (info.type, info.size, info.name, info.path) == ("file", len(every_byte), "bin", f"{tmp_path}/bin")
    assert await guest_client.read_file(f"{tmp_path}/bin") == every_byte == (tmp_path / "bin").read_bytes()

    assert (await guest_client.write_file(f"{tmp_path}/empty", b"")).size == 0
    assert await guest_client.read_file(f"{tmp_path}/empty") == b""

    big = os.urandom(50 * 1024 * 1024)
    await guest_client.write_file(f"{tmp_path}/big", big)
    got = hashlib.sha256()
    chunks = 0
    async for chunk in guest_client.iter_file(f"{tmp_path}/big"):
        got.update(chunk)
        chunks += 1
    assert got.hexdigest() == hashlib.sha256(big).hexdigest() and chunks > 1
    assert [n for n in names(tmp_path) if n.startswith(".capsa")] == []


async def test_streamed_upload_mode_and_parents(guest_client: GuestClient, tmp_path: Path) -> None:
    async def body() -> AsyncIterator[bytes]:
        for i in range(40):
            yield bytes([i]) * 100_000

    info = await guest_client.write_file(f"{tmp_path}/a/b/c.sh", body(), mode=0o750)
    assert info.size == 4_000_000 and info.mode == 0o750
    assert stat.S_IMODE((tmp_path / "a/b/c.sh").stat().st_mode) == 0o750
    # Overwriting keeps the existing mode unless a new one is given.
    assert (await guest_client.write_file(f"{tmp_path}/a/b/c.sh", b"#!/bin/sh\n")).mode == 0o750


async def test_failed_upload_leaves_nothing_behind(guest_client: GuestClient, tmp_path: Path) -> None:
    (tmp_path / "keep").write_bytes(b"old")

    async def broken() -> AsyncIterator[bytes]:
        yield b"new" * 100_000
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError):
        await guest_client.write_file(f"{tmp_path}/keep", broken())
    await guest_client.health()  # round trip: the guest has seen the cancel by now
    for _ in range(50):
        if names(tmp_path) == ["keep"]:
            break
        await asyncio.sleep(0.05)
    assert names(tmp_path) == ["keep"]
    assert (tmp_path / "keep").read_bytes() == b"old"


async def test_list_stat_mkdir_remove_rename(guest_client: GuestClient, tmp_path: Path) -> None:
    d = await guest_client.mkdir(f"{tmp_path}/x/y/z")
    assert d.type == "dir" and (tmp_path / "x/y/z").is_dir()
    assert (await guest_client.mkdir(f"{tmp_path}/x/y/z")).type == "dir"  # parents=True: exists is fine
    with pytest.raises(GuestError) as e:
        await guest_client.mkdir(f"{tmp_path}/x/y/z", parents=False)
    assert e.value.code == "already_exists"
    with pytest.raises(GuestError) as e:
        await guest_client.mkdir(f"{tmp_path}/nope/q", parents=False)
    assert e.value.code == "not_found"
    await guest_client.write_file(f"{tmp_path}/x/f.txt", b"hello", mode=0o600)
    os.symlink("f.txt", tmp_path / "x/link")
    entries = await guest_client.list_dir(f"{tmp_path}/x")
    assert [(e.name, e.type) for e in entries] == [("f.txt", "file"), ("link", "symlink"), ("y", "dir")]
    f = await guest_client.stat(f"{tmp_path}/x/f.txt")
    assert (f.size, f.mode, f.type) == (5, 0o600, "file") and f.mtime > 0
    assert (await guest_client.stat(f"{tmp_path}/x/link")).type == "symlink"

    with pytest.raises(GuestError) as e:
        await guest_client.remove(f"{tmp_path}/x")
    assert e.value.code == "directory_not_empty"
    await guest_client.rename(f"{tmp_path}/x/f.txt", f"{tmp_path}/moved.txt")
    assert (tmp_path / "moved.txt").read_bytes() == b"hello"
    await guest_client.remove(f"{tmp_path}/moved.txt")
    await guest_client.remove(f"{tmp_path}/x", recursive=True)
    assert names(tmp_path) == []


async def test_file_errors_have_stable_codes(guest_client: GuestClient, tmp_path: Path) -> None:
    cases = [
        (guest_client.read_file(f"{tmp_path}/missing"), "not_found"),
        (guest_client.read_file(str(tmp_path)), "is_a_directory"),
        (guest_client.write_file(str(tmp_path), b"x"), "is_a_directory"),
        (guest_client.stat("relative/path"), "bad_request"),
        (guest_client.list_dir(f"{tmp_path}/missing"), "not_found"),
        (guest_client.remove(f"{tmp_path}/missing"), "not_found"),
        (guest_client.remove("/"), "bad_request"),
        (guest_client.rename(f"{tmp_path}/missing", f"{tmp_path}/b"), "not_found"),
    ]
    (tmp_path / "file").write_bytes(b"")
    cases.append((guest_client.list_dir(f"{tmp_path}/file"), "not_a_directory"))
    cases.append((guest_client.write_file(f"{tmp_path}/file/sub/x", b"x"), "not_a_directory"))
    for call, code in cases:
        with pytest.raises(GuestError) as e:
            await call
        assert e.value.code == code
        assert status_of(e.value) in (400, 404, 409)
    # Input the client cannot even send is a clear error too, and the channel stays usable.
    with pytest.raises(GuestError) as e:
        await guest_client.exec("true", env={"BIG": "x" * 100_000})
    assert e.value.code == "bad_request"
    with pytest.raises(GuestError) as e:
        await guest_client.reseed(b"x" * (2 * 1024 * 1024))
    assert e.value.code == "bad_request"
    assert (await guest_client.exec("echo ok")).stdout == b"ok\n"


async def test_permission_denied_as_another_user(guest_client: GuestClient, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s")
    secret.chmod(0o600)
    r = await guest_client.exec(["cat", str(secret)], user="nobody")
    assert r.exit_code != 0 and b"Permission denied" in r.stderr


def names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def escaping(root: Path) -> list[Path]:
    """Entries under ``root`` that resolve outside it."""
    return [p for p in root.rglob("*") if not str(p.resolve()).startswith(str(root.resolve()))]


def _make_tree(root: Path) -> None:
    (root / "sub/deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.txt").write_bytes(b"alpha\n")
    (root / "sub/b.bin").write_bytes(os.urandom(300_000))
    (root / "sub/deeper/run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (root / "sub/deeper/run.sh").chmod(0o755)
    os.symlink("../a.txt", root / "sub/link")


def _snapshot(root: Path) -> dict[str, tuple[str, int, bytes | str | None]]:
    out: dict[str, tuple[str, int, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", 0, os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), None)
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), p.read_bytes())
    return out


async def test_tar_round_trip(guest_client: GuestClient, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _make_tree(src)
    archive = b"".join([chunk async for chunk in guest_client.tar_export(str(src))])
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert "a.txt" in tar.getnames() and "sub/deeper/run.sh" in tar.getnames()

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, len(archive), 10_000):
            yield archive[i: i + 10_000]

    await guest_client.tar_import(str(dst), body())
    assert _snapshot(dst) == _snapshot(src)


async def test_tar_import_accepts_compressed_archives(guest_client: GuestClient, tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"compressed\n"
        info = tarfile.TarInfo("dir/file.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    await guest_client.tar_import(f"{tmp_path}/out", buf.getvalue())
    assert (tmp_path / "out/dir/file.txt").read_bytes() == b"compressed\n"


def _tar(*members: tuple[str, str, str]) -> bytes:
    """Members as (type, name, link target or content)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for kind, name, arg in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(arg)
                tar.addfile(info, io.BytesIO(arg.encode()))
                continue
            info.type = {"sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE, "dir": tarfile.DIRTYPE,
                         "chr": tarfile.CHRTYPE}[kind]
            info.linkname = arg
            tar.addfile(info)
    return buf.getvalue()


@pytest.mark.parametrize("members", [
    [("file", "/abs/evil", "x")],
    [("file", "../evil", "x")],
    [("file", "ok/../../evil", "x")],
    [("sym", "link", "/etc")],
    [("sym", "link", "../outside")],
    [("sym", "link", ".."), ("file", "link/evil", "x")],
    [("dir", "sub", ""), ("sym", "sub/up", ".."), ("sym", "sub/x", "up/.."), ("file", "sub/x/evil", "x")],
    [("dir", "sub", ""), ("sym", "sub/x", "up/.."), ("sym", "sub/up", ".."), ("file", "sub/x/evil", "x")],
    [("dir", "sub", ""), ("sym", "sub/x", "up/.."), ("sym", "sub/up", "..")],
    [("sym", "a", "b"), ("sym", "b", "..")],
    [("hard", "h", "../outside")],
    [("hard", "h", "/etc/passwd")],
    [("chr", "dev", "")],
], ids=["absolute", "dotdot", "nested-dotdot", "abs-symlink", "rel-symlink-out", "write-through-symlink",
        "symlink-chain", "late-symlink-write", "late-symlink-left", "symlink-pair", "hardlink-out",
        "hardlink-abs", "device"])
async def test_tar_import_refuses_escapes(guest_client: GuestClient, tmp_path: Path,
                                          members: list[tuple[str, str, str]]) -> None:
    target = tmp_path / "t" / "target"
    target.mkdir(parents=True)
    (tmp_path / "t" / "outside").write_bytes(b"original")
    with pytest.raises(GuestError) as e:
        await guest_client.tar_import(str(target), _tar(*members))
    assert e.value.code == "unsafe_archive"
    # Nothing was written outside the target, and no link leads out of it.
    assert names(tmp_path / "t") == ["outside", "target"]
    assert (tmp_path / "t" / "outside").read_bytes() == b"original"
    assert names(tmp_path) == ["t"]
    assert escaping(target) == []


async def test_tar_import_rejects_garbage(guest_client: GuestClient, tmp_path: Path) -> None:
    with pytest.raises(GuestError) as e:
        await guest_client.tar_import(f"{tmp_path}/g", os.urandom(5000))
    assert e.value.code == "bad_request"
    assert (await guest_client.health())["status"] == "ok"
