"""The newc cpio writer, checked with the real `cpio` tool."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest

from capsa.images.cpio import CpioWriter


def _sample() -> bytes:
    buf = io.BytesIO()
    w = CpioWriter(buf)
    w.add_dir("bin")
    w.add_dir("dev")
    w.add_dir("empty")
    w.add_char_device("dev/console", 5, 1)
    w.add_file("bin/tool", b"\x7fELF" + bytes(range(256)) * 3, 0o755)
    w.add_file("notes.txt", b"odd length!")  # exercises data padding
    w.add_file("zero", b"")
    w.add_symlink("bin/sh", "tool")
    w.close()
    return buf.getvalue()


def test_listing_by_real_cpio_shows_every_member_with_its_type() -> None:
    data = _sample()
    assert len(data) % 4 == 0
    out = subprocess.run(["cpio", "-itv", "--quiet"], input=data, capture_output=True, check=True).stdout
    lines = {line.split()[-1] if "->" not in line else line.split()[-3]: line
             for line in out.decode().splitlines()}
    assert set(lines) == {"bin", "dev", "empty", "dev/console", "bin/tool", "notes.txt", "zero", "bin/sh"}
    assert lines["bin"].startswith("drwxr-xr-x")
    assert lines["dev/console"].startswith("crw-------")
    assert "5,   1" in lines["dev/console"] or "5, 1" in lines["dev/console"]
    assert lines["bin/tool"].startswith("-rwxr-xr-x")
    assert lines["bin/sh"].startswith("lrwxrwxrwx") and lines["bin/sh"].endswith("-> tool")


def test_real_cpio_extracts_identical_contents(tmp_path: Path) -> None:
    buf = io.BytesIO()
    w = CpioWriter(buf)
    w.add_dir("d")
    w.add_file("d/a", b"alpha")
    w.add_file("d/b", bytes(range(256)) * 41, 0o600)
    w.add_symlink("d/link", "a")
    w.close()
    subprocess.run(["cpio", "-id", "--quiet", "--no-absolute-filenames"], input=buf.getvalue(), cwd=tmp_path,
                   check=True)
    assert (tmp_path / "d/a").read_bytes() == b"alpha"
    assert (tmp_path / "d/b").read_bytes() == bytes(range(256)) * 41
    assert (tmp_path / "d/b").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "d/link").readlink() == Path("a")


def test_output_is_reproducible() -> None:
    assert _sample() == _sample()


@pytest.mark.parametrize("name", ["", "../escape", "a/../../b", "nul\0byte"])
def test_rejects_bad_names(name: str) -> None:
    w = CpioWriter(io.BytesIO())
    with pytest.raises(ValueError, match="invalid cpio member name"):
        w.add_file(name, b"x")


def test_rejects_duplicates_missing_parents_and_writes_after_close() -> None:
    w = CpioWriter(io.BytesIO())
    w.add_dir("a")
    with pytest.raises(ValueError, match="duplicate"):
        w.add_dir("a")
    with pytest.raises(ValueError, match="parent directory"):
        w.add_file("b/c", b"")
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.add_file("late", b"")
