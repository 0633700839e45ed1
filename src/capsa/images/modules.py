"""Kernel modules for the initramfs: finding them in an unpacked kernel package and ordering them.

The Debian package ships no ``modules.dep`` (depmod runs at install time), so dependencies are read
from each module's ``.modinfo`` ELF section, which records ``depends=a,b``.
"""

from __future__ import annotations

import lzma
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import zstandard

from capsa.images.errors import ImageBuildError

__all__ = ["KernelModule", "find_kernel_release", "modinfo", "module_index", "resolve_modules"]


@dataclass(frozen=True)
class KernelModule:
    name: str
    path: Path
    depends: tuple[str, ...]

    def read(self) -> bytes:
        """The module's bytes, decompressed (busybox insmod only loads plain ELF modules)."""
        return _decompress_module(self.path.name, self.path.read_bytes())


def _normalize(name: str) -> str:
    # The kernel treats '-' and '_' in module names as the same character.
    return name.replace("-", "_")


def _decompress_module(filename: str, data: bytes) -> bytes:
    if filename.endswith(".ko.xz"):
        return lzma.decompress(data)
    if filename.endswith(".ko.zst"):
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if filename.endswith(".ko.gz"):
        return zlib.decompress(data, wbits=31)
    return data


def _module_name(filename: str) -> str | None:
    for suffix in (".ko", ".ko.xz", ".ko.zst", ".ko.gz"):
        if filename.endswith(suffix):
            return _normalize(filename[: -len(suffix)])
    return None


def modinfo(elf: bytes) -> dict[str, list[str]]:
    """Parse the ``.modinfo`` section of a 64-bit little-endian ELF module."""
    if len(elf) < 64 or not elf.startswith(b"\x7fELF"):
        raise ImageBuildError("not an ELF kernel module")
    if elf[4] != 2 or elf[5] != 1:
        raise ImageBuildError("only 64-bit little-endian kernel modules are supported")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    if shentsize < 64 or shstrndx >= shnum or shoff + shnum * shentsize > len(elf):
        raise ImageBuildError("corrupt ELF section table in kernel module")

    def section(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, offset, size

    _, str_off, str_size = section(shstrndx)
    strtab = elf[str_off : str_off + str_size]
    for i in range(shnum):
        name_off, offset, size = section(i)
        end = strtab.find(b"\0", name_off)
        if strtab[name_off:end] == b".modinfo":
            info: dict[str, list[str]] = {}
            for entry in elf[offset : offset + size].split(b"\0"):
                key, sep, value = entry.partition(b"=")
                if sep:
                    info.setdefault(key.decode(errors="replace"), []).append(value.decode(errors="replace"))
            return info
    return {}


def find_kernel_release(kernel_root: Path) -> str:
    """The release string (``uname -r``) of the kernel unpacked at ``kernel_root``."""
    releases = sorted(p.name for p in (kernel_root / "lib" / "modules").glob("*") if p.is_dir())
    if len(releases) != 1:
        raise ImageBuildError(
            f"expected one kernel release under {kernel_root}/lib/modules, found {releases}")
    return releases[0]


def module_index(modules_dir: Path) -> tuple[dict[str, Path], set[str]]:
    """Map module name -> file for every loadable module, and the set of built-in module names."""
    index: dict[str, Path] = {}
    for path in sorted((modules_dir / "kernel").rglob("*.ko*")):
        name = _module_name(path.name)
        if name is not None:
            index.setdefault(name, path)
    builtin: set[str] = set()
    builtin_list = modules_dir / "modules.builtin"
    if builtin_list.exists():
        for line in builtin_list.read_text().splitlines():
            name = _module_name(Path(line.strip()).name)
            if name is not None:
                builtin.add(name)
    return index, builtin


def resolve_modules(modules_dir: Path, wanted: list[str]) -> list[KernelModule]:
    """The modules to load, dependencies first, otherwise in the order asked for.

    Built-in modules are skipped; a module that is neither loadable nor built in is an error.
    """
    index, builtin = module_index(modules_dir)
    ordered: list[KernelModule] = []
    placed: set[str] = set()
    visiting: set[str] = set()

    def visit(raw: str, wanted_by: str | None) -> None:
        name = _normalize(raw)
        if name in placed:
            return
        if name in visiting:
            raise ImageBuildError(f"kernel module dependency cycle through {name}")
        path = index.get(name)
        if path is None:
            if name in builtin:
                placed.add(name)
                return
            why = f" (needed by {wanted_by})" if wanted_by else ""
            raise ImageBuildError(f"kernel module {name}{why} is not in the kernel package")
        visiting.add(name)
        info = modinfo(_decompress_module(path.name, path.read_bytes()))
        depends = tuple(d for v in info.get("depends", []) for d in v.split(",") if d)
        for dep in depends:
            visit(dep, name)
        visiting.discard(name)
        placed.add(name)
        ordered.append(KernelModule(name=name, path=path, depends=tuple(_normalize(d) for d in depends)))

    for raw in wanted:
        visit(raw, None)
    return ordered
