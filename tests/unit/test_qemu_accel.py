"""Accelerator parsing, the probe-result cache, and the host facts the command line depends on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from capsa.node.runtime.accel import AccelCache, parse_accel
from capsa.node.runtime.base import Accelerator
from capsa.node.runtime.hostinfo import kvm_device_status, qemu_version, tsc_khz


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


def test_kvm_device_status(tmp_path: Path) -> None:
    dev = tmp_path / "kvm"
    assert "does not exist" in (kvm_device_status(1234, device=dev) or "")
    dev.write_text("")
    os.chown(dev, 0, 4321)
    os.chmod(dev, 0o600)
    assert "not accessible" in (kvm_device_status(1234, (4321,), device=dev) or "")
    os.chmod(dev, 0o660)
    assert kvm_device_status(1234, (4321,), device=dev) is None
    assert kvm_device_status(1234, (), device=dev) is not None
    assert kvm_device_status(0, (), device=dev) is None


def test_qemu_version_is_read_from_the_binary() -> None:
    assert qemu_version()[0].isdigit()
