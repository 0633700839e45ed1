"""The QEMU microvm driver: boots a VM per sandbox, watches it, and tears it down leaving nothing behind.

What QEMU runs with (least privilege): its own uid from a private range (never root when the node is
root), no supplementary groups except the group owning /dev/kvm when KVM is used, a seccomp filter
(``-sandbox on,...``: no set*id, fork/exec, obsolete or scheduler syscalls), its own process group, no
default devices, no display, no network device unless asked for, one private copy of the root disk, and a
working directory only it and the node can enter. The node keeps the pidfile and console log in a folder
QEMU cannot write to.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import inspect
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from capsa.common.ids import new_id
from capsa.common.settings import Settings
from capsa.node.guest_client import ChannelClosed, GuestClient, GuestError
from capsa.node.runtime.accel import AccelCache, AccelDecision, parse_accel
from capsa.node.runtime.base import Accelerator, BootError, RuntimeError_, SandboxFailed, SandboxState, VMSpec
from capsa.node.runtime.hostinfo import (
    HostInfoError,
    host_kernel_release,
    kvm_device_status,
    qemu_binary,
    qemu_version,
    tsc_khz,
)
from capsa.node.runtime.qemu_cmdline import QemuConfig, build_argv
from capsa.node.runtime.qemu_process import QemuProcess, QemuProcessError
from capsa.node.runtime.workdir import (
    VM_UID_BASE,
    VmDir,
    find_qemu_pids,
    kill_and_wait,
    pick_vm_uid,
    read_pidfile,
)
from capsa.node.storage.disks import DiskError, private_disk

if TYPE_CHECKING:
    from capsa.node.runtime.base import GuestImage

__all__ = ["QemuRuntime", "QemuSandbox", "TapNetwork", "abort_launch", "configure_guest_network"]

_log = logging.getLogger(__name__)

_SANDBOX_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_BOOT_FAILURES = (ValueError, DiskError, QemuProcessError, TimeoutError, OSError, GuestError)


class TapNetwork(Protocol):
    """What the driver needs from ``VMSpec.network`` (:class:`capsa.node.net.SandboxNet` provides it):
    a tap inside a network namespace, and the guest's side of its subnet."""

    @property
    def netns(self) -> str: ...
    @property
    def tap(self) -> str: ...
    @property
    def mac(self) -> str: ...
    @property
    def guest_ip(self) -> str: ...
    @property
    def gateway_ip(self) -> str: ...
    @property
    def prefixlen(self) -> int: ...


_NETWORK_FIELDS = ("netns", "tap", "mac", "guest_ip", "gateway_ip", "prefixlen")
FailureCallback = Callable[[str], Awaitable[None] | None]


class _GuestProxy:
    """The sandbox's GuestClient, except that a dead VM raises SandboxFailed instead of hanging or a bare
    ChannelClosed, calls on a FAILED sandbox fail at once, and a channel lost while QEMU still runs is
    reconnected on the next call."""

    def __init__(self, sandbox: QemuSandbox) -> None:
        self._sandbox = sandbox

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._sandbox._client, name)
        if inspect.iscoroutinefunction(target):
            return functools.partial(self._call, name)
        if inspect.isasyncgenfunction(target):
            return functools.partial(self._iterate, name)
        return target

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        client = await self._sandbox._usable_client()
        try:
            return await getattr(client, name)(*args, **kwargs)
        except ChannelClosed as exc:
            raise await self._sandbox._channel_error(exc) from exc

    async def _iterate(self, name: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        client = await self._sandbox._usable_client()
        try:
            async for item in getattr(client, name)(*args, **kwargs):
                yield item
        except ChannelClosed as exc:
            raise await self._sandbox._channel_error(exc) from exc


class QemuSandbox:
    """One QEMU microvm (implements :class:`capsa.node.runtime.base.Sandbox`)."""

    def __init__(self, sandbox_id: str, vmdir: VmDir, process: QemuProcess, client: GuestClient,
                 accel: Accelerator, *, vm_uid: int | None, disk_cow: bool, boot_seconds: float) -> None:
        self._id = sandbox_id
        self._vmdir = vmdir
        self.process = process
        self._client = client
        self._accel = accel
        self.vm_uid = vm_uid
        self.disk_cow = disk_cow
        self.boot_seconds = boot_seconds
        self._state = SandboxState.RUNNING
        self._failure: str | None = None
        self._callbacks: list[FailureCallback] = []
        self._stopping = False
        self._lock = asyncio.Lock()
        self._reconnect_lock = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None
        self._exited = asyncio.Event()
        self._proxy = _GuestProxy(self)

    @property
    def id(self) -> str:
        return self._id

    @property
    def state(self) -> SandboxState:
        return self._state

    @property
    def accelerator(self) -> Accelerator:
        return self._accel

    @property
    def guest(self) -> GuestClient:
        return cast(GuestClient, self._proxy)

    @property
    def workdir(self) -> Path:
        return self._vmdir.root

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def console_log(self) -> Path:
        return self._vmdir.console_log

    def console_tail(self, limit: int = 4000) -> str:
        return self.process.console_tail(limit)

    def on_failure(self, callback: FailureCallback) -> None:
        self._callbacks.append(callback)

    async def _usable_client(self) -> GuestClient:
        self._check_alive()
        if self._client.closed and self.process.returncode is None:
            async with self._reconnect_lock:
                if self._client.closed:
                    _log.warning("guest channel of %s was lost while the VM runs; reconnecting", self._id)
                    client = await GuestClient.connect_unix(str(self._vmdir.agent_socket))
                    try:
                        await client.wait_ready(timeout=15, interval=1.0)
                    except BaseException:
                        await client.close()
                        raise
                    self._client = client
        return self._client

    def _check_alive(self) -> None:
        if self._state is SandboxState.FAILED:
            raise SandboxFailed(f"sandbox {self._id} failed: {self._failure}", sandbox_id=self._id)
        if self._state is SandboxState.DESTROYED:
            raise SandboxFailed(f"sandbox {self._id} was destroyed", sandbox_id=self._id)

    async def _channel_error(self, exc: ChannelClosed) -> Exception:
        """Turn a lost guest channel into SandboxFailed when the VM is gone (waiting briefly, since the
        socket may close a moment before the process exit is noticed)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._exited.wait(), 2.0)
        if self._state in (SandboxState.FAILED, SandboxState.DESTROYED):
            reason = self._failure or "destroyed"
            return SandboxFailed(f"sandbox {self._id} failed: {reason}", sandbox_id=self._id)
        return exc

    async def _watch(self) -> None:
        await self.process.wait()
        self._exited.set()
        if self._stopping:
            return
        await self._fail(self.process.exit_description())

    async def _fail(self, reason: str) -> None:
        if self._state in (SandboxState.FAILED, SandboxState.DESTROYED):
            return
        self._state = SandboxState.FAILED
        self._failure = reason
        _log.warning("sandbox %s failed: %s", self._id, reason)
        with contextlib.suppress(Exception):
            await self._client.close()
        for callback in self._callbacks:
            try:
                result = callback(reason)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                _log.exception("on_failure callback of sandbox %s raised", self._id)

    def __repr__(self) -> str:
        return f"<QemuSandbox {self._id} {self._state.value} accel={self._accel.value} pid={self.pid}>"


async def abort_launch(process: QemuProcess | None, client: GuestClient | None, vmdir: VmDir) -> str:
    """Undo a boot or restore that failed midway: close the guest channel, kill QEMU and delete the VM
    directory. Returns the tail of the guest console, for the error message."""
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


class QemuRuntime:
    """Boots sandboxes as QEMU microvms. Use from one asyncio event loop."""

    name = "qemu"

    def __init__(self, settings: Settings | None = None, accel: str | Accelerator | None = None, *,
                 boot_timeout: float = 90.0, kvm_probe_timeout: float = 8.0, drop_privileges: bool = True,
                 console_limit: int = 1024 * 1024, accel_cache: Path | bool | None = True) -> None:
        self.settings = settings or Settings()
        self.requested_accel = parse_accel(accel if accel is not None else self.settings.accel)
        self.boot_timeout = boot_timeout
        self.kvm_probe_timeout = kvm_probe_timeout
        # Only root can hand QEMU another uid; otherwise it runs as the node's own (unprivileged) user.
        self.drop_privileges = drop_privileges and os.geteuid() == 0
        self.console_limit = console_limit
        cache_path: Path | None
        if accel_cache is True:
            cache_path = self.settings.cache_dir / "accel.json"
        elif accel_cache is False:
            cache_path = None
        else:
            cache_path = accel_cache
        self._accel_cache = AccelCache(cache_path)
        self.accel_decision: AccelDecision | None = None
        if self.requested_accel is not Accelerator.AUTO:
            self.accel_decision = AccelDecision(self.requested_accel, "requested", time.time())
        self.vms_dir = self.settings.state_dir / "vms"
        self._sandboxes: dict[str, QemuSandbox] = {}
        self._booting: set[str] = set()
        self._closed = False

    # -- accelerator -------------------------------------------------------------------------------

    @property
    def accelerator(self) -> Accelerator | None:
        """The accelerator VMs get: the requested one, or what ``auto`` settled on (None: not yet known)."""
        if self.requested_accel is not Accelerator.AUTO:
            return self.requested_accel
        return self.accel_decision.accel if self.accel_decision else None

    def _accel_key(self) -> str:
        who = "vm-uid" if self.drop_privileges else f"uid{os.geteuid()}"
        return f"qemu={qemu_version()} kernel={host_kernel_release()} user={who}"

    def _decide(self, accel: Accelerator, reason: str, *, persist: bool) -> None:
        if persist:
            self.accel_decision = self._accel_cache.put(self._accel_key(), accel, reason)
        else:
            self.accel_decision = AccelDecision(accel, reason, time.time())
        _log.info("accelerator: %s (%s)", accel.value, reason)

    def _probe_uid(self) -> int | None:
        # Every VM uid is in the same position towards /dev/kvm (not its owner), so any one stands for all.
        return VM_UID_BASE if self.drop_privileges else None

    def _kvm_groups(self) -> list[int]:
        with contextlib.suppress(OSError):
            gid = Path("/dev/kvm").stat().st_gid
            if gid != 0:
                return [gid]
        return []

    # -- boot --------------------------------------------------------------------------------------

    async def boot(self, spec: VMSpec, sandbox_id: str | None = None) -> QemuSandbox:
        if self._closed:
            raise RuntimeError_("the runtime is closed")
        sid = sandbox_id or new_id("sbx")
        if not _SANDBOX_ID_RE.match(sid):
            raise BootError(f"invalid sandbox id {sid!r}")
        if sid in self._sandboxes or sid in self._booting:
            raise BootError(f"sandbox {sid} already exists")
        if spec.network is not None and not all(hasattr(spec.network, a) for a in _NETWORK_FIELDS):
            raise BootError(f"spec.network must describe a tap ({', '.join(_NETWORK_FIELDS)}), "
                            f"got {spec.network!r}")
        try:
            binary = qemu_binary()
        except HostInfoError as exc:
            raise BootError(str(exc)) from exc
        self._booting.add(sid)
        try:
            sandbox = await self._boot_with_accel(binary, spec, sid)
        finally:
            self._booting.discard(sid)
        if self._closed:  # close() ran while this VM was booting: it must not outlive the runtime
            await self.destroy(sandbox)
            raise RuntimeError_("the runtime was closed while the sandbox was booting")
        return sandbox

    async def _boot_with_accel(self, binary: str, spec: VMSpec, sid: str) -> QemuSandbox:
        accel = self.requested_accel
        if accel is Accelerator.AUTO:
            cached = self._accel_cache.get(self._accel_key())
            if cached is not None:
                self.accel_decision = cached
                accel = cached.accel
            else:
                sandbox = await self._probe_kvm(binary, spec, sid)
                if sandbox is not None:
                    return sandbox
                accel = Accelerator.TCG
        elif accel is Accelerator.KVM:
            reason = kvm_device_status(self._probe_uid(), tuple(self._kvm_groups()))
            if reason is not None:
                raise BootError(f"kvm was requested but {reason}")
        return await self._boot(binary, spec, sid, accel, self.boot_timeout)

    async def _probe_kvm(self, binary: str, spec: VMSpec, sid: str) -> QemuSandbox | None:
        """Boot this sandbox under KVM with a short deadline; the VM is kept when it works."""
        reason = kvm_device_status(self._probe_uid(), tuple(self._kvm_groups()))
        if reason is not None:
            self._decide(Accelerator.TCG, f"kvm unusable: {reason}", persist=False)
            return None
        _log.info("probing kvm: booting %s with -accel kvm (%.0fs deadline)", sid, self.kvm_probe_timeout)
        started = time.monotonic()
        try:
            sandbox = await self._boot(binary, spec, sid, Accelerator.KVM, self.kvm_probe_timeout)
        except BootError as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else "no answer"
            self._decide(Accelerator.TCG, f"kvm probe boot failed: {first_line}", persist=True)
            return None
        self._decide(Accelerator.KVM, f"kvm probe boot answered in {time.monotonic() - started:.1f}s",
                     persist=True)
        return sandbox

    def _shared_file(self, src: Path, vmdir: VmDir, owner: tuple[int, int] | None) -> Path:
        """``src`` if the VM user can read it where it is, else a copy inside the VM directory."""
        if owner is None or _world_readable(src):
            return src
        dst = vmdir.root / src.name
        shutil.copyfile(src, dst)
        os.chown(dst, owner[0], owner[1])
        os.chmod(dst, 0o400)
        return dst

    async def _boot(self, binary: str, spec: VMSpec, sid: str, accel: Accelerator,
                    within: float) -> QemuSandbox:
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + within
        vmdir = VmDir(self.vms_dir / sid)
        try:
            vmdir.check_socket_paths()
        except ValueError as exc:
            raise BootError(str(exc)) from exc
        self._check_image(spec.image)
        if not 16 <= spec.memory_mib <= 1024 * 1024 or not 1 <= spec.vcpus <= 64:
            raise BootError(f"memory_mib must be 16..1048576 and vcpus 1..64, got {spec.memory_mib} MiB, "
                            f"{spec.vcpus} vCPUs")
        owner: tuple[int, int] | None = None
        if self.drop_privileges:
            uid = pick_vm_uid(self.vms_dir)
            owner = (uid, uid)
        try:
            vmdir.create(owner)
        except FileExistsError:
            raise BootError(f"sandbox {sid} already exists ({vmdir.root})") from None
        except OSError as exc:
            raise BootError(f"cannot create {vmdir.root}: {exc}") from exc
        process: QemuProcess | None = None
        client: GuestClient | None = None
        tap_fd: int | None = None
        try:
            disk = await asyncio.to_thread(private_disk, spec.image.rootfs, vmdir.disk,
                                           size_mib=spec.disk_size_mib, owner=owner)
            network = cast(TapNetwork, spec.network) if spec.network is not None else None
            if network is not None:
                tap_fd = await asyncio.to_thread(_open_tap, network)
            kernel = self._shared_file(spec.image.kernel, vmdir, owner)
            initrd = self._shared_file(spec.image.initrd, vmdir, owner)
            config = QemuConfig(
                binary=binary, accel=accel, kernel=kernel, initrd=initrd, disk=disk.path,
                qmp_socket=vmdir.qmp_socket, agent_socket=vmdir.agent_socket,
                memory_mib=spec.memory_mib, vcpus=spec.vcpus, tsc_khz=tsc_khz(),
                kernel_args=spec.kernel_args, name=sid, tap_fd=tap_fd,
                mac=network.mac if network is not None else None,
            )
            groups = self._kvm_groups() if accel is Accelerator.KVM else []
            process = QemuProcess(build_argv(config), vmdir, user=owner, extra_groups=groups,
                                  console_limit=self.console_limit,
                                  pass_fds=(tap_fd,) if tap_fd is not None else ())
            t_disk = loop.time()
            await process.start()
            if tap_fd is not None:
                os.close(tap_fd)  # QEMU holds its own copy now
                tap_fd = None
            await process.connect_qmp(max(1.0, deadline - loop.time()))
            t_qmp = loop.time()
            client = await self._connect_guest(process, vmdir, deadline)
            _log.debug("boot phases of %s: disk %.2fs, qemu to QMP %.2fs, QMP to guest ready %.2fs", sid,
                       t_disk - started, t_qmp - t_disk, loop.time() - t_qmp)
            if network is not None:
                await configure_guest_network(client, network)
            sandbox = QemuSandbox(sid, vmdir, process, client, accel, vm_uid=owner[0] if owner else None,
                                  disk_cow=disk.cow, boot_seconds=loop.time() - started)
        except BaseException as exc:
            if tap_fd is not None:
                os.close(tap_fd)
            detail = await abort_launch(process, client, vmdir)
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(exc, _BOOT_FAILURES):
                raise BootError(f"boot of {sid} ({accel.value}) failed: {exc}{detail}",
                                sandbox_id=sid) from exc
            raise
        sandbox._watcher = asyncio.create_task(sandbox._watch(), name=f"watch-{sid}")
        self._sandboxes[sid] = sandbox
        _log.info("sandbox %s booted in %.2fs (accel %s, pid %s, cow disk %s)", sid, sandbox.boot_seconds,
                  accel.value, process.pid, disk.cow)
        return sandbox

    @staticmethod
    def _check_image(image: GuestImage) -> None:
        if not all(hasattr(image, name) for name in ("kernel", "initrd", "rootfs")):
            raise BootError(f"not a guest image: {image!r}")
        for label, path in (("kernel", image.kernel), ("initrd", image.initrd), ("rootfs", image.rootfs)):
            if not path.is_file():
                raise BootError(f"image {label} {path} does not exist")

    async def _connect_guest(self, process: QemuProcess, vmdir: VmDir, deadline: float) -> GuestClient:
        """Connect to the agent socket and wait until the guest daemon answers ``health``, while watching
        QEMU: if it exits, the boot fails at once instead of at the deadline."""
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
                    client = await GuestClient.connect_unix(str(vmdir.agent_socket))
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

    # -- teardown ----------------------------------------------------------------------------------

    async def destroy(self, sandbox: object) -> None:
        if not isinstance(sandbox, QemuSandbox):
            raise TypeError(f"not a QEMU sandbox: {sandbox!r}")
        async with sandbox._lock:
            if sandbox._state is SandboxState.DESTROYED:
                return
            sandbox._stopping = True
            with contextlib.suppress(Exception):
                await sandbox._client.close()
            how = await sandbox.process.stop()
            if sandbox._watcher is not None:
                sandbox._watcher.cancel()
                with contextlib.suppress(BaseException):
                    await sandbox._watcher
            sandbox._exited.set()
            await asyncio.to_thread(sandbox._vmdir.remove)
            sandbox._state = SandboxState.DESTROYED
            self._sandboxes.pop(sandbox.id, None)
            _log.info("sandbox %s destroyed (%s)", sandbox.id, how)

    def list(self) -> list[QemuSandbox]:
        return list(self._sandboxes.values())

    def get(self, sandbox_id: str) -> QemuSandbox | None:
        return self._sandboxes.get(sandbox_id)

    async def cleanup_orphans(self) -> builtins.list[str]:
        """Kill QEMUs and delete workdirs under our state dir that no sandbox of this runtime owns."""
        ours = set(self._sandboxes) | self._booting
        removed: list[str] = []
        if self.vms_dir.is_dir():
            for path in sorted(self.vms_dir.iterdir()):
                if path.name in ours or not path.is_dir():
                    continue
                vmdir = VmDir(path)
                pid = read_pidfile(vmdir)
                if pid is not None:
                    await asyncio.to_thread(kill_and_wait, pid)
                    removed.append(f"{path.name}: killed qemu pid {pid}")
                await asyncio.to_thread(vmdir.remove)
                removed.append(f"{path.name}: removed {path}")
        own_pids = {sb.pid for sb in self._sandboxes.values()}
        for pid in await asyncio.to_thread(find_qemu_pids, self.vms_dir):
            if pid in own_pids or any(f"/{sid}/" in _cmdline_text(pid) for sid in ours):
                continue
            await asyncio.to_thread(kill_and_wait, pid)
            removed.append(f"killed stray qemu pid {pid}")
        for line in removed:
            _log.warning("orphan cleanup: %s", line)
        return removed

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*(self.destroy(sb) for sb in list(self._sandboxes.values())),
                             return_exceptions=True)


def _open_tap(network: TapNetwork) -> int:
    from capsa.node.net.wire import open_tap

    return open_tap(network.netns, network.tap)


async def configure_guest_network(client: GuestClient, network: TapNetwork) -> None:
    """Give the guest NIC (found by its MAC: the guest has no udev to name it) the sandbox's address.

    Idempotent, so it also serves a guest restored from a snapshot taken on another subnet: the old
    address, route and neighbour entries (the old tap's MAC) go first."""
    gateway = network.gateway_ip
    dns = str(getattr(network, "dns_server", gateway))
    script = (
        'set -e; dev=""; for d in /sys/class/net/*; do '
        '[ "$(cat "$d/address")" = "$1" ] && dev="${d##*/}"; done; '
        '[ -n "$dev" ] || { echo "no NIC with MAC $1" >&2; exit 1; }; '
        'ip link set dev "$dev" up; ip addr flush dev "$dev"; ip neigh flush dev "$dev"; '
        'ip addr add "$2" dev "$dev"; ip route replace default via "$3" dev "$dev"; '
        'printf "nameserver %s\\n" "$4" > /etc/resolv.conf'
    )
    argv = ["sh", "-c", script, "capsa-net", network.mac.lower(), f"{network.guest_ip}/{network.prefixlen}",
            gateway, dns]
    result = await client.exec(argv, timeout=30)
    if result.exit_code != 0:
        raise BootError(f"configuring the guest network failed: {result.stderr.decode(errors='replace')}")


def _cmdline_text(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _world_readable(path: Path) -> bool:
    try:
        if not path.stat().st_mode & stat.S_IROTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.resolve().parents)
    except OSError:
        return False
