"""The one way a QEMU microvm is started, for a cold boot, a restore and the KVM probe alike.

:func:`launch` takes a VM directory and files already laid out by the storage strategy, opens the tap (if
any), starts QEMU, connects QMP, loads the snapshot state for a restore, waits for the guest daemon, gives a
restored guest fresh entropy and the clock, sets up the guest NIC, and returns a watched
:class:`QemuSandbox`. On any failure it kills QEMU and removes the VM directory before raising.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import ChannelClosed, GuestError
from capsa.node.guestlink.identity import refresh_guest
from capsa.node.runtime.base import Accelerator, BootError, GuestImage, TapNetwork, VMSpec
from capsa.node.runtime.hostinfo import tsc_khz
from capsa.node.runtime.qemu.agent_socket import WrongPeer, connect_agent
from capsa.node.runtime.qemu.cmdline import QemuConfig, build_argv, tcg_cache_mib
from capsa.node.runtime.qemu.network import configure_guest_network, open_tap
from capsa.node.runtime.qemu.process import BACKGROUND_NICE, QemuProcess, QemuProcessError
from capsa.node.runtime.qemu.sandbox import QemuSandbox
from capsa.node.runtime.qemu.storage import VmFiles
from capsa.node.runtime.snapshot.manifest import SnapshotError
from capsa.node.runtime.workdir import VmDir
from capsa.node.storage.disks import DiskError

__all__ = ["LaunchError", "LaunchRequest", "abort_launch", "check_image", "launch"]

_log = logging.getLogger(__name__)

_LAUNCH_FAILURES = (ValueError, DiskError, QemuProcessError, TimeoutError, OSError, GuestError)


class LaunchError(BootError):
    """QEMU was started and the VM did not come up (QEMU exited, or the guest did not answer in time)."""


@dataclass(frozen=True)
class LaunchRequest:
    """One QEMU to start: who it is, how long it may take, and the files it runs from."""

    sandbox_id: str
    spec: VMSpec
    binary: str
    accel: Accelerator
    vmdir: VmDir
    files: VmFiles
    within: float
    """Seconds from the start of the launch until the guest daemon must answer."""
    owner: tuple[int, int] | None
    """The VM user (uid, gid); None: QEMU runs as this process's user."""
    groups: tuple[int, ...] = ()
    console_limit: int = 1024 * 1024
    parent: str | None = None
    """The snapshot this VM is restored from."""
    refresh: bool = True
    """After a restore: reseed the guest RNG and set its clock (False only in tests)."""
    command_aslr: bool | None = None
    """Whether the guest randomizes its commands' address-space layout (None: the guest's default, on)."""


def check_image(image: GuestImage) -> None:
    if not all(hasattr(image, name) for name in ("kernel", "initrd", "rootfs")):
        raise BootError(f"not a guest image: {image!r}")
    for label, path in (("kernel", image.kernel), ("initrd", image.initrd), ("rootfs", image.rootfs)):
        if not path.is_file():
            raise BootError(f"image {label} {path} does not exist")


async def launch(req: LaunchRequest, *, started: float) -> QemuSandbox:
    """Start QEMU on ``req.files`` (``started``: the loop time the whole boot or restore began)."""
    loop = asyncio.get_running_loop()
    deadline = started + req.within
    spec, sid, vmdir, restore = req.spec, req.sandbox_id, req.vmdir, req.files.restore
    process: QemuProcess | None = None
    client: GuestClient | None = None
    tap_fd: int | None = None
    network = cast(TapNetwork, spec.network) if spec.network is not None else None
    try:
        if network is not None:
            tap_fd = await asyncio.to_thread(open_tap, network)
        config = QemuConfig(
            binary=req.binary, accel=req.accel, kernel=_shared_file(spec.image.kernel, vmdir, req.owner),
            initrd=_shared_file(spec.image.initrd, vmdir, req.owner), disk=req.files.disk,
            qmp_socket=vmdir.qmp_socket, agent_socket=vmdir.agent_socket, memory_mib=spec.memory_mib,
            vcpus=spec.vcpus, tsc_khz=tsc_khz(), kernel_args=spec.kernel_args, name=sid,
            extra_args=req.files.qemu_args, tap_fd=tap_fd, mac=network.mac if network is not None else None,
            tcg_tb_mib=tcg_cache_mib(spec.memory_mib),
        )
        process = QemuProcess(build_argv(config), vmdir, user=req.owner, extra_groups=req.groups,
                              console_limit=req.console_limit,
                              pass_fds=(*req.files.fds, *((tap_fd,) if tap_fd is not None else ())),
                              nice=BACKGROUND_NICE if spec.background else 0)
        t_files = loop.time()
        await process.start()
        if tap_fd is not None:
            os.close(tap_fd)  # QEMU holds its own copy now
            tap_fd = None
        monitor = await process.connect_qmp(max(1.0, deadline - loop.time()))
        t_qmp = loop.time()
        if restore is not None:
            async with asyncio.timeout(max(1.0, deadline - loop.time())):
                await restore.load(monitor, time_limit=max(1.0, deadline - loop.time()))
        client = await connect_guest(process, vmdir, deadline)
        _log.debug("launch phases of %s: files %.2fs, qemu to QMP %.2fs, QMP to guest ready %.2fs", sid,
                   t_files - started, t_qmp - t_files, loop.time() - t_qmp)
        setup = []
        if restore is not None and req.refresh:
            setup.append(refresh_guest(client))
        if req.command_aslr is not None:
            setup.append(set_command_aslr(client, req.command_aslr))
        await asyncio.gather(*setup)  # independent calls: one round trip
        if network is not None:
            # A restored NIC keeps the snapshot's MAC and device state; only its backend (the tap) is new,
            # so the guest's address and route are set again for this tap's subnet.
            await configure_guest_network(client, network)
        sandbox = QemuSandbox(sid, spec, vmdir, req.files, process, client, req.accel,
                              vm_uid=req.owner[0] if req.owner else None, boot_seconds=loop.time() - started,
                              parent=req.parent)
    except BaseException as exc:
        if tap_fd is not None:
            os.close(tap_fd)
        detail = await abort_launch(process, client, vmdir)
        if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit, SnapshotError, BootError)):
            raise
        if restore is not None or isinstance(exc, _LAUNCH_FAILURES):
            what = "restore" if restore is not None else "boot"
            raise LaunchError(f"{what} of {sid} ({req.accel.value}) failed: {exc}{detail}",
                              sandbox_id=sid) from exc
        raise
    sandbox.start_watching()
    _log.info("sandbox %s %s in %.2fs (accel %s, pid %s, cow disk %s)", sid,
              "restored" if restore is not None else "booted", sandbox.boot_seconds, req.accel.value,
              process.pid, req.files.disk_cow)
    return sandbox


async def set_command_aslr(client: GuestClient, enabled: bool) -> None:
    """Tell the guest whether its commands get a randomized layout; a guest from before the ``set_aslr``
    operation (restored from an old snapshot) keeps randomizing."""
    try:
        await client.set_aslr(enabled)
    except GuestError as exc:
        if exc.code != "unknown_op":
            raise
        _log.info("guest has no set_aslr operation; its commands keep a randomized layout")


async def abort_launch(process: QemuProcess | None, client: GuestClient | None, vmdir: VmDir) -> str:
    """Undo a launch that failed midway: close the guest channel, kill QEMU and delete the VM directory.
    Returns the tail of the guest console, for the error message."""
    if client is not None:
        with contextlib.suppress(Exception):
            await client.close()
    detail = ""
    if process is not None:
        await process.kill()
        console = process.console_tail(1500).strip()
        detail = f"\n--- guest console (tail) ---\n{console}" if console else ""
    await asyncio.to_thread(vmdir.remove)
    return detail


async def connect_guest(process: QemuProcess, vmdir: VmDir, deadline: float) -> GuestClient:
    """Connect to the agent socket and wait until the guest daemon answers ``health``, while watching
    QEMU: if it exits, the launch fails at once instead of at the deadline."""
    loop = asyncio.get_running_loop()
    exited = asyncio.ensure_future(process.wait())
    probe: asyncio.Future[dict[str, object]] | None = None
    try:
        while True:
            remaining = deadline - loop.time()
            if exited.done():
                raise QemuProcessError(process.exit_description())
            if remaining <= 0:
                raise TimeoutError("the guest daemon did not answer before the boot deadline")
            try:
                client = await connect_agent(vmdir.agent_socket, pid=process.pid,
                                             uid=process.user[0] if process.user else None)
            except WrongPeer:
                raise
            except OSError:
                await asyncio.sleep(0.05)
                continue
            # Bytes written before the guest opens its port can be lost, so health is retried.
            ready = probe = asyncio.ensure_future(client.wait_ready(timeout=remaining, interval=1.0))
            done, _ = await asyncio.wait({ready, exited}, timeout=remaining,
                                         return_when=asyncio.FIRST_COMPLETED)
            if ready in done and ready.exception() is None:
                return client
            ready.cancel()
            with contextlib.suppress(BaseException):
                await ready
            with contextlib.suppress(Exception):
                await client.close()
            if ready in done:
                exc = ready.exception()
                if not isinstance(exc, ChannelClosed):
                    assert exc is not None
                    raise exc
            await asyncio.sleep(0.05)
    finally:
        # Cancelled from outside (e.g. a pool refill stopped mid-restore): collect the pending
        # health probe too, or it dies later with an exception nobody retrieves.
        for pending in (probe, exited):
            if pending is None:
                continue
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            elif not pending.cancelled():
                pending.exception()


def _shared_file(src: Path, vmdir: VmDir, owner: tuple[int, int] | None) -> Path:
    """``src`` if the VM user can read it where it is, else a copy inside the VM directory."""
    if owner is None or _world_readable(src):
        return src
    dst = vmdir.root / src.name
    shutil.copyfile(src, dst)
    os.chown(dst, owner[0], owner[1])
    os.chmod(dst, 0o400)
    return dst


def _world_readable(path: Path) -> bool:
    try:
        if not path.stat().st_mode & stat.S_IROTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.resolve().parents)
    except OSError:
        return False
