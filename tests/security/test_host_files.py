"""Host files against a VM uid (a QEMU compromised from inside its guest), issue 9 findings 0, 1 and 7.

* A running ``capsa serve`` with one session: walking its whole state directory as that session's VM
  uid opens, lists or connects to nothing but the VM's own files (no pool image, database, key, node
  identity, console log, pidfile, other snapshot or socket).
* The symlink attack: as the VM uid, try to swap ``disk.img`` / ``memory.ram`` for links to the host's
  key, its database or another VM's disk, then snapshot and restore. The sandbox directory is root's, so
  the swap itself fails; and with a directory laid out the old way (VM-owned, so the swap succeeds) the
  snapshot is refused with ``unsafe_source``, as is a restore from a snapshot holding a link. No host
  byte appears in any snapshot or restored VM.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.runtime.base import BootError, VMSpec
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime, QemuSandbox
from capsa.node.runtime.snapshot.mechanics import SnapshotError
from capsa.node.storage import StoragePool
from capsa.sdk import AsyncClient, AsyncSession
from tests.support.processes import qemu_pids
from tests.support.served import serve_workdir, start_serve
from tests.support.vm import snapshot_pool

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (VM uids, loop pool)"),
    pytest.mark.timeout(900),
]

# Runs as the VM uid (system python: the venv need not be reachable by that uid). For every path: what it
# could do with it (read, write, list, connect), or nothing.
_PROBE = r"""
import json, os, socket, stat, sys
out = {}
for path in json.load(sys.stdin):
    done = []
    try:
        st = os.lstat(path)
    except OSError:
        continue
    if stat.S_ISDIR(st.st_mode):
        try:
            os.listdir(path); done.append("list")
        except OSError:
            pass
    elif stat.S_ISSOCK(st.st_mode):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path); done.append("connect")
        except OSError:
            pass
        finally:
            s.close()
    else:
        for flag, what in ((os.O_RDONLY, "read"), (os.O_WRONLY, "write")):
            try:
                os.close(os.open(path, flag | os.O_NONBLOCK | os.O_NOCTTY)); done.append(what)
            except OSError:
                pass
    if done:
        out[path] = done
json.dump(out, sys.stdout)
"""


def _as_uid(uid: int, script: str, stdin: str = "") -> str:
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3", "-c", script]
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _tree(root: Path) -> list[Path]:
    paths = [root]
    for top, dirs, files in os.walk(root):
        paths += [Path(top) / name for name in (*dirs, *files)]
    return paths


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid in /proc/{pid}/status")


def _mode(path: Path) -> str:
    st = path.lstat()
    return f"{st.st_uid}:{oct(stat.S_IMODE(st.st_mode))}"


@pytest.fixture
def workdir() -> Iterator[Path]:
    with serve_workdir("capsa-hf-") as path:
        yield path


async def test_a_vm_uid_can_open_nothing_under_the_state_dir_but_its_own_files(workdir: Path) -> None:
    state = workdir / "state"
    served = start_serve(state, workdir, env={"CAPSA_BOOTSTRAP_KEY": ""})
    try:
        client = AsyncClient(served.url, served.bootstrap_key())
        session = await AsyncSession.create(timeout=600, client=client)
        await session.files.write("/root/note.txt", "tenant data")
        await session.snapshots.create()  # a snapshot in the pool too
        pids = qemu_pids(state)
        assert len(pids) == 1, pids
        uid = _uid_of(pids[0])
        paths = _tree(state)
        owners = {str(p): p.lstat().st_uid for p in paths}
        modes = {name: _mode(state / name) for name in ("capsa.db", "secret.key", "storage/pool.btrfs",
                                                        "capsa.db-wal", "capsa.db-shm", "capsa.db-journal")
                 if (state / name).exists()}
        opened = json.loads(_as_uid(uid, _PROBE, json.dumps([str(p) for p in paths])))
        await session.close()
        await client.aclose()
    finally:
        assert served.stop() == 0, served.errors()
    own = {p for p, owner in owners.items() if owner == uid}
    # What the VM uid owns is its sandbox's files and nothing else, all inside its two directories.
    sandbox_dirs = {Path(p).parent for p in own if Path(p).name in ("disk.img", "memory.ram", "run")}
    assert own and all(any(Path(p).is_relative_to(d) for d in sandbox_dirs) for p in own), own
    intruded = {p: what for p, what in opened.items() if p not in own}
    assert intruded == {}, intruded
    # The named files of the finding, checked by name: root's, 0600 (the database as SQLite left it).
    assert {"capsa.db", "secret.key", "storage/pool.btrfs"} <= set(modes), modes
    assert all(mode == "0:0o600" for mode in modes.values()), modes
    assert stat.S_IMODE(state.stat().st_mode) & 0o066 == 0


# -- the symlink attack on a runtime with the storage pool ---------------------------------------------------


@pytest.fixture(scope="module")
def pool(state_dir: Path) -> Iterator[StoragePool]:
    with snapshot_pool(state_dir) as pool:
        yield pool


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(state_dir: Path, pool: StoragePool) -> AsyncIterator[QemuRuntime]:
    rt = QemuRuntime(Settings(state_dir=state_dir, cache_dir=Settings().cache_dir), storage=PoolStorage(pool))
    try:
        yield rt
    finally:
        await rt.close()


def _holds(path: Path, needles: list[bytes]) -> list[bytes]:
    """Which of ``needles`` occur in the file (read in overlapping chunks)."""
    found: set[bytes] = set()
    keep = max(len(n) for n in needles)
    tail = b""
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            window = tail + chunk
            found.update(n for n in needles if n in window)
            tail = window[-keep:]
    return sorted(found)


def _files_hold(directory: Path, needles: list[bytes]) -> dict[str, list[bytes]]:
    """Needles found in the regular files of ``directory`` (links are not content: the one planted below
    in a snapshot is the test's own)."""
    return {p.name: hits for p in directory.iterdir()
            if stat.S_ISREG(p.lstat().st_mode) and (hits := _holds(p, needles))}


_PLANT = r"""
import os, sys
d, target, name = sys.argv[1:4]
try:
    os.rename(os.path.join(d, name), os.path.join(d, name + ".real"))
    os.symlink(target, os.path.join(d, name))
    print("planted")
except OSError as exc:
    print("refused", exc.errno)
"""


def _plant(uid: int, sandbox_dir: Path, target: Path, name: str) -> str:
    return _as_uid(uid, _PLANT.replace("sys.argv[1:4]", repr([str(sandbox_dir), str(target), name]))).strip()


def _unplant(sandbox_dir: Path, name: str) -> None:
    link = sandbox_dir / name
    if link.is_symlink():
        link.unlink()
        (sandbox_dir / (name + ".real")).rename(link)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_planted_symlink_never_carries_host_bytes_into_a_snapshot(
        runtime: QemuRuntime, pool: StoragePool, state_dir: Path, guest_image: GuestImage) -> None:
    secret = secrets.token_hex(24).encode()
    key_file = state_dir / "secret.key"
    key_file.write_bytes(b"host key " + secret + b"\n")
    key_file.chmod(0o600)
    database = state_dir / "capsa.db"
    db_marker = secrets.token_hex(24).encode()
    database.write_bytes(b"SQLite format 3\0" + db_marker)
    database.chmod(0o600)
    spec = VMSpec(image=guest_image, memory_mib=192)
    victim = await runtime.boot(spec)
    attacker = await runtime.boot(spec)
    assert isinstance(victim, QemuSandbox) and isinstance(attacker, QemuSandbox)
    victim_marker = secrets.token_hex(24)
    await victim.guest.exec(["sh", "-c", f"echo {victim_marker} > /root/victim.txt; sync"])
    needles = [secret, db_marker, victim_marker.encode()]
    uid = attacker.vm_uid
    assert uid is not None
    sdir = attacker.files.disk.parent
    assert _holds(victim.files.disk, [victim_marker.encode()]), "the victim's marker must be on its disk"
    try:
        # 1. Today's layout: the sandbox directory is root's, so the VM uid cannot swap anything.
        assert _mode(sdir) == "0:0o711"
        for name, target in (("disk.img", key_file), ("memory.ram", victim.files.disk)):
            assert _plant(uid, sdir, target, name) == "refused 13", name
        snap = await runtime.snapshot(attacker)
        assert _files_hold(snap.path, needles) == {}
        restored = await runtime.restore(snap, spec)
        try:
            assert _files_hold(restored.files.disk.parent, needles) == {}
        finally:
            await runtime.destroy(restored)

        # 2. A directory the VM uid can write (as older nodes made them): the swap works, the copy does not.
        # QEMU itself reopens its disk by name while migrating (as the VM uid: a root or other-VM file is
        # denied to it, and the save fails); a link to a file the VM uid may open gets past QEMU and is
        # refused by the node's own check (unsafe_source). A VM whose disk was swapped cannot continue,
        # so each swap gets a fresh attacker restored from ``snap``.
        host_file = pool.root / "host-file"
        host_file.write_bytes(secret)
        host_file.chmod(0o600)
        swaps: list[tuple[str, Path | None, set[str]]] = [
            ("disk.img", key_file, {"unsafe_source", "snapshot_error"}),
            ("disk.img", database, {"unsafe_source", "snapshot_error"}),
            ("memory.ram", victim.files.disk, {"unsafe_source", "snapshot_error"}),
            ("disk.img", None, {"unsafe_source", "snapshot_error"}),  # a hard link to a root file
            ("disk.img", Path("own"), {"unsafe_source"}),  # a link to a file of the VM uid's own
        ]
        for name, target, codes in swaps:
            clone = await runtime.restore(snap, spec)
            try:
                cdir, cuid = clone.files.disk.parent, clone.vm_uid
                assert cuid is not None and cuid not in (uid, victim.vm_uid)
                if target is None:
                    (cdir / name).rename(cdir / (name + ".real"))
                    os.link(host_file, cdir / name)
                else:
                    if target == Path("own"):
                        target = cdir / "disk.img.own"
                        os.link(cdir / "disk.img", target)  # the VM's own disk under another name
                    os.chown(cdir, cuid, cuid)
                    assert _plant(cuid, cdir, target, name) == "planted"
                before = set(pool.list_snapshots())
                with pytest.raises(SnapshotError) as refused:
                    await runtime.snapshot(clone)
                assert refused.value.code in codes, refused.value.message
                if refused.value.code == "unsafe_source":
                    assert "symbolic link" in refused.value.message, refused.value.message
                assert set(pool.list_snapshots()) == before
                assert not [p for p in pool.snapshots_dir.iterdir() if p.name.startswith(".")], "partial left"
            finally:
                await runtime.destroy(clone)
        host_file.unlink()

        # 3. A snapshot holding a link (root-owned snapshot dirs: only root could plant it): restore refused.
        (snap.path / "disk.img").unlink()
        (snap.path / "disk.img").symlink_to(victim.files.disk)
        sandboxes = set(pool.list_sandboxes())
        with pytest.raises(BootError, match="symbolic link"):
            await runtime.restore(snap, spec)
        assert set(pool.list_sandboxes()) == sandboxes
        assert len(runtime.list()) == 2
        assert (await attacker.guest.exec(["echo", "alive"])).stdout == b"alive\n"
        for snap_id in pool.list_snapshots():
            assert _files_hold(pool.snapshot_dir(snap_id), needles) == {}, snap_id
    finally:
        for name in ("disk.img", "memory.ram"):
            _unplant(sdir, name)
        await runtime.destroy(attacker)
        await runtime.destroy(victim)
