"""deploy/systemd's units: ``systemd-analyze verify`` accepts them, and they keep the contract (notify
readiness, restart on failure, SIGTERM with time to stop, the env files, the capsa command and its options,
least privilege for the control plane, SIGTERM to the node alone).

``systemd-analyze verify`` refuses a unit whose ExecStart binary does not exist, and the units run
/usr/local/bin/capsa (the link ``scripts/install.sh --link`` makes), which the test host need not have: the
verified copies run this venv's capsa instead, the one change made to them. It reports bad values (an
unknown Type=, a misspelt key) on stderr while still exiting 0, so both are checked."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capsa.node.daemon import LEAVE_TIMEOUT
from tests.support.served import CAPSA, ROOT

UNITS = ROOT / "deploy" / "systemd"
INSTALLED = "/usr/local/bin/capsa"


def _settings(unit: Path) -> dict[str, list[str]]:
    """Each key of the unit with its values in order (keys may repeat), sections ignored."""
    found: dict[str, list[str]] = {}
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def _verify(unit: Path, into: Path) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is missing (scripts/install.sh --dev installs systemd)"
    copy = into / unit.name
    copy.write_text(unit.read_text().replace(f"ExecStart={INSTALLED} ", f"ExecStart={CAPSA[0]} "))
    return subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["capsa-control.service", "capsa-node.service"])
def test_unit_passes_systemd_analyze_verify(name: str, tmp_path: Path) -> None:
    done = _verify(UNITS / name, tmp_path)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done.stderr


def test_verify_catches_a_bad_unit(tmp_path: Path) -> None:
    """The check above can fail: a wrong value is reported, a missing command refused."""
    bad = tmp_path / "bad"
    bad.mkdir()
    broken = bad / "capsa-node.service"
    broken.write_text((UNITS / "capsa-node.service").read_text().replace("Type=notify", "Type=notfy"))
    done = _verify(broken, tmp_path)
    assert "Failed to parse service type" in done.stderr
    missing = subprocess.run(["systemd-analyze", "verify", str(UNITS / "capsa-node.service")],
                             capture_output=True, text=True, timeout=60)
    if not Path(INSTALLED).exists():
        assert missing.returncode != 0 and f"Command {INSTALLED} is not executable" in missing.stderr


@pytest.mark.parametrize("role", ["control", "node"])
def test_units_keep_the_contract(role: str) -> None:
    unit = _settings(UNITS / f"capsa-{role}.service")
    assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
    assert unit["Restart"] == ["on-failure"] and unit["KillSignal"] == ["SIGTERM"]
    assert unit["EnvironmentFile"] == [f"-/etc/capsa/{role}.env"]
    command = unit["ExecStart"][0].split()
    assert command[:2] == [INSTALLED, role]
    # The options the unit passes exist (click refuses unknown ones before --help is acted on).
    checked = subprocess.run([sys.executable, "-c", "from capsa.cli.main import main; main()",
                              *command[1:], "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert checked.returncode == 0, checked.stderr
    stop = int(unit["TimeoutStopSec"][0].removesuffix("s"))
    if role == "control":
        assert unit["DynamicUser"] == ["yes"] and unit["NoNewPrivileges"] == ["yes"]
        assert unit["ProtectSystem"] == ["strict"] and unit["CapabilityBoundingSet"] == [""]
        assert unit["StateDirectory"] == ["capsa-control"]
        assert "CAPSA_STATE_DIR=/var/lib/capsa-control" in unit["Environment"]
    else:
        # SIGTERM to the node alone: it stops its VMs itself, after the control plane has taken its
        # sessions (the node waits up to LEAVE_TIMEOUT for that), so QEMU must not get the signal too.
        assert unit["KillMode"] == ["mixed"] and unit["User"] == ["root"]
        assert stop >= LEAVE_TIMEOUT + 60
        assert "CAPSA_STATE_DIR=/var/lib/capsa" in unit["Environment"]
        assert "CAPSA_NODE_LISTEN=0.0.0.0:8701" in unit["Environment"]
