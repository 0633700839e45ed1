"""``capsa vm run`` as a user runs it: the real CLI in a subprocess, booting a real microVM each time."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.common.image import GuestImage
from tests.support.interrupt import sigint_default

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed"),
]

# The console script installed next to this interpreter (the project is installed editable).
CAPSA = [str(Path(sys.executable).with_name("capsa"))]


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cvc-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _capsa(state_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CAPSA, "vm", "run", "--state-dir", str(state_dir), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def _qemu_processes_under(state_dir: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(state_dir).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _assert_clean(state_dir: Path) -> None:
    assert _qemu_processes_under(state_dir) == []
    vms = state_dir / "vms"
    assert not vms.exists() or list(vms.iterdir()) == []


def test_prints_the_guest_kernel_release(state_dir: Path, guest_image: GuestImage) -> None:
    proc = _capsa(state_dir, "--", "python3", "-c", "import platform; print(platform.release())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == guest_image.kernel_release
    assert proc.stdout.strip() != os.uname().release
    _assert_clean(state_dir)


def test_exit_status_and_both_streams(state_dir: Path, guest_image: GuestImage) -> None:
    proc = _capsa(state_dir, "--", "sh", "-c", "echo to-out; echo to-err >&2; exit 7")
    assert proc.returncode == 7
    assert proc.stdout == "to-out\n"
    assert "to-err\n" in proc.stderr
    _assert_clean(state_dir)


def test_timeout_gives_124(state_dir: Path, guest_image: GuestImage) -> None:
    proc = _capsa(state_dir, "--timeout", "2", "--", "sh", "-c", "echo begun; sleep 120")
    assert proc.returncode == 124
    assert proc.stdout == "begun\n"
    assert "timed out after 2s" in proc.stderr
    _assert_clean(state_dir)


def test_ctrl_c_destroys_the_vm(state_dir: Path, guest_image: GuestImage) -> None:
    proc = subprocess.Popen([*CAPSA, "vm", "run", "--state-dir", str(state_dir), "--", "sh", "-c",
                             "echo running; sleep 600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=sigint_default)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "running\n"  # the VM is up and the command is running
        assert _qemu_processes_under(state_dir) != []
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    _assert_clean(state_dir)


def test_bad_arguments_are_refused_before_booting(state_dir: Path) -> None:
    proc = _capsa(state_dir, "--memory", "1", "--", "true", timeout=60)
    assert proc.returncode == 2
    assert "--memory" in proc.stderr
    proc = _capsa(state_dir, "--accel", "quantum", "--", "true", timeout=60)
    assert proc.returncode == 2
    proc = _capsa(state_dir, timeout=60)
    assert proc.returncode == 2
    _assert_clean(state_dir)
