"""The peers benchmark runs end to end with n=1 and writes well-formed results (no speed is asserted).

Boots real microVMs (capsa's three creation paths) and really runs every peer. When a peer cannot run on
this host the benchmark records why; the test then checks everything else and skips with that reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capsa.common.image import GuestImage

BENCH = Path(__file__).resolve().parents[2] / "bench"
CAPSA = ("capsa_warm_pool", "capsa_restore_on_demand", "capsa_cold_boot")
PEERS = ("gvisor_runsc_20240729_systrap", "gvisor_runsc_20221219_ptrace", "nitrobox",
         "llm_sandbox_bubblewrap")


@pytest.mark.vm
@pytest.mark.root
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="the peers benchmark needs root (QEMU uids, runsc, mounts)")
def test_peers_benchmark_smoke(tmp_path: Path, guest_image: GuestImage) -> None:
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run_peers.py"), "--n", "1", "--cold", "1", "--n-slow", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    entries, ratios = data["entries"], data["ratios_vs_capsa_warm_pool"]
    assert set(entries) == {*CAPSA, *PEERS, "llm_sandbox_docker"}
    for name in CAPSA:
        s = entries[name]["create_first_exec_s"]
        assert s["n"] == 1 and 0 < s["p50"] == s["p95"]
        assert name in ratios
    assert ratios["capsa_warm_pool"] == {"p50": 1.0, "p95": 1.0}
    # Each pooled creation really came from the pool, each on-demand one from a restore.
    assert set(entries["capsa_warm_pool"]["sources"]) == {"pool"}, entries["capsa_warm_pool"]
    assert "pool" not in entries["capsa_restore_on_demand"]["sources"]
    assert "Docker" in entries["llm_sandbox_docker"]["skipped"]
    base = entries["capsa_warm_pool"]["create_first_exec_s"]["p50"]
    skipped = {}
    for name in PEERS:
        e = entries[name]
        if "skipped" in e:
            assert e["skipped"] and e["skipped"] in proc.stdout, "a skip must be printed with its reason"
            skipped[name] = e["skipped"]
            continue
        s = e["create_first_exec_s"]
        assert s["n"] == 1 and s["p50"] > 0 and e["isolation"]
        assert ratios[name]["p50"] == pytest.approx(s["p50"] / base)
    if skipped:
        pytest.skip("peers that cannot run here: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
