"""Finding and decompressing the kernel payload inside a bzImage."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from capsa.images.errors import ImageBuildError
from capsa.images.kernel import ELF_MAGIC, extract_vmlinux, find_payloads


def _lz4_legacy(data: bytes) -> bytes:
    # The kernel build uses `lz4 -l` (legacy frame); so does this test, through the real CLI.
    return subprocess.run(["lz4", "-l", "-9", "-c"], input=data, capture_output=True, check=True).stdout


COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": lambda d: gzip.compress(d, mtime=0),
    "xz": lambda d: lzma.compress(d, format=lzma.FORMAT_XZ),
    "bzip2": bz2.compress,
    "zstd": lambda d: zstandard.ZstdCompressor().compress(d),
    "lz4": _lz4_legacy,
}

# A fake kernel: ELF magic and enough varied bytes that compression is not trivial.
FAKE_ELF = ELF_MAGIC + b"\x02\x01\x01" + os.urandom(64 * 1024) + b"\0" * 4096


def _bzimage(payload: bytes) -> bytes:
    """Stand-in for a bzImage: a setup header with decoy magics, the payload, then trailing data."""
    decoy = b"\x1f\x8b\x08garbage-not-gzip" + b"\x28\xb5\x2f\xfdnot-zstd" + b"BZhnope"
    return b"MZ" + b"\x90" * 500 + decoy + b"HdrS" + payload + b"\xff" * 300


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_extracts_elf_from_each_compression(name: str) -> None:
    out, found = extract_vmlinux(_bzimage(COMPRESSORS[name](FAKE_ELF)))
    assert found == name
    assert out == FAKE_ELF


def test_reads_from_path(tmp_path: Path) -> None:
    p = tmp_path / "vmlinuz"
    p.write_bytes(_bzimage(COMPRESSORS["zstd"](FAKE_ELF)))
    assert extract_vmlinux(p) == (FAKE_ELF, "zstd")


def test_plain_elf_is_returned_as_is() -> None:
    assert extract_vmlinux(FAKE_ELF) == (FAKE_ELF, "none")


def test_no_payload_is_a_clear_error() -> None:
    with pytest.raises(ImageBuildError, match="no compression magic found"):
        extract_vmlinux(b"MZ" + b"\x00" * 4096)


def test_payload_that_is_not_elf_is_rejected() -> None:
    with pytest.raises(ImageBuildError, match=r"no ELF kernel found .*gzip@"):
        extract_vmlinux(_bzimage(gzip.compress(b"#!/bin/sh\necho not a kernel\n" * 100)))


def test_find_payloads_lists_offsets_in_file_order() -> None:
    blob = b"..." + b"\x28\xb5\x2f\xfd" + b"...." + b"\x1f\x8b\x08" + b".."
    assert list(find_payloads(blob)) == [(3, "zstd"), (11, "gzip")]


@settings(max_examples=40, deadline=None)
@given(prefix=st.binary(max_size=2048), suffix=st.binary(max_size=512),
       name=st.sampled_from(["gzip", "xz", "bzip2", "zstd"]))
def test_payload_found_after_arbitrary_bytes(prefix: bytes, suffix: bytes, name: str) -> None:
    # A bzImage starts with "MZ"; without it a prefix that happens to be ELF is taken as the kernel.
    out, _ = extract_vmlinux(b"MZ" + prefix + COMPRESSORS[name](FAKE_ELF) + suffix)
    assert out == FAKE_ELF
