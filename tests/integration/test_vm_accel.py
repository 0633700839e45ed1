"""``auto`` settles the accelerator by a real KVM probe boot and remembers it per host.

QEMU runs as root here (drop_privileges=False) so that it can open /dev/kvm, which is root-only on these
hosts: that is what makes the probe actually boot the image with -accel kvm. On PVM hosts the guest hangs
under KVM, the probe times out and the runtime falls back to TCG; on hardware-KVM hosts it keeps KVM.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.runtime.accel import AccelCache
from capsa.node.runtime.base import Accelerator, VMSpec
from capsa.node.runtime.qemu import QemuRuntime

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.skipif(not Path("/dev/kvm").exists(), reason="no /dev/kvm: there is nothing to probe"),
]


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cva-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_probe_boot_decides_and_is_cached(base: Path, guest_image: GuestImage) -> None:
    settings = Settings(state_dir=base / "state", cache_dir=base / "cache")
    AccelCache(None).forget()
    rt = QemuRuntime(settings, accel="auto", drop_privileges=False, kvm_probe_timeout=8)
    try:
        sandbox = await rt.boot(VMSpec(image=guest_image))
        decision = rt.accel_decision
        assert decision is not None and sandbox.accelerator is decision.accel
        if decision.accel is Accelerator.TCG:
            assert decision.reason.startswith("kvm probe boot failed"), decision.reason
        else:
            assert decision.reason.startswith("kvm probe boot answered")
        result = await sandbox.guest.exec(["uname", "-r"])
        assert result.stdout.decode().strip() == guest_image.kernel_release
        await rt.destroy(sandbox)
    finally:
        await rt.close()
    cached = json.loads((base / "cache" / "accel.json").read_text())
    assert [v["accel"] for v in cached.values()] == [decision.accel.value]
    assert list((base / "state" / "vms").iterdir()) == []

    # A new process (simulated by clearing the in-memory cache) reuses the decision: no second probe.
    AccelCache(None).forget()
    again = QemuRuntime(settings, accel="auto", drop_privileges=False)
    try:
        second = await again.boot(VMSpec(image=guest_image))
        assert again.accel_decision is not None
        assert again.accel_decision.decided_at == decision.decided_at
        assert second.accelerator is decision.accel
    finally:
        await again.close()
    assert list((base / "state" / "vms").iterdir()) == []
