"""The QEMU microvm driver: boots, snapshots, restores and branches VMs, and tears them down leaving
nothing behind.

What QEMU runs with (least privilege): its own uid from a private range (never root when the node is
root), no supplementary groups except the group owning /dev/kvm when KVM is used (a branch maps a sealed
memfd copy of its snapshot's RAM, never the file), a seccomp filter (``-sandbox on,...``: no set*id,
fork/exec, obsolete or scheduler syscalls), its own process group, no default devices, no display, no
network device unless asked for, its own disk, and a working directory only it and the node can enter. The
node keeps the pidfile and console log in a folder QEMU cannot write to.

Where disks and RAM live is the pluggable :class:`~capsa.node.runtime.qemu.storage.VmStorage`: work-dir
copies (no snapshots) or the node's storage pool (snapshots, restores, branches, templates). Cold boots,
restores and the KVM probe all start QEMU through :func:`~capsa.node.runtime.qemu.launch.launch`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from capsa.common.errors import CapsaError
from capsa.common.ids import is_id, new_id
from capsa.common.settings import Settings
from capsa.node.runtime.accel import AccelCache, AccelDecision, parse_accel
from capsa.node.runtime.base import (
    LABEL_PRIVATE_RAM,
    TAP_NETWORK_FIELDS,
    Accelerator,
    BootError,
    RamMode,
    RuntimeError_,
    Sandbox,
    SandboxState,
    VMSpec,
)
from capsa.node.runtime.hostinfo import HostInfoError, host_kernel_release, qemu_binary, qemu_version
from capsa.node.runtime.ids import IdAllocator
from capsa.node.runtime.qemu import kvm
from capsa.node.runtime.qemu.cmdline import machine_fingerprint
from capsa.node.runtime.qemu.launch import LaunchError, LaunchRequest, check_image, launch
from capsa.node.runtime.qemu.sandbox import QemuSandbox
from capsa.node.runtime.qemu.storage import VmFiles, VmStorage, WorkdirStorage
from capsa.node.runtime.snapshot.manifest import Snapshot, SnapshotError
from capsa.node.runtime.snapshot.mechanics import check_branch_count, save_snapshot
from capsa.node.runtime.workdir import (
    VM_UID_BASE,
    VM_UID_COUNT,
    VmDir,
    find_qemu_pids,
    kill_and_wait,
    read_pidfile,
    vm_uids_in_use,
)
from capsa.node.storage.disks import DiskError
from capsa.node.storage.filecopy import CopyError, UnsafeSource
from capsa.node.storage.pool import StoragePool

__all__ = ["QemuRuntime"]

_log = logging.getLogger(__name__)

_SANDBOX_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_Prepare = Callable[[VmDir, tuple[int, int] | None], VmFiles]
"""Lays out a VM's files (in a thread), given its directory and VM user."""


class QemuRuntime:
    """Runs sandboxes as QEMU microvms (implements :class:`~capsa.node.runtime.base.Runtime` and
    :class:`~capsa.node.runtime.base.SnapshotCapable`). Use from one asyncio event loop."""

    name = "qemu"

    def __init__(self, settings: Settings | None = None, accel: str | Accelerator | None = None, *,
                 storage: VmStorage | None = None, boot_timeout: float = 90.0, kvm_probe_timeout: float = 8.0,
                 snapshot_timeout: float = 300.0, drop_privileges: bool = True,
                 console_limit: int = 1024 * 1024, accel_cache: Path | bool | None = True,
                 kvm_device: Path = kvm.KVM_DEVICE) -> None:
        self.settings = settings or Settings()
        self.requested_accel = parse_accel(accel if accel is not None else self.settings.accel)
        self.storage: VmStorage = storage if storage is not None else WorkdirStorage()
        self.boot_timeout = boot_timeout
        self.kvm_probe_timeout = kvm_probe_timeout
        self.snapshot_timeout = snapshot_timeout
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
        # Checked for access and giving VMs its group; QEMU itself always opens /dev/kvm (tests point
        # this at a private copy of the device node to set up the access they test).
        self.kvm_device = kvm_device
        self._kvm_booted = False  # a guest has booted under kvm in this runtime
        if self.requested_accel is not Accelerator.AUTO:
            self.accel_decision = AccelDecision(self.requested_accel, "requested", time.time())
        self.vms_dir = self.settings.state_dir / "vms"
        self._sandboxes: dict[str, QemuSandbox] = {}
        self._booting: set[str] = set()
        self._closed = False
        # No two live VMs share a uid: allocated at launch, released when the VM is gone.
        self.vm_uids = IdAllocator(VM_UID_BASE, VM_UID_COUNT, "VM uid")

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

    def _probe_user(self) -> tuple[int, int] | None:
        # Every VM uid is in the same position towards /dev/kvm (not its owner), so any one stands for all.
        return (VM_UID_BASE, VM_UID_BASE) if self.drop_privileges else None

    def _kvm_groups(self) -> tuple[int, ...]:
        return kvm.kvm_groups(self.kvm_device)

    async def _kvm_access_error(self) -> str | None:
        """Why QEMU, as the user and groups a VM on KVM gets, cannot open the KVM device (None: it can)."""
        return await kvm.kvm_access_error(self._probe_user(), self._kvm_groups(), self.kvm_device)

    # -- starting VMs ------------------------------------------------------------------------------

    def _admit(self, spec: VMSpec, sandbox_id: str | None) -> str:
        """Check a boot or restore request before anything is made; returns the sandbox id."""
        if self._closed:
            raise RuntimeError_("the runtime is closed")
        sid = sandbox_id or new_id("sbx")
        if not _SANDBOX_ID_RE.match(sid):
            raise BootError(f"invalid sandbox id {sid!r}")
        if sid in self._sandboxes or sid in self._booting:
            raise BootError(f"sandbox {sid} already exists")
        if spec.network is not None and not all(hasattr(spec.network, a) for a in TAP_NETWORK_FIELDS):
            raise BootError(f"spec.network must describe a tap ({', '.join(TAP_NETWORK_FIELDS)}), "
                            f"got {spec.network!r}")
        if not 16 <= spec.memory_mib <= 1024 * 1024 or not 1 <= spec.vcpus <= 64:
            raise BootError(f"memory_mib must be 16..1048576 and vcpus 1..64, got {spec.memory_mib} MiB, "
                            f"{spec.vcpus} vCPUs")
        return sid

    def command_aslr(self, accel: Accelerator) -> bool:
        """Whether a VM on ``accel`` randomizes its commands' layout (``CAPSA_COMMAND_ASLR``; ``auto``:
        not under TCG, see capsa.guest.layout)."""
        mode = self.settings.command_aslr
        return mode == "on" or (mode == "auto" and accel is not Accelerator.TCG)

    @staticmethod
    def _binary() -> str:
        try:
            return qemu_binary()
        except HostInfoError as exc:
            raise BootError(str(exc)) from exc

    async def _start(self, binary: str, spec: VMSpec, sid: str, accel: Accelerator, within: float, *,
                     prepare: _Prepare, parent: str | None = None, refresh: bool = True) -> QemuSandbox:
        """The one launch path: VM directory, files from the storage strategy, then QEMU."""
        started = asyncio.get_running_loop().time()
        vmdir = VmDir(self.vms_dir / sid)
        try:
            vmdir.check_socket_paths()
        except ValueError as exc:
            raise BootError(str(exc)) from exc
        check_image(spec.image)
        owner: tuple[int, int] | None = None
        if self.drop_privileges:
            uid = self.vm_uids.allocate(taken=await asyncio.to_thread(vm_uids_in_use, self.vms_dir))
            owner = (uid, uid)
        try:
            vmdir.create(owner)
        except BaseException as exc:
            if owner is not None:
                self.vm_uids.release(owner[0])
            if isinstance(exc, FileExistsError):
                raise BootError(f"sandbox {sid} already exists ({vmdir.root})") from None
            if isinstance(exc, OSError):
                raise BootError(f"cannot create {vmdir.root}: {exc}") from exc
            raise
        try:
            try:
                files = await asyncio.to_thread(prepare, vmdir, owner)
            except BaseException as exc:
                await asyncio.to_thread(vmdir.remove)
                if isinstance(exc, (DiskError, CopyError, OSError, ValueError)):
                    raise BootError(f"preparing the disk of {sid} failed: {exc}", sandbox_id=sid) from exc
                raise
            groups = self._kvm_groups() if accel is Accelerator.KVM else ()
            request = LaunchRequest(sandbox_id=sid, spec=spec, binary=binary, accel=accel, vmdir=vmdir,
                                    files=files, within=within, owner=owner, groups=groups,
                                    console_limit=self.console_limit, parent=parent, refresh=refresh,
                                    command_aslr=self.command_aslr(accel))
            sandbox = await launch(request, started=started)
        except BaseException:
            await asyncio.to_thread(self.storage.release, sid)
            if owner is not None:
                self.vm_uids.release(owner[0])
            raise
        self._sandboxes[sid] = sandbox
        return sandbox

    async def _admitted(self, sid: str, sandbox: QemuSandbox) -> QemuSandbox:
        if self._closed:  # close() ran while this VM was starting: it must not outlive the runtime
            await self.destroy(sandbox)
            raise RuntimeError_(f"the runtime was closed while the sandbox was booting ({sid})")
        return sandbox

    async def boot(self, spec: VMSpec, sandbox_id: str | None = None) -> QemuSandbox:
        """Cold-boot a VM and return once its guest daemon answers. Leaves nothing behind on failure."""
        sid = self._admit(spec, sandbox_id)
        binary = self._binary()
        self._booting.add(sid)
        try:
            sandbox = await self._boot_with_accel(binary, spec, sid)
        finally:
            self._booting.discard(sid)
        return await self._admitted(sid, sandbox)

    def _boot_files(self, spec: VMSpec, sid: str) -> _Prepare:
        return lambda vmdir, owner: self.storage.boot_files(sid, spec, vmdir, owner)

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
            return await self._boot_requested_kvm(binary, spec, sid)
        return await self._start(binary, spec, sid, accel, self.boot_timeout,
                                 prepare=self._boot_files(spec, sid))

    async def _boot_requested_kvm(self, binary: str, spec: VMSpec, sid: str) -> QemuSandbox:
        """``-accel kvm`` was asked for: refused before anything is made when the VM user cannot open the
        device (``kvm_unavailable``); a boot that fails before any guest has booted under kvm here is
        refused as kvm's (``kvm_boot_failed``), where ``auto`` would have fallen back to TCG."""
        reason = await self._kvm_access_error()
        if reason is not None:
            raise BootError(f"kvm was requested but {reason}; give that user read-write access (e.g. a kvm "
                            "group and mode 0660: VMs get the device's group) or use accel auto or tcg",
                            code="kvm_unavailable", sandbox_id=sid)
        try:
            sandbox = await self._start(binary, spec, sid, Accelerator.KVM, self.boot_timeout,
                                        prepare=self._boot_files(spec, sid))
        except LaunchError as exc:
            if self._kvm_booted:
                raise
            device = kvm.describe_device(self.kvm_device)
            who = kvm.describe_user(self._probe_user(), self._kvm_groups())
            raise BootError(f"kvm was requested but the guest did not boot under kvm, and none has in this "
                            f"runtime yet ({device}, QEMU as {who}); if the image boots with accel tcg, "
                            "this host's kvm cannot run it (e.g. a PVM /dev/kvm, or no vmx/svm): use accel "
                            f"auto or tcg. {exc}", code="kvm_boot_failed", sandbox_id=sid) from exc
        self._kvm_booted = True
        return sandbox

    async def _probe_kvm(self, binary: str, spec: VMSpec, sid: str) -> QemuSandbox | None:
        """Boot this sandbox under KVM with a short deadline; the VM is kept when it works."""
        reason = await self._kvm_access_error()
        if reason is not None:
            self._decide(Accelerator.TCG, f"kvm unusable: {reason}", persist=False)
            return None
        _log.info("probing kvm: booting %s with -accel kvm (%.0fs deadline)", sid, self.kvm_probe_timeout)
        started = time.monotonic()
        try:
            sandbox = await self._start(binary, spec, sid, Accelerator.KVM, self.kvm_probe_timeout,
                                        prepare=self._boot_files(spec, sid))
        except BootError as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else "no answer"
            self._decide(Accelerator.TCG, f"kvm probe boot failed: {first_line}", persist=True)
            return None
        self._decide(Accelerator.KVM, f"kvm probe boot answered in {time.monotonic() - started:.1f}s",
                     persist=True)
        return sandbox

    async def settle_accelerator(self, spec: VMSpec | None) -> AccelDecision | None:
        """The accelerator this runtime's VMs would get, decided as a first boot decides it but keeping no
        VM (``capsa doctor``): ``tcg`` as requested; ``kvm`` as requested once the VM user can open the
        device and a probe boot of ``spec`` under it answers (else :class:`BootError`, coded as a boot's:
        ``kvm_unavailable``, ``kvm_boot_failed``); ``auto``: the cached decision, else TCG when the VM user
        cannot open the device, else a KVM probe boot of ``spec`` (cached as a boot's probe is). None when
        only a probe boot can tell and ``spec`` is None (no guest image yet)."""
        if self.requested_accel is Accelerator.TCG:
            return self.accel_decision
        if self.requested_accel is Accelerator.AUTO:
            cached = self._accel_cache.get(self._accel_key())
            if cached is not None:
                self.accel_decision = cached
                return cached
            if (reason := await self._kvm_access_error()) is not None:
                self._decide(Accelerator.TCG, f"kvm unusable: {reason}", persist=False)
                return self.accel_decision
        if spec is None:
            if self.requested_accel is Accelerator.KVM and (reason := await self._kvm_access_error()):
                raise BootError(f"kvm was requested but {reason}", code="kvm_unavailable")
            return None
        started = time.monotonic()
        sandbox = await self.boot(spec)
        await self.destroy(sandbox)
        if self.requested_accel is Accelerator.KVM:
            return AccelDecision(Accelerator.KVM, f"requested; a probe boot answered in "
                                 f"{time.monotonic() - started:.1f}s", time.time())
        return self.accel_decision

    # -- snapshots ---------------------------------------------------------------------------------

    @property
    def can_snapshot(self) -> bool:
        """Whether the storage strategy keeps VMs where they can be snapshotted (the storage pool)."""
        return self.storage.pool is not None

    @property
    def pool(self) -> StoragePool:
        """The storage pool holding snapshots and templates; SnapshotError ``snapshot_unsupported`` when
        the storage strategy has none."""
        pool = self.storage.pool
        if pool is None:
            raise SnapshotError("this runtime keeps VM disks in their work directories and cannot snapshot "
                                "(it needs the storage pool)", code="snapshot_unsupported", status=409)
        return pool

    @property
    def templates_dir(self) -> Path:
        """The pool's templates/ (never raises, so ``isinstance(runtime, SnapshotCapable)`` works for
        every storage; without a pool it names a directory no snapshot can be taken into)."""
        pool = self.storage.pool
        return pool.templates_dir if pool is not None else self.settings.state_dir / "templates"

    def open_snapshot(self, snapshot_id: str) -> Snapshot:
        if not is_id(snapshot_id, "snap"):
            raise CapsaError(f"snapshot {snapshot_id!r} not found", code="snapshot_not_found", status=404)
        path = self.pool.snapshot_dir(snapshot_id)
        if not path.is_dir():
            raise CapsaError(f"snapshot {snapshot_id} not found", code="snapshot_not_found", status=404)
        return Snapshot.open(path)

    def list_snapshot_ids(self) -> builtins.list[str]:
        if self.storage.pool is None:
            return []
        return [sid for sid in self.storage.pool.list_snapshots() if is_id(sid, "snap")]

    def delete_snapshot(self, snapshot: Snapshot | Path | str) -> bool:
        sid = snapshot.id if isinstance(snapshot, Snapshot) else Path(snapshot).name
        return self.pool.remove_snapshot(sid)

    def _resolve(self, snapshot: Snapshot | Path | str) -> Snapshot:
        if isinstance(snapshot, Snapshot):
            return snapshot
        path = self.pool.snapshot_dir(snapshot) if isinstance(snapshot, str) else snapshot
        return Snapshot.open(path)

    @staticmethod
    def _machine(spec: VMSpec, accel: Accelerator) -> str:
        mac = getattr(spec.network, "mac", None) if spec.network is not None else None
        return machine_fingerprint(accel, memory_mib=spec.memory_mib, vcpus=spec.vcpus,
                                   kernel_args=spec.kernel_args, mac=mac, nic=spec.network is not None)

    def _check_restorable(self, snap: Snapshot, spec: VMSpec) -> Accelerator:
        """The accelerator ``snap`` restores under; SnapshotError when this runtime cannot restore it."""
        try:
            accel = Accelerator(snap.manifest.accel)
        except ValueError:
            raise SnapshotError(f"snapshot {snap.id} has unknown accelerator {snap.manifest.accel!r}",
                                code="snapshot_corrupt") from None
        if self.requested_accel not in (Accelerator.AUTO, accel):
            raise SnapshotError(f"snapshot {snap.id} was taken under {accel.value}; this runtime uses "
                                f"{self.requested_accel.value}", code="snapshot_mismatch", status=409)
        try:
            version = qemu_version()
        except HostInfoError as exc:
            raise BootError(str(exc)) from exc
        if snap.manifest.machine not in (None, self._machine(spec, accel)):
            raise SnapshotError(f"snapshot {snap.id} was taken from a different VM layout (QEMU devices or "
                                "options changed since)", code="snapshot_mismatch", status=409)
        if snap.manifest.qemu_version not in (None, version):
            # microvm has no versioned machine types, so a stream from another QEMU may not load.
            raise SnapshotError(f"snapshot {snap.id} was taken with QEMU {snap.manifest.qemu_version}, this "
                                f"node runs {version}", code="snapshot_mismatch", status=409)
        return accel

    def can_restore(self, snapshot: Snapshot, spec: VMSpec) -> bool:
        try:
            self._check_restorable(snapshot, spec)
        except (SnapshotError, BootError):
            return False
        return True

    async def snapshot(self, sandbox: Sandbox, dest: Path | str | None = None, *, resume: bool = True,
                       labels: dict[str, str] | None = None, content_digest: bool = False) -> Snapshot:
        """Snapshot a running sandbox into ``dest`` (a snapshot id, a directory, or None for a new id under
        the pool's snapshots/). ``resume=False`` leaves the VM stopped (pause: the caller destroys it next).
        """
        if not isinstance(sandbox, QemuSandbox) or self._sandboxes.get(sandbox.id) is not sandbox:
            raise SnapshotError(f"{sandbox!r} is not a sandbox of this runtime", code="invalid_state",
                                status=409)
        pool = self.pool
        if isinstance(dest, str):
            dest = pool.snapshot_dir(dest)
        elif dest is None:
            dest = pool.snapshot_dir(new_id("snap"))
        spec, files = sandbox.spec, sandbox.files
        if files.private_ram or (spec.private_ram and files.ram_base is not None):
            # Its restores keep the RAM private too (a busy guest: no write-back).
            labels = {**(labels or {}), LABEL_PRIVATE_RAM: "private"}
        # The disk and RAM file belong to the VM user, whose QEMU may be compromised: clone only regular
        # files of that user on the pool's filesystem, never a link planted in their place.
        owner = sandbox.vm_uid if sandbox.vm_uid is not None else os.geteuid()
        clone = functools.partial(pool.clone, source_owner=owner)
        async with sandbox.exclusive() as state:
            if state is not SandboxState.RUNNING:
                raise SnapshotError(f"sandbox {sandbox.id} is {state.value}, cannot snapshot it",
                                    code="invalid_state", status=409)
            version: str | None = None
            with contextlib.suppress(HostInfoError):
                version = qemu_version()
            try:
                # A monitor that stops answering must not hang the caller forever.
                async with asyncio.timeout(self.snapshot_timeout):
                    manifest = await save_snapshot(
                        sandbox.process.monitor, dest, disk=files.disk,
                        ram=files.ram if files.shared_ram else None, clone=clone,
                        memory_mib=spec.memory_mib, vcpus=spec.vcpus, accel=sandbox.accelerator.value,
                        image_digest=spec.image.digest, qemu_version=version,
                        machine=self._machine(spec, sandbox.accelerator), parent=sandbox.parent,
                        labels=labels, resume=resume, content_digest=content_digest,
                        time_limit=self.snapshot_timeout, ram_base=files.ram_base,
                    )
            except TimeoutError:
                raise SnapshotError(f"snapshot of {sandbox.id} did not finish within "
                                    f"{self.snapshot_timeout:.0f}s", code="snapshot_timeout") from None
            except UnsafeSource as exc:
                _log.error("snapshot of %s refused: %s", sandbox.id, exc.message)
                raise SnapshotError(f"snapshot of {sandbox.id} refused: {exc.message}",
                                    code="unsafe_source", status=409) from None
        # The sandbox's state now descends from this snapshot.
        sandbox.parent = manifest.id
        if resume:
            # The guest clock stood still while the VM was stopped.
            with contextlib.suppress(Exception):
                await sandbox.guest.set_clock()
        return Snapshot(dest, manifest)

    async def restore(self, snapshot: Snapshot | Path | str, spec: VMSpec, *, sandbox_id: str | None = None,
                      ram_mode: RamMode = RamMode.COPY, refresh: bool = True,
                      ram_domain: str | None = None) -> QemuSandbox:
        """A new running sandbox from ``snapshot``. ``refresh=False`` skips the reseed and clock (tests)."""
        sid = self._admit(spec, sandbox_id)
        snap = await asyncio.to_thread(self._resolve, snapshot)
        binary = self._binary()
        accel = self._check_restorable(snap, spec)
        self._booting.add(sid)
        try:
            sandbox = await self._start(
                binary, spec, sid, accel, self.boot_timeout, parent=snap.id, refresh=refresh,
                prepare=lambda _vmdir, owner: self.storage.restore_files(sid, snap, spec, ram_mode, owner,
                                                                         domain=ram_domain))
        finally:
            self._booting.discard(sid)
        return await self._admitted(sid, sandbox)

    async def branch(self, snapshot: Snapshot | Path | str, n: int, spec: VMSpec, *,
                     ram_mode: RamMode = RamMode.PRIVATE) -> builtins.list[QemuSandbox]:
        """``n`` independent sandboxes from one snapshot, restored concurrently. All or nothing."""
        check_branch_count(n)
        snap = await asyncio.to_thread(self._resolve, snapshot)
        results = await asyncio.gather(*(self.restore(snap, spec, ram_mode=ram_mode) for _ in range(n)),
                                       return_exceptions=True)
        made = [r for r in results if isinstance(r, QemuSandbox)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(self.destroy(sb) for sb in made), return_exceptions=True)
            raise errors[0]
        return made

    # -- teardown ----------------------------------------------------------------------------------

    async def destroy(self, sandbox: object) -> None:
        """Stop the VM and delete everything it owned (process, files, sockets, workdir). Idempotent."""
        if not isinstance(sandbox, QemuSandbox):
            raise TypeError(f"not a QEMU sandbox: {sandbox!r}")
        how = await sandbox.stop()
        if self._sandboxes.get(sandbox.id) is sandbox:
            del self._sandboxes[sandbox.id]
        if how is not None:
            await asyncio.to_thread(self.storage.release, sandbox.id)
            if sandbox.vm_uid is not None:
                self.vm_uids.release(sandbox.vm_uid)  # its QEMU has exited: no process holds the uid
            _log.info("sandbox %s destroyed (%s)", sandbox.id, how)

    def list(self) -> builtins.list[QemuSandbox]:
        return list(self._sandboxes.values())

    def get(self, sandbox_id: str) -> QemuSandbox | None:
        return self._sandboxes.get(sandbox_id)

    async def cleanup_orphans(self) -> builtins.list[str]:
        """Kill QEMUs and delete workdirs and storage under our state dir that no sandbox of this runtime
        owns."""
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
        keep = set(self._sandboxes) | self._booting
        for sid in await asyncio.to_thread(self.storage.prune, keep):
            removed.append(f"{sid}: removed pool files")
        for line in removed:
            _log.warning("orphan cleanup: %s", line)
        return removed

    async def close(self) -> None:
        """Destroy every sandbox this runtime owns."""
        self._closed = True
        await asyncio.gather(*(self.destroy(sb) for sb in list(self._sandboxes.values())),
                             return_exceptions=True)


def _cmdline_text(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
