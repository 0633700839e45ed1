"""Sealed RAM memfds (issue 31): a frozen RAM file's copy that VMs map privately, that nobody can write, and
that VMs of one domain share."""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

import pytest

from capsa.node.runtime.qemu.sealed_ram import SEALS, SealedRam, sealed_copy
from tests.support.memfd_attack import attack_as, ram_memfds

PAGE = 4096


def _ram_file(path: Path, pages: int = 64) -> bytes:
    """A RAM-like file: data pages, zero pages and a hole."""
    data = bytearray(pages * PAGE)
    for page in (0, 1, 5, 40, 63):
        data[page * PAGE:(page + 1) * PAGE] = bytes([page + 1]) * PAGE
    with path.open("wb") as f:
        f.write(data[:48 * PAGE])  # pages 48.. are a hole
        f.truncate(len(data))
        f.seek(63 * PAGE)
        f.write(data[63 * PAGE:])
    return bytes(data)


def test_the_copy_holds_the_file_with_its_zero_pages_as_holes_and_is_sealed(tmp_path: Path) -> None:
    want = _ram_file(tmp_path / "memory.ram")
    fd = sealed_copy(tmp_path / "memory.ram")
    try:
        assert os.fstat(fd).st_size == len(want)
        assert os.pread(fd, len(want), 0) == want
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
        # Only the 5 data pages take memory: the zero pages and the hole were never written.
        assert os.fstat(fd).st_blocks * 512 == 5 * PAGE
        for attempt in (lambda: os.pwrite(fd, b"x", 0), lambda: os.ftruncate(fd, 0),
                        lambda: mmap.mmap(fd, PAGE, flags=mmap.MAP_SHARED)):
            with pytest.raises(PermissionError):
                attempt()  # root included
        assert os.get_inheritable(fd) is False
    finally:
        os.close(fd)


def test_a_whole_copy_holds_the_files_data_zero_pages_included_and_only_its_holes_as_holes(
        tmp_path: Path) -> None:
    want = _ram_file(tmp_path / "memory.ram")
    data_pages = 48 + (len(want) // PAGE - 63)  # pages 0-47 and 63: the data, zero pages among them
    fd = sealed_copy(tmp_path / "memory.ram", sparse=False)
    try:
        assert os.pread(fd, len(want), 0) == want
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
        assert os.fstat(fd).st_blocks * 512 == data_pages * PAGE
    finally:
        os.close(fd)


def test_a_private_mapping_writes_its_own_pages_and_the_memfd_keeps_the_file(tmp_path: Path) -> None:
    want = _ram_file(tmp_path / "memory.ram")
    fd = sealed_copy(tmp_path / "memory.ram")
    try:
        mine = mmap.mmap(fd, len(want), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mine[0:6] = b"poison"
        assert mine[0:6] == b"poison"
        other = mmap.mmap(fd, len(want), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        assert other[0:6] == want[0:6] and os.pread(fd, 6, 0) == want[0:6]
        mine.close()
        other.close()
    finally:
        os.close(fd)


@pytest.mark.root  # the attack runs as another uid
def test_no_process_can_write_the_memfd_and_a_vm_uid_cannot_open_the_file(tmp_path: Path) -> None:
    _ram_file(tmp_path / "memory.ram")
    (tmp_path / "memory.ram").chmod(0o600)
    tmp_path.chmod(0o711)
    fd = sealed_copy(tmp_path / "memory.ram")
    try:
        # The memfd's own path, as QEMU reaches it: opened read-write by a fresh root process (the VM test
        # does it as the QEMU's uid), it still takes no write of any kind.
        path = f"/proc/{os.getpid()}/fd/{fd}"
        got = attack_as(os.getuid(), os.getgid(), path)[path]
        refused = "Operation not permitted"
        assert got == {"open": "ok", "write": refused, "truncate": refused, "punch": refused,
                       "shared_map": refused}
        # The file the memfd was copied from: a VM uid cannot even open it.
        ram = str(tmp_path / "memory.ram")
        assert attack_as(1879048999, 1879048999, ram)[ram] == {"open": "Permission denied"}
    finally:
        os.close(fd)


def test_one_memfd_per_file_and_domain_closed_with_its_last_user(tmp_path: Path) -> None:
    _ram_file(tmp_path / "a.ram")
    _ram_file(tmp_path / "b.ram")
    ram = SealedRam()
    a1 = ram.acquire(tmp_path / "a.ram", "sbx_1", "tenant-a")
    assert ram.acquire(tmp_path / "a.ram", "sbx_2", "tenant-a") == a1  # one copy shared in the domain
    other_tenant = ram.acquire(tmp_path / "a.ram", "sbx_3", "tenant-b")
    other_file = ram.acquire(tmp_path / "b.ram", "sbx_4", "tenant-a")
    assert len({a1, other_tenant, other_file}) == 3
    assert set(ram_memfds()) == {a1, other_tenant, other_file}
    ram.release("sbx_1")
    os.fstat(a1)  # sbx_2 still maps it
    ram.release("sbx_2")
    ram.release("sbx_2")  # idempotent
    with pytest.raises(OSError):
        os.fstat(a1)
    assert set(ram_memfds()) == {other_tenant, other_file}
    ram.release("sbx_3")
    ram.release("sbx_4")
    assert ram_memfds() == {}
