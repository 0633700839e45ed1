"""A boot cancelled while it waits for the guest daemon (a pool refill stopped mid-restore, a client that
went away) leaves no VM behind and no background task failing later with an exception nobody collects."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import QemuRuntime

pytestmark = pytest.mark.vm


async def test_cancelled_boot_leaves_nothing_and_no_stray_task_errors(guest_image: GuestImage) -> None:
    state = Path(tempfile.mkdtemp(prefix="capsa-cancel-", dir="/tmp"))
    os.chmod(state, 0o755)  # QEMU runs as another uid
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    runtime = QemuRuntime(Settings(state_dir=state), accel="tcg", accel_cache=False)
    try:
        boot = asyncio.create_task(runtime.boot(VMSpec(image=guest_image)))
        vms = state / "vms"
        # Cancel once QEMU is up and the runtime is waiting for the guest daemon to answer.
        for _ in range(600):
            if vms.exists() and any((d / "run").exists() for d in vms.iterdir()):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        boot.cancel()
        with pytest.raises(asyncio.CancelledError):
            await boot
        for _ in range(20):  # let every callback of the torn-down channel run, then collect garbage
            await asyncio.sleep(0.05)
        gc.collect()
        await asyncio.sleep(0.1)
        assert not vms.exists() or not any(vms.iterdir()), "the cancelled boot left a VM directory"
        assert runtime.list() == []
        assert unhandled == [], [c.get("message") for c in unhandled]
    finally:
        loop.set_exception_handler(previous)
        await runtime.close()
        shutil.rmtree(state, ignore_errors=True)
