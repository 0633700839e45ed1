"""Getting a bootable ELF ``vmlinux`` out of a Debian ``vmlinuz`` (bzImage).

QEMU's microvm boots an ELF kernel through its PVH entry point; the bzImage path through qboot hangs
(see RECIPES.md). A bzImage is a small decompressor followed by the compressed kernel, so, like the
kernel tree's ``extract-vmlinux``, we look for every known compression magic, try to decompress from
there, and keep the first result that is an ELF file.
"""

from __future__ import annotations

import bz2
import lzma
import shutil
import subprocess
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import zstandard

from capsa.images.errors import ImageBuildError

__all__ = ["ELF_MAGIC", "PAYLOAD_MAGICS", "extract_vmlinux", "find_payloads"]

ELF_MAGIC = b"\x7fELF"

# The decompressed kernel is ~30-60 MiB; refuse to inflate anything absurdly larger.
_MAX_OUTPUT = 512 * 1024 * 1024


def _gunzip(data: bytes) -> bytes:
    # wbits=31: a gzip header is expected; trailing bytes after the stream end are ignored.
    d = zlib.decompressobj(wbits=31)
    return d.decompress(data, _MAX_OUTPUT)


def _unxz(data: bytes) -> bytes:
    d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    return d.decompress(data, _MAX_OUTPUT)


def _bunzip2(data: bytes) -> bytes:
    return bz2.BZ2Decompressor().decompress(data)


def _unzstd(data: bytes) -> bytes:
    # The kernel's zstd frame does not always record its content size, so stream it; the
    # decompression object stops at the end of the first frame and ignores what follows.
    d = zstandard.ZstdDecompressor().decompressobj()
    return d.decompress(data)


def _unlz4(data: bytes) -> bytes:
    # The kernel uses the legacy lz4 frame format, which Python's ecosystem rarely supports; the
    # lz4 CLI does. It reports an error on the bytes that follow the payload, so judge the result by
    # what came out, not by the exit status.
    lz4 = shutil.which("lz4")
    if lz4 is None:
        raise ImageBuildError("the kernel is lz4-compressed but the `lz4` command is not installed")
    proc = subprocess.run([lz4, "-dc"], input=data, capture_output=True, check=False)
    return proc.stdout


PAYLOAD_MAGICS: dict[str, tuple[bytes, Callable[[bytes], bytes]]] = {
    "gzip": (b"\x1f\x8b\x08", _gunzip),
    "xz": (b"\xfd7zXZ\x00", _unxz),
    "bzip2": (b"BZh", _bunzip2),
    "zstd": (b"\x28\xb5\x2f\xfd", _unzstd),
    "lz4": (b"\x02\x21\x4c\x18", _unlz4),
}


def find_payloads(image: bytes) -> Iterator[tuple[int, str]]:
    """Yield (offset, compression) of every compression magic in ``image``, in file order."""
    hits: list[tuple[int, str]] = []
    for name, (magic, _) in PAYLOAD_MAGICS.items():
        start = 0
        while (pos := image.find(magic, start)) >= 0:
            hits.append((pos, name))
            start = pos + 1
    yield from sorted(hits)


def extract_vmlinux(vmlinuz: bytes | Path) -> tuple[bytes, str]:
    """Return (ELF kernel, compression name) found inside a bzImage.

    Raises :class:`ImageBuildError` when no candidate payload decompresses to an ELF file.
    """
    data = vmlinuz.read_bytes() if isinstance(vmlinuz, Path) else vmlinuz
    if data.startswith(ELF_MAGIC):
        return data, "none"
    tried: list[str] = []
    for offset, name in find_payloads(data):
        decompress = PAYLOAD_MAGICS[name][1]
        try:
            out = decompress(data[offset:])
        except (zlib.error, lzma.LZMAError, OSError, EOFError, ValueError, zstandard.ZstdError):
            # A magic that merely occurs by chance inside other data: keep looking.
            tried.append(f"{name}@{offset}")
            continue
        if out.startswith(ELF_MAGIC):
            return out, name
        tried.append(f"{name}@{offset}")
    detail = ", ".join(tried[:10]) if tried else "no compression magic found"
    raise ImageBuildError(f"no ELF kernel found inside the vmlinuz (tried: {detail})")
