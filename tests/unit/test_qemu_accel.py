"""Accelerator parsing, the probe-result cache, and the host facts the command line depends on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capsa.node.runtime.accel import AccelCache, parse_accel
from capsa.node.runtime.base import Accelerator
from capsa.node.runtime.hostinfo import qemu_version, tsc_khz
from capsa.node.runtime.qemu.kvm import kvm_access_error, kvm_groups
from capsa.node.runtime.workdir import VM_UID_BASE
from tests.support.kvm_node import kvm_node_copy
from tests.support.vm import searchable_dir


def test_parse_accel() -> None:
    assert parse_accel("auto") is Accelerator.AUTO
    assert parse_accel("KVM") is Accelerator.KVM
    assert parse_accel(Accelerator.TCG) is Accelerator.TCG
    with pytest.raises(ValueError, match="unknown accelerator 'hvf'"):
        parse_accel("hvf")


def test_cache_survives_a_new_process(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "accel.json"
    cache = AccelCache(path)
    cache.put("k1", Accelerator.TCG, "kvm probe boot failed")
    cache.forget()  # what a fresh process sees: nothing in memory, the file on disk
    again = AccelCache(path).get("k1")
    assert again is not None and again.accel is Accelerator.TCG and "probe" in again.reason
    assert AccelCache(path).get("other-key") is None
    assert json.loads(path.read_text())["k1"]["accel"] == "tcg"
    assert [p.name for p in path.parent.iterdir()] == ["accel.json"]  # no temp files left


def test_cache_ignores_garbage(tmp_path: Path) -> None:
    path = tmp_path / "accel.json"
    AccelCache.forget(AccelCache(None))
    path.write_text("{not json")
    assert AccelCache(path).get("k") is None
    path.write_text(json.dumps({"k": {"accel": "auto", "reason": "x", "decided_at": 1}}))
    assert AccelCache(path).get("k") is None
    path.write_text(json.dumps({"k": {"accel": "quantum"}}))
    assert AccelCache(path).get("k") is None
    AccelCache(path).put("k", Accelerator.KVM, "ok")  # overwrites the garbage
    AccelCache.forget(AccelCache(None))
    decision = AccelCache(path).get("k")
    assert decision is not None and decision.accel is Accelerator.KVM


def test_tsc_khz_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu MHz\t\t: 2299.998\nflags\t\t: tsc\n")
    assert tsc_khz(cpuinfo) == 2299998
    cpuinfo.write_text("processor\t: 0\n")
    assert tsc_khz(cpuinfo) is None
    assert tsc_khz(tmp_path / "missing") is None
    real = tsc_khz()
    assert real is None or real > 100_000


@pytest.mark.root
async def test_kvm_access_is_checked_by_opening_the_device_as_the_vm_user() -> None:
    vm = (VM_UID_BASE, VM_UID_BASE)
    with searchable_dir("kvmacc-") as tmp:
        assert (await kvm_access_error(vm, device=tmp / "missing") or "").endswith("does not exist")
        (tmp / "file").write_text("")
        assert "is not a character device" in (await kvm_access_error(vm, device=tmp / "file") or "")
        root_only = kvm_node_copy(tmp, 0o600, name="root-only")
        assert kvm_groups(root_only) == ()
        assert await kvm_access_error(vm, device=root_only) == (
            f"{root_only} (mode 0600, owner 0:0) is not accessible to the VM user {VM_UID_BASE} "
            "(groups: none): Permission denied")
        assert await kvm_access_error(None, device=root_only) is None  # this process is root
        grouped = kvm_node_copy(tmp, 0o660, gid=4321, name="grouped")
        assert kvm_groups(grouped) == (4321,)
        assert await kvm_access_error(vm, (4321,), grouped) is None
        assert "(groups: none): Permission denied" in (await kvm_access_error(vm, (), grouped) or "")
        everyone = kvm_node_copy(tmp, 0o666, name="everyone")
        assert await kvm_access_error(vm, device=everyone) is None
        read_only = kvm_node_copy(tmp, 0o664, gid=4321, name="read-only")
        assert await kvm_access_error(vm, device=read_only) is not None  # QEMU needs read-write


def test_qemu_version_is_read_from_the_binary() -> None:
    assert qemu_version()[0].isdigit()
