"""Reading .modinfo dependencies from kernel modules and ordering them for insmod."""

from __future__ import annotations

import lzma
import struct
from pathlib import Path

import pytest

from capsa.images.errors import ImageBuildError
from capsa.images.modules import find_kernel_release, modinfo, resolve_modules


def make_module(info: dict[str, str]) -> bytes:
    """A minimal ELF64 relocatable object holding only a .modinfo and a section-name table."""
    modinfo_data = b"".join(f"{k}={v}".encode() + b"\0" for k, v in info.items())
    shstrtab = b"\0.modinfo\0.shstrtab\0"
    data_off = 64
    str_off = data_off + len(modinfo_data)
    shoff = (str_off + len(shstrtab) + 7) & ~7
    header = bytearray(64)
    header[0:4] = b"\x7fELF"
    header[4], header[5], header[6] = 2, 1, 1  # 64-bit, little endian, version
    struct.pack_into("<HHI", header, 16, 1, 62, 1)  # ET_REL, x86-64
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHHHHH", header, 0x34, 64, 0, 0, 64, 3, 2)
    body = bytes(header) + modinfo_data + shstrtab
    body += b"\0" * (shoff - len(body))
    null = b"\0" * 64
    sec_modinfo = struct.pack("<IIQQQQIIQQ", 1, 1, 2, 0, data_off, len(modinfo_data), 0, 0, 1, 0)
    sec_strtab = struct.pack("<IIQQQQIIQQ", 10, 3, 0, 0, str_off, len(shstrtab), 0, 0, 1, 0)
    return body + null + sec_modinfo + sec_strtab


def _tree(tmp_path: Path, modules: dict[str, str], builtin: tuple[str, ...] = ()) -> Path:
    root = tmp_path / "lib/modules/6.1.0-test"
    for rel, depends in modules.items():
        p = root / "kernel" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        elf = make_module({"license": "GPL", "depends": depends, "name": Path(rel).name.split(".")[0]})
        p.write_bytes(lzma.compress(elf) if rel.endswith(".xz") else elf)
    root.mkdir(parents=True, exist_ok=True)
    (root / "modules.builtin").write_text("".join(f"kernel/{b}\n" for b in builtin))
    return root


def test_modinfo_parses_keys() -> None:
    info = modinfo(make_module({"depends": "a,b", "license": "GPL"}))
    assert info["depends"] == ["a,b"]
    assert info["license"] == ["GPL"]


@pytest.mark.parametrize("blob", [b"", b"not an elf at all" * 8, b"\x7fELF\x01\x01" + b"\0" * 100])
def test_modinfo_rejects_non_modules(blob: bytes) -> None:
    with pytest.raises(ImageBuildError):
        modinfo(blob)


def test_dependencies_come_first_and_requested_order_is_kept(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "drivers/virtio/virtio_ring.ko": "",
        "drivers/virtio/virtio.ko": "",
        "drivers/net/virtio_net.ko": "virtio_ring,virtio,net_failover",
        "drivers/net/net_failover.ko.xz": "failover",
        "net/core/failover.ko": "",
    })
    mods = resolve_modules(root, ["virtio_ring", "virtio", "virtio_net"])
    assert [m.name for m in mods] == ["virtio_ring", "virtio", "failover", "net_failover", "virtio_net"]
    # Compressed modules are handed out decompressed (busybox insmod wants plain ELF).
    assert mods[3].read().startswith(b"\x7fELF")
    assert mods[4].depends == ("virtio_ring", "virtio", "net_failover")


def test_dash_and_underscore_are_the_same_name(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"drivers/char/virtio-rng.ko": ""})
    assert [m.name for m in resolve_modules(root, ["virtio_rng"])] == ["virtio_rng"]


def test_builtin_modules_are_skipped_missing_ones_are_errors(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"drivers/a.ko": "ext4"}, builtin=("fs/ext4/ext4.ko",))
    assert [m.name for m in resolve_modules(root, ["a", "ext4"])] == ["a"]
    with pytest.raises(ImageBuildError, match=r"kernel module nope is not in the kernel package"):
        resolve_modules(root, ["nope"])


def test_missing_dependency_names_who_needs_it(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"drivers/a.ko": "ghost"})
    with pytest.raises(ImageBuildError, match=r"ghost \(needed by a\)"):
        resolve_modules(root, ["a"])


def test_dependency_cycle_is_an_error(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"drivers/a.ko": "b", "drivers/b.ko": "a"})
    with pytest.raises(ImageBuildError, match="cycle"):
        resolve_modules(root, ["a"])


def test_kernel_release_needs_exactly_one(tmp_path: Path) -> None:
    _tree(tmp_path, {"drivers/a.ko": ""})
    assert find_kernel_release(tmp_path) == "6.1.0-test"
    (tmp_path / "lib/modules/6.1.0-other").mkdir()
    with pytest.raises(ImageBuildError, match="expected one kernel release"):
        find_kernel_release(tmp_path)
