"""``capsa doctor`` and the node's start-up checks, on this host for real: the JSON contract, the accelerator
the runtime settles (here: the TCG fallback, named with its reason), a state dir the VM user cannot reach,
what each check says when its part is missing, and ``capsa node`` refusing at the first failure with nothing
left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.common.settings import Settings
from capsa.node.doctor import Check, DoctorConfig, first_failure, host, paths, remote, run_checks
from capsa.node.doctor.run import CHECKS
from capsa.node.runtime.qemu.kvm import kvm_access_error, kvm_groups
from capsa.node.runtime.workdir import VM_UID_BASE
from capsa.node.storage.pool import StorageSettings
from tests.support.s3_server import S3Server
from tests.support.served import ROOT
from tests.support.vm import searchable_dir

pytestmark = pytest.mark.root

_CLI = "from capsa.cli.main import main; main()"
NAMES = ["accelerator", "qemu", "btrfs", "nftables", "cgroups", "vm_user", "state_dir", "disk_space", "store",
         "control_plane"]


@pytest.fixture
def workdir() -> Iterator[Path]:
    with searchable_dir("capsa-doctor-") as path:
        yield path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CAPSA_ACCEL", "CAPSA_STORE_URL", "CAPSA_CONTROL_URL", "CAPSA_STORAGE_PATH",
                        "CAPSA_STORAGE_MIN_FREE_MIB", "CAPSA_STATE_DIR")}
    return {**env, **extra}


def _capsa(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CLI, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env if env is not None else _env(), timeout=300)


def _doctor_json(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Check]]:
    done = _capsa("doctor", "--json", *args, env=env)
    body = json.loads(done.stdout)
    assert list(body) == ["checks"]
    for item in body["checks"]:
        assert list(item) == ["name", "ok", "detail", "fix"], item
        assert isinstance(item["ok"], bool) and isinstance(item["detail"], str) and item["detail"]
        assert item["ok"] or isinstance(item["fix"], str), item  # every failure says how to fix it
    assert [c["name"] for c in body["checks"]] == NAMES
    return done.returncode, {c["name"]: Check(**c) for c in body["checks"]}


async def _kvm_reason() -> str | None:
    return await kvm_access_error((VM_UID_BASE, VM_UID_BASE), kvm_groups())


async def test_doctor_on_this_host_passes_and_names_the_accelerator_it_settles(workdir: Path) -> None:
    code, checks = _doctor_json("--state-dir", str(workdir / "state"))
    assert code == 0 and all(c.ok for c in checks.values()), checks
    reason = await _kvm_reason()
    accel = checks["accelerator"].detail
    if reason is not None:  # these hosts: the VM user cannot open the PVM /dev/kvm, so TCG without a probe
        assert accel == f"tcg, the fallback (software emulation): kvm unusable: {reason}"
    else:
        assert accel.startswith(("kvm (kvm probe boot answered", "tcg, the fallback (software emulation): "
                                 "kvm probe boot failed")), accel
    assert checks["vm_user"].detail.endswith(f"ran as uid {VM_UID_BASE}, groups {VM_UID_BASE}, links lo")
    assert "QEMU 7." in checks["qemu"].detail or "QEMU 8." in checks["qemu"].detail
    assert checks["store"].detail.startswith("not configured")
    assert checks["control_plane"].detail.startswith("not configured")
    assert not (workdir / "state").exists()  # checking makes nothing
    assert not list(Settings().cache_dir.glob(".doctor-*"))


def test_doctor_names_the_directory_the_vm_user_cannot_traverse(workdir: Path) -> None:
    locked = workdir / "locked"
    locked.mkdir(mode=0o700)
    code, checks = _doctor_json("--state-dir", str(locked / "state"))
    assert code == 1
    assert [c.name for c in checks.values() if not c.ok] == ["state_dir"]
    found = checks["state_dir"]
    assert found.detail == (f"{locked} (mode 0700, owner 0:0) is not searchable by the VM user "
                            f"{VM_UID_BASE}: QEMU could not reach its files under {locked / 'state'}")
    assert found.fix is not None and found.fix.startswith(f"chmod o+x {locked}")
    text = _capsa("doctor", "--state-dir", str(locked / "state"))
    assert text.returncode == 1
    failing = [line for line in text.stdout.splitlines() if line.startswith("FAIL")]
    assert failing == [f"FAIL  state_dir      {found.detail}"], text.stdout
    assert f"fix: chmod o+x {locked}" in text.stdout
    # Fixed as the line says, the same state dir passes.
    locked.chmod(0o711)
    code, checks = _doctor_json("--state-dir", str(locked / "state"))
    assert code == 0 and checks["state_dir"].ok


def test_forced_kvm_the_vm_user_cannot_open_fails(workdir: Path) -> None:
    import asyncio

    if asyncio.run(_kvm_reason()) is None:
        pytest.fail("this test needs a /dev/kvm the VM user cannot open (test_qemu_runtime covers the rest)")
    code, checks = _doctor_json("--state-dir", str(workdir / "state"), env=_env(CAPSA_ACCEL="kvm"))
    assert code == 1 and not checks["accelerator"].ok
    assert checks["accelerator"].detail.startswith("kvm was requested but /dev/kvm")
    assert checks["accelerator"].fix is not None and "CAPSA_ACCEL=auto" in checks["accelerator"].fix


def test_doctor_reaches_the_store_and_says_why_not(workdir: Path, s3_server: S3Server) -> None:
    store = workdir / "store"
    code, checks = _doctor_json("--state-dir", str(workdir / "state"),
                                env=_env(CAPSA_STORE_URL=store.as_uri()))
    assert code == 0 and checks["store"].detail == f"{store.as_uri()}: directory {store} is writable"
    assert os.listdir(store) == []  # the probe file is gone
    bucket = "doctor" + os.urandom(4).hex()
    server_env = {**s3_server.env(), "CAPSA_STORE_S3_ENDPOINT": s3_server.endpoint}
    s3_server.make_bucket(bucket)
    code, checks = _doctor_json("--state-dir", str(workdir / "state"),
                                env=_env(CAPSA_STORE_URL=f"s3://{bucket}/fleet", **server_env))
    assert code == 0 and checks["store"].detail.endswith(f"bucket {bucket} answered HEAD"), checks["store"]
    code, checks = _doctor_json("--state-dir", str(workdir / "state"),
                                env=_env(CAPSA_STORE_URL=f"s3://{bucket}-missing/fleet", **server_env))
    assert code == 1 and not checks["store"].ok
    assert f"bucket {bucket}-missing" in checks["store"].detail and "404" in checks["store"].detail


def _config(state: Path, **storage: object) -> DoctorConfig:
    return DoctorConfig(Settings(state_dir=state, accel="tcg"), storage=StorageSettings(**storage))


async def test_each_check_fails_with_its_fix_when_its_part_is_missing(
        workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = workdir / "state"
    # Free space: a floor larger than the disk.
    low = await paths.disk_space(_config(state, min_free_mib=1 << 30))
    assert not low.ok and "CAPSA_STORAGE_MIN_FREE_MIB=1073741824" in low.detail and low.fix
    # A configured pool directory that cannot reflink (the test host's /tmp is ext4).
    plain = workdir / "plain"
    plain.mkdir()
    no_cow = await host.btrfs(_config(state, path=plain))
    assert not no_cow.ok and "cannot reflink" in no_cow.detail and "CAPSA_STORAGE_PATH" in (no_cow.fix or "")
    assert os.listdir(plain) == []
    # The control plane: nothing listens on port 9 of this host.
    down = await remote.control_plane(DoctorConfig(Settings(state_dir=state), control_url="http://127.0.0.1:9"))
    assert not down.ok and down.detail.startswith("http://127.0.0.1:9/v1/health unreachable")
    # A QEMU older than needed, and a cgroup controller the node would need.
    monkeypatch.setattr(host, "MIN_QEMU", (99, 0))
    old = await host.qemu(_config(state))
    assert not old.ok and "capsa needs 99.0 or newer" in old.detail
    monkeypatch.setattr(host, "REQUIRED_CGROUP_CONTROLLERS", ("capsa-test-controller",))
    cg = await host.cgroups(_config(state))
    assert not cg.ok and "controllers capsa-test-controller missing" in cg.detail


async def test_the_node_run_stops_at_the_first_failure(workdir: Path) -> None:
    locked = workdir / "locked"
    locked.mkdir(mode=0o700)
    cfg = DoctorConfig(Settings(state_dir=locked / "state", accel="tcg"), control_url="http://127.0.0.1:9")
    every = await run_checks(cfg)
    assert [c.name for c in every] == [name for name, _ in CHECKS] == NAMES
    assert [c.name for c in every if not c.ok] == ["state_dir", "control_plane"]
    stopped = await run_checks(cfg, stop_at_failure=True)
    assert [c.name for c in stopped] == NAMES[:NAMES.index("state_dir") + 1]
    assert first_failure(stopped) == first_failure(every) == every[NAMES.index("state_dir")]


def test_capsa_node_refuses_at_the_first_failing_check_leaving_nothing(workdir: Path) -> None:
    locked = workdir / "locked"
    locked.mkdir(mode=0o700)
    state = locked / "state"
    done = _capsa("node", "--control-url", "http://127.0.0.1:9", "--enrol-token", "unused",
                  "--state-dir", str(state), "--listen", "127.0.0.1:0", "--accel", "tcg")
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"error: capsa node: host check state_dir failed: {locked} (mode 0700")
    assert f"fix: chmod o+x {locked}" in errors[0]
    assert done.stdout == "" and os.listdir(locked) == []
    # With the state dir fixed, the next failing check is the unreachable control plane.
    locked.chmod(0o711)
    done = _capsa("node", "--control-url", "http://127.0.0.1:9", "--enrol-token", "unused",
                  "--state-dir", str(state), "--listen", "127.0.0.1:0", "--accel", "tcg")
    assert done.returncode == 1
    assert "error: capsa node: host check control_plane failed: http://127.0.0.1:9/v1/health unreachable" \
        in done.stderr
    assert os.listdir(locked) == []
