"""QemuRuntime failure paths with a real QEMU but no guest image: nothing may be left behind."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.guestlink.errors import GuestError
from capsa.node.runtime.accel import AccelCache
from capsa.node.runtime.base import Accelerator, BootError, VMSpec
from capsa.node.runtime.qemu import QemuRuntime
from capsa.node.runtime.qemu.cmdline import SANDBOX_OPTIONS
from capsa.node.runtime.qemu.kvm import KVM_DEVICE
from capsa.node.runtime.qemu.launch import set_command_aslr
from capsa.node.runtime.qemu.process import QemuProcess
from capsa.node.runtime.workdir import VM_UID_BASE, VmDir, find_qemu_pids
from tests.support.kvm_node import kvm_node_copy

pytestmark = pytest.mark.root


@pytest.fixture
def base() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cr-") as tmp:
        os.chmod(tmp, 0o711)
        yield Path(tmp)


@pytest.fixture
def bogus_image(base: Path) -> GuestImage:
    """Files in the right places with the wrong content: QEMU starts, then fails to load the kernel."""
    img = base / "img"
    img.mkdir()
    (img / "vmlinux").write_bytes(b"not a kernel" * 100)
    (img / "initrd.cpio.gz").write_bytes(b"not an initrd")
    with open(img / "rootfs.ext4", "wb") as fh:
        fh.truncate(8 * 1024 * 1024)
    for p in img.iterdir():
        p.chmod(0o644)
    return GuestImage(kernel=img / "vmlinux", initrd=img / "initrd.cpio.gz", rootfs=img / "rootfs.ext4",
                      digest="0" * 64, kernel_release="none")


def _runtime(base: Path, accel: str = "tcg", kvm_device: Path = KVM_DEVICE) -> QemuRuntime:
    settings = Settings(state_dir=base / "state", cache_dir=base / "cache")
    return QemuRuntime(settings, accel=accel, accel_cache=False, kvm_device=kvm_device)


def _leftovers(base: Path) -> list[str]:
    vms = base / "state" / "vms"
    files = [str(p) for p in vms.rglob("*")] if vms.exists() else []
    return files + [f"pid {pid}" for pid in find_qemu_pids(base)]


async def test_boot_failure_reports_qemu_error_and_cleans_up(base: Path, bogus_image: GuestImage) -> None:
    rt = _runtime(base)
    with pytest.raises(BootError) as info:
        await rt.boot(VMSpec(image=bogus_image), sandbox_id="sbx_bogus")
    assert "qemu exited with code 1" in str(info.value)
    assert info.value.extra["sandbox_id"] == "sbx_bogus"
    assert _leftovers(base) == []
    assert rt.list() == []


async def test_bad_requests_are_refused_without_side_effects(base: Path, bogus_image: GuestImage) -> None:
    rt = _runtime(base)
    with pytest.raises(BootError, match=r"spec\.network must describe a tap"):
        await rt.boot(VMSpec(image=bogus_image, network=object()))
    with pytest.raises(BootError, match="invalid sandbox id"):
        await rt.boot(VMSpec(image=bogus_image), sandbox_id="../../etc")
    with pytest.raises(BootError, match="memory_mib"):
        await rt.boot(VMSpec(image=bogus_image, memory_mib=1))
    missing = GuestImage(kernel=base / "nope", initrd=bogus_image.initrd, rootfs=bogus_image.rootfs,
                         digest="x", kernel_release="x")
    with pytest.raises(BootError, match=r"kernel .* does not exist"):
        await rt.boot(VMSpec(image=missing))
    with pytest.raises(BootError, match="smaller than the image"):
        await rt.boot(VMSpec(image=bogus_image, disk_size_mib=1))
    deep = base / ("d" * 90)
    deep.mkdir()
    deep.chmod(0o711)
    deep_rt = QemuRuntime(Settings(state_dir=deep, cache_dir=base / "cache"), accel="tcg", accel_cache=False)
    with pytest.raises(BootError, match="too deep"):
        await deep_rt.boot(VMSpec(image=bogus_image))
    assert _leftovers(base) == []
    with pytest.raises(ValueError, match="unknown accelerator"):
        _runtime(base, accel="warp")


async def test_private_state_dir_is_reported(base: Path, bogus_image: GuestImage) -> None:
    locked = base / "locked"
    locked.mkdir(mode=0o700)
    rt = QemuRuntime(Settings(state_dir=locked / "state", cache_dir=base / "cache"), accel="tcg",
                     accel_cache=False)
    with pytest.raises(BootError, match="not searchable by others"):
        await rt.boot(VMSpec(image=bogus_image))


async def test_explicit_kvm_without_access_fails_cleanly(base: Path, bogus_image: GuestImage) -> None:
    # The VM user cannot open this device by construction (root-only), whatever /dev/kvm's mode is here.
    device = kvm_node_copy(base, 0o600)
    rt = _runtime(base, accel="kvm", kvm_device=device)
    with pytest.raises(BootError, match=r"kvm was requested but .* not accessible") as info:
        await rt.boot(VMSpec(image=bogus_image))
    assert info.value.code == "kvm_unavailable"
    assert f"{device} (mode 0600, owner 0:0) is not accessible to the VM user {VM_UID_BASE} (groups: none)" \
        in str(info.value)
    assert _leftovers(base) == []


async def test_explicit_kvm_that_cannot_boot_is_refused(base: Path, bogus_image: GuestImage) -> None:
    # The VM user can open this device; no guest boots from the bogus image, under any kvm or none.
    device = kvm_node_copy(base, 0o666)
    rt = _runtime(base, accel="kvm", kvm_device=device)
    with pytest.raises(BootError, match=r"kvm was requested but the guest did not boot under kvm") as info:
        await rt.boot(VMSpec(image=bogus_image), sandbox_id="sbx_nokvm")
    assert info.value.code == "kvm_boot_failed"
    assert f"{device} (mode 0666, owner 0:0)" in str(info.value)
    assert "boot of sbx_nokvm (kvm) failed: qemu exited" in str(info.value)  # QEMU's own reason follows
    assert info.value.extra["sandbox_id"] == "sbx_nokvm"
    assert _leftovers(base) == []


async def test_auto_without_kvm_access_decides_tcg_and_says_why(base: Path, bogus_image: GuestImage) -> None:
    rt = _runtime(base, accel="auto", kvm_device=kvm_node_copy(base, 0o600))
    assert rt.accelerator is None  # not settled before the first boot
    with pytest.raises(BootError, match=r"\(tcg\) failed"):
        await rt.boot(VMSpec(image=bogus_image))  # the image is bogus; the decision is still made
    assert rt.accel_decision is not None
    assert rt.accel_decision.accel is Accelerator.TCG
    assert rt.accel_decision.reason.startswith("kvm unusable: ")
    assert "not accessible to the VM user" in rt.accel_decision.reason
    assert rt.accelerator is Accelerator.TCG
    assert _leftovers(base) == []


async def test_settle_accelerator_decides_as_a_boot_would_and_keeps_no_vm(base: Path,
                                                                          bogus_image: GuestImage) -> None:
    """What ``capsa doctor`` reports: the runtime's own decision, without a VM left running."""
    decided = await _runtime(base).settle_accelerator(None)
    assert decided is not None and (decided.accel, decided.reason) == (Accelerator.TCG, "requested")
    closed = kvm_node_copy(base, 0o600)
    rt = _runtime(base, accel="auto", kvm_device=closed)
    decided = await rt.settle_accelerator(VMSpec(image=bogus_image))
    assert decided is not None and decided.accel is Accelerator.TCG
    assert decided.reason.startswith(f"kvm unusable: {closed} (mode 0600, owner 0:0) is not accessible")
    with pytest.raises(BootError) as info:  # kvm forced: refused as a boot would be, image or not
        await _runtime(base, accel="kvm", kvm_device=closed).settle_accelerator(None)
    assert info.value.code == "kvm_unavailable"
    # The device opens and there is no image to probe-boot: only a first boot can tell.
    opens = kvm_node_copy(base, 0o666, name="kvm-open")
    assert await _runtime(base, accel="auto", kvm_device=opens).settle_accelerator(None) is None
    assert _leftovers(base) == []


async def test_a_settled_probe_is_cached_for_the_next_runtime(base: Path, bogus_image: GuestImage) -> None:
    cache = base / "cache" / "accel.json"
    settings = Settings(state_dir=base / "state", cache_dir=base / "cache")
    device = kvm_node_copy(base, 0o666)  # the VM user may open it: a probe boot is what decides
    rt = QemuRuntime(settings, accel="auto", accel_cache=cache, kvm_device=device)
    # The probe under kvm fails (the bogus image boots under no kvm, and QEMU opens the host's /dev/kvm),
    # then the boot under the TCG fallback fails too, for the image's sake: the decision stands.
    with pytest.raises(BootError, match=r"\(tcg\) failed"):
        await rt.settle_accelerator(VMSpec(image=bogus_image))
    [entry] = json.loads(cache.read_text()).values()
    assert entry["accel"] == "tcg" and entry["reason"].startswith("kvm probe boot failed")
    AccelCache(cache).forget()  # the next process knows only the file
    again = QemuRuntime(settings, accel="auto", accel_cache=cache, kvm_device=device)
    decided = await again.settle_accelerator(VMSpec(image=bogus_image))
    assert decided is not None and decided.accel is Accelerator.TCG and decided.reason == entry["reason"]
    assert _leftovers(base) == []


async def test_cleanup_orphans_kills_strays_and_removes_stale_dirs(base: Path) -> None:
    vms = base / "state" / "vms"
    # A previous node's VM: a live QEMU with its pidfile, plus a stale folder whose QEMU is long gone.
    orphan = VmDir(vms / "sbx_orphan")
    orphan.create(None)
    stray = QemuProcess([
        "qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-m", "32M", "-nodefaults",
        "-display", "none", "-sandbox", SANDBOX_OPTIONS, "-chardev", "stdio,id=c,signal=off",
        "-serial", "chardev:c", "-qmp", f"unix:{orphan.qmp_socket},server=on,wait=off",
    ], orphan)
    await stray.start()
    await stray.connect_qmp(20)
    await stray.close()
    stale = VmDir(vms / "sbx_stale")
    stale.create(None)
    stale.pidfile.write_text("999999 12345\n")
    (vms / "sbx_stale" / "disk.img").write_bytes(b"x" * 4096)

    rt = _runtime(base)
    waiter = asyncio.create_task(stray.wait())  # we are its parent here, so we reap it
    removed = await rt.cleanup_orphans()
    assert await asyncio.wait_for(waiter, 20) < 0
    assert any("killed qemu pid" in r for r in removed)
    assert any("sbx_stale" in r for r in removed)
    assert list(vms.iterdir()) == []
    assert find_qemu_pids(vms) == []
    assert await rt.cleanup_orphans() == []


@pytest.mark.parametrize(("mode", "tcg", "kvm"), [("auto", False, True), ("on", True, True),
                                                  ("off", False, False)])
def test_command_aslr_follows_the_setting_and_the_accelerator(base: Path, mode: str, tcg: bool,
                                                              kvm: bool) -> None:
    rt = QemuRuntime(Settings(state_dir=base, command_aslr=mode), accel="tcg")  # type: ignore[arg-type]
    assert (rt.command_aslr(Accelerator.TCG), rt.command_aslr(Accelerator.KVM)) == (tcg, kvm)


def test_command_aslr_refuses_unknown_modes(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSA_COMMAND_ASLR", "sometimes")
    with pytest.raises(ValueError, match="command_aslr"):
        Settings(state_dir=base)


class _OldGuest:
    def __init__(self, code: str) -> None:
        self.code = code
        self.calls: list[bool] = []

    async def set_aslr(self, enabled: bool) -> None:
        self.calls.append(enabled)
        raise GuestError(self.code, f"{self.code}: set_aslr")


async def test_a_guest_without_set_aslr_keeps_randomizing_other_errors_fail_the_launch() -> None:
    old = _OldGuest("unknown_op")
    await set_command_aslr(old, False)  # type: ignore[arg-type]
    assert old.calls == [False]
    with pytest.raises(GuestError):
        await set_command_aslr(_OldGuest("internal_error"), False)  # type: ignore[arg-type]
