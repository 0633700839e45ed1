"""The README's main job (scripts/demo.sh: capsa serve + the SDK quick start) runs end to end with real
microVMs and leaves nothing on the node."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.vm
def test_main_job_script_runs_and_leaves_nothing() -> None:
    # Outside pytest's tmp root: QEMU runs unprivileged and needs every parent directory searchable.
    state = Path(tempfile.mkdtemp(prefix="capsa-demo-", dir="/tmp"))
    env = {**os.environ, "CAPSA_VENV": str(Path(sys.executable).parent.parent)}
    try:
        run = subprocess.run([str(ROOT / "scripts" / "demo.sh"), "--state-dir", str(state),
                              "--port", str(_free_port())], capture_output=True, text=True, env=env,
                             timeout=900)
        out = run.stdout
        assert run.returncode == 0, out + run.stderr
        assert "332833500" in out
        assert "read back: hello from inside the sandbox" in out
        kernel = next(line for line in out.splitlines() if " on kernel " in line).split()[-1]
        assert kernel != platform.release()
        assert "VM directories left: 0; QEMU processes left: 0" in out
        assert not any((state / "vms").iterdir()) if (state / "vms").exists() else True
    finally:
        subprocess.run(["umount", "-l", str(state / "storage" / "pool")], capture_output=True)
        subprocess.run(["rm", "-rf", str(state)], check=False)
