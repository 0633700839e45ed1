"""The runtime benchmark runs end to end and writes well-formed results (no speed is asserted here)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capsa.common.image import GuestImage

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from harness import summary  # noqa: E402


def test_summary_statistics() -> None:
    s = summary([float(v) for v in range(1, 101)])
    assert (s["n"], s["min"], s["max"], s["p50"], s["p95"]) == (100, 1.0, 100.0, 50.5, 95.0)
    assert summary([3.0])["p95"] == 3.0
    with pytest.raises(ValueError):
        summary([])


@pytest.mark.vm
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed")
def test_runtime_benchmark_smoke(tmp_path: Path, guest_image: GuestImage) -> None:
    out = tmp_path / "runtime.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run_runtime.py"), "--boots", "1", "--execs", "5", "--file-mib", "1",
         "--idle", "0.5", "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["accelerator"]["used"] in ("kvm", "tcg")
    assert data["image"]["kernel"] == guest_image.kernel_release
    assert data["cold_boot_s"]["n"] == 1 and data["cold_boot_s"]["p50"] > 0
    assert data["exec_true_ms"]["n"] == 5 and data["health_rtt_ms"]["n"] == 5
    assert data["file_write_mib_s"]["p50"] > 0 and data["file_read_mib_s"]["p50"] > 0
    assert data["idle_vm_memory"]["rss_mib"] > 0 and data["idle_vm_memory"]["pss_mib"] > 0
    assert "cold boot to daemon ready" in proc.stdout
