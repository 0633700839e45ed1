"""Commands' address-space layout in a real microVM: with ``CAPSA_COMMAND_ASLR=auto`` a VM under TCG
runs its commands with a fixed layout (QEMU's translated code is found again at the same addresses, see
capsa.guest.layout) and a VM under KVM randomizes; ``on`` randomizes under TCG too. The daemon itself
keeps its randomized layout either way."""

from __future__ import annotations

import shutil

import pytest

from capsa.common.image import GuestImage
from capsa.guest.layout import ADDR_NO_RANDOMIZE
from capsa.node.runtime.base import Accelerator, VMSpec
from capsa.node.runtime.qemu import QemuRuntime, QemuSandbox

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

_LAYOUT = ("cat /proc/self/personality; grep -m1 -E '/libc[.-]' /proc/self/maps | cut -d- -f1; "
           "cat /proc/{daemon}/task/*/personality | sort -u")


async def _layouts(sandbox: QemuSandbox, n: int = 3) -> tuple[set[bool], set[str], set[bool]]:
    flags, starts, daemon = set(), set(), set()
    pid = (await sandbox.guest.health())["pid"]
    for _ in range(n):
        r = await sandbox.guest.exec(_LAYOUT.format(daemon=pid), timeout=60)
        assert r.exit_code == 0, r
        mine, libc, *threads = r.stdout.decode().split()
        flags.add(bool(int(mine, 16) & ADDR_NO_RANDOMIZE))
        starts.add(libc)
        daemon.update(bool(int(t, 16) & ADDR_NO_RANDOMIZE) for t in threads)
    return flags, starts, daemon


async def test_auto_fixes_the_layout_only_under_tcg(sandbox: QemuSandbox, runtime: QemuRuntime) -> None:
    assert runtime.settings.command_aslr == "auto"
    flags, starts, daemon = await _layouts(sandbox)
    assert daemon == {False}
    if sandbox.accelerator is Accelerator.TCG:
        assert flags == {True} and len(starts) == 1
    else:
        assert flags == {False} and len(starts) > 1


async def test_on_randomizes_under_tcg_too(runtime: QemuRuntime, guest_image: GuestImage) -> None:
    saved = runtime.settings
    runtime.settings = saved.model_copy(update={"command_aslr": "on"})
    try:
        sb = await runtime.boot(VMSpec(image=guest_image, memory_mib=256))
    finally:
        runtime.settings = saved
    try:
        flags, starts, daemon = await _layouts(sb)
        assert flags == {False} and len(starts) > 1 and daemon == {False}
    finally:
        await runtime.destroy(sb)
