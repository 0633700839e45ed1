"""The QEMU driver with snapshots: boot, snapshot, restore and branch, on the node's storage pool.

:class:`SnapshotRuntime` extends :class:`~capsa.node.runtime.qemu.QemuRuntime` (which stays the one place
that knows how to start, watch and stop a QEMU) with what snapshots need:

* every VM keeps its root disk and its RAM file in the pool (``sandboxes/<sbx id>/``), so both can be
  reflinked at the instant the VM is stopped; the RAM is mapped shared, so a snapshot's migration stream
  is only the device state;
* ``restore`` starts a QEMU with ``-incoming defer`` from a snapshot, ``branch`` starts n of them at once
  from one frozen RAM file mapped privately;
* after every restore or branch the guest gets fresh entropy with a forced reseed and the host's clock,
  before anyone can use the sandbox.

Privileges: a restored VM's disk and RAM copy belong to its own VM uid, like a booted one. Branches that
map the snapshot's frozen RAM privately need the kernel's permission to open that file read-write (QEMU
7.2 has no read-only private mapping), so the file gets a group of its own and only those VMs join it;
the mapping is private, so guests never write the file, but a QEMU compromised from inside its guest could.
Use ``RamMode.COPY`` where that matters more than the ~0.1 s per clone it costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from qemu.qmp import QMPClient

from capsa.common.errors import CapsaError
from capsa.common.ids import is_id, new_id
from capsa.common.settings import Settings
from capsa.node.guest_client import GuestClient
from capsa.node.runtime.base import (
    Accelerator,
    BootError,
    RuntimeError_,
    Sandbox,
    SandboxState,
    SnapshotCapable,
    VMSpec,
)
from capsa.node.runtime.hostinfo import HostInfoError, qemu_binary, qemu_version, tsc_khz
from capsa.node.runtime.qemu import (
    _NETWORK_FIELDS,
    _SANDBOX_ID_RE,
    QemuRuntime,
    QemuSandbox,
    TapNetwork,
    _open_tap,
    abort_launch,
    configure_guest_network,
)
from capsa.node.runtime.qemu_cmdline import QemuConfig, build_argv
from capsa.node.runtime.qemu_process import QemuProcess
from capsa.node.runtime.snapshot import (
    RamMode,
    RestorePlan,
    check_branch_count,
    create_ram_file,
    memory_backend_args,
    plan_restore,
    refresh_guest,
    save_snapshot,
)
from capsa.node.runtime.snapshot_manifest import RAM_FILE, Snapshot, SnapshotError
from capsa.node.runtime.workdir import VM_UID_BASE, VmDir, pick_vm_uid
from capsa.node.storage.disks import private_disk
from capsa.node.storage.filecopy import CopyError, copy_file
from capsa.node.storage.pool import StoragePool

__all__ = ["Snapshot", "SnapshotRuntime", "SnapshotSandbox"]

_log = logging.getLogger(__name__)

_SNAPSHOT_GID_COUNT = 1_000_000
_IMAGE_PREFIX = "image-"


@dataclass
class _VmFiles:
    spec: VMSpec
    pool_dir: Path
    disk: Path
    ram: Path | None
    shared_ram: bool  # False: RAM is a private mapping (branch); snapshots then carry it in the stream
    parent: str | None


class SnapshotSandbox(QemuSandbox):
    """A QEMU sandbox whose disk and RAM live in the storage pool."""

    files: _VmFiles

    @property
    def qmp(self) -> QMPClient:
        client = self.process._qmp
        if client is None:
            raise SnapshotError(f"sandbox {self.id} has no monitor connection")
        return client


class SnapshotRuntime(QemuRuntime):
    """QEMU microvms that can be snapshotted, restored and branched."""

    def __init__(self, settings: Settings | None = None, accel: str | Accelerator | None = None, *,
                 pool: StoragePool | None = None, snapshot_timeout: float = 300.0, **kwargs: object) -> None:
        super().__init__(settings, accel, **kwargs)  # type: ignore[arg-type]
        self.snapshot_timeout = snapshot_timeout
        self.pool = pool if pool is not None else StoragePool.from_settings(self.settings)
        self._grant_lock = asyncio.Lock()

    # -- booting (called by QemuRuntime.boot, including its KVM probe) -----------------------------------

    def _owner(self) -> tuple[int, int] | None:
        if not self.drop_privileges:
            return None
        uid = pick_vm_uid(self.vms_dir)
        return (uid, uid)

    def _pool_rootfs(self, spec: VMSpec) -> Path:
        """The image's root filesystem inside the pool, so sandbox disks are reflinks of it, not copies."""
        tdir = self.pool.template_dir(_IMAGE_PREFIX + spec.image.digest.split(":")[-1][:32])
        path = tdir / "rootfs.ext4"
        if not path.exists():
            tdir.mkdir(mode=0o711, exist_ok=True)
            try:
                copy_file(spec.image.rootfs, path, cow=self.pool.cow, mode=0o600)
            except CopyError:
                if not path.exists():  # else a concurrent boot of the same image made it first
                    raise
            self._prune_image_copies(keep=tdir)
        return path

    def _prune_image_copies(self, keep: Path, newest: int = 2) -> None:
        """Drop pool copies of older images. Safe at any time: disks made from them are reflinks and
        keep their extents; only the next boot of a dropped image pays for one more copy."""
        copies = [p for p in self.pool.templates_dir.glob(_IMAGE_PREFIX + "*") if p.is_dir() and p != keep]
        copies.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for old in copies[max(0, newest - 1):]:
            self.pool.remove_template(old.name)

    async def _boot(self, binary: str, spec: VMSpec, sid: str, accel: Accelerator,
                    within: float) -> QemuSandbox:
        if not 16 <= spec.memory_mib <= 1024 * 1024 or not 1 <= spec.vcpus <= 64:
            raise BootError(f"memory_mib must be 16..1048576 and vcpus 1..64, got {spec.memory_mib} MiB, "
                            f"{spec.vcpus} vCPUs")
        self._check_image(spec.image)
        owner = self._owner()
        pool_dir = self.pool.sandbox_dir(sid, create=True, owner=owner)
        try:
            rootfs = await asyncio.to_thread(self._pool_rootfs, spec)
            disk = await asyncio.to_thread(private_disk, rootfs, pool_dir / "disk.img",
                                           size_mib=spec.disk_size_mib, owner=owner)
            ram = pool_dir / RAM_FILE
            create_ram_file(ram, spec.memory_mib, owner=owner)
            files = _VmFiles(spec=spec, pool_dir=pool_dir, disk=disk.path, ram=ram, shared_ram=True,
                             parent=None)
            return await self._launch(binary, spec, sid, accel, within, files=files, owner=owner,
                                      extra_args=memory_backend_args(spec.memory_mib, ram, share=True),
                                      disk_cow=disk.cow)
        except BaseException:
            await asyncio.to_thread(self.pool.remove_sandbox, sid)
            raise

    async def _launch(self, binary: str, spec: VMSpec, sid: str, accel: Accelerator, within: float, *,
                      files: _VmFiles, owner: tuple[int, int] | None, extra_args: list[str], disk_cow: bool,
                      plan: RestorePlan | None = None, extra_groups: tuple[int, ...] = (),
                      refresh: bool = True) -> SnapshotSandbox:
        """Start QEMU on prepared files; with ``plan``, load the snapshot and refresh the guest first.

        With ``spec.network``, the tap is opened here and its descriptor passed to QEMU. A restored NIC keeps
        the snapshot's MAC and device state; only its backend (the tap) is new, so the guest's address and
        route are set again for this tap's subnet."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + within
        vmdir = VmDir(self.vms_dir / sid)
        try:
            vmdir.check_socket_paths()
        except ValueError as exc:
            raise BootError(str(exc)) from exc
        self._check_image(spec.image)
        try:
            vmdir.create(owner)
        except FileExistsError:
            raise BootError(f"sandbox {sid} already exists ({vmdir.root})") from None
        process: QemuProcess | None = None
        client: GuestClient | None = None
        tap_fd: int | None = None
        network = cast(TapNetwork, spec.network) if spec.network is not None else None
        try:
            if network is not None:
                tap_fd = await asyncio.to_thread(_open_tap, network)
            kernel = self._shared_file(spec.image.kernel, vmdir, owner)
            initrd = self._shared_file(spec.image.initrd, vmdir, owner)
            config = QemuConfig(
                binary=binary, accel=accel, kernel=kernel, initrd=initrd, disk=files.disk,
                qmp_socket=vmdir.qmp_socket, agent_socket=vmdir.agent_socket,
                memory_mib=spec.memory_mib, vcpus=spec.vcpus, tsc_khz=tsc_khz(),
                kernel_args=spec.kernel_args, name=sid, extra_args=tuple(extra_args), tap_fd=tap_fd,
                mac=network.mac if network is not None else None,
            )
            groups = [*self._kvm_groups(), *extra_groups] if accel is Accelerator.KVM else list(extra_groups)
            process = QemuProcess(build_argv(config), vmdir, user=owner, extra_groups=groups,
                                  console_limit=self.console_limit,
                                  pass_fds=(tap_fd,) if tap_fd is not None else ())
            await process.start()
            if tap_fd is not None:
                os.close(tap_fd)  # QEMU holds its own copy now
                tap_fd = None
            qmp = await process.connect_qmp(max(1.0, deadline - loop.time()))
            if plan is not None:
                async with asyncio.timeout(max(1.0, deadline - loop.time())):
                    await plan.load(qmp, time_limit=max(1.0, deadline - loop.time()))
            client = await self._connect_guest(process, vmdir, deadline)
            if plan is not None and refresh:
                await refresh_guest(client)
            if network is not None:
                await configure_guest_network(client, network)
            sandbox = SnapshotSandbox(sid, vmdir, process, client, accel,
                                      vm_uid=owner[0] if owner else None, disk_cow=disk_cow,
                                      boot_seconds=loop.time() - started)
            sandbox.files = files
        except BaseException as exc:
            if tap_fd is not None:
                os.close(tap_fd)
            detail = await abort_launch(process, client, vmdir)
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(exc, (SnapshotError, BootError)):
                raise
            what = "restore" if plan is not None else "boot"
            raise BootError(f"{what} of {sid} ({accel.value}) failed: {exc}{detail}", sandbox_id=sid) from exc
        sandbox._watcher = asyncio.create_task(sandbox._watch(), name=f"watch-{sid}")
        self._sandboxes[sid] = sandbox
        _log.info("sandbox %s %s in %.3fs (accel %s, pid %s)", sid, "restored" if plan else "booted",
                  sandbox.boot_seconds, accel.value, process.pid)
        return sandbox

    # -- snapshots ---------------------------------------------------------------------------------------

    async def snapshot(self, sandbox: Sandbox, dest: Path | str | None = None, *, resume: bool = True,
                       labels: dict[str, str] | None = None, content_digest: bool = False) -> Snapshot:
        """Snapshot a running sandbox into ``dest`` (default: a new id under the pool's snapshots/).

        ``resume=False`` leaves the VM stopped (pause: the caller destroys it next).
        """
        if not isinstance(sandbox, QemuSandbox) or self._sandboxes.get(sandbox.id) is not sandbox:
            raise SnapshotError(f"{sandbox!r} is not a sandbox of this runtime", code="invalid_state",
                                status=409)
        if not isinstance(sandbox, SnapshotSandbox):
            raise SnapshotError(f"sandbox {sandbox.id} was not started by this runtime's storage pool",
                                code="snapshot_unsupported", status=409)
        if isinstance(dest, str):
            dest = self.pool.snapshot_dir(dest)
        elif dest is None:
            dest = self.pool.snapshot_dir(new_id("snap"))
        async with sandbox._lock:
            if sandbox.state is not SandboxState.RUNNING:
                raise SnapshotError(f"sandbox {sandbox.id} is {sandbox.state.value}, cannot snapshot it",
                                    code="invalid_state", status=409)
            files = sandbox.files
            version: str | None = None
            with contextlib.suppress(HostInfoError):
                version = qemu_version()
            try:
                # A monitor that stops answering must not hang the caller forever.
                async with asyncio.timeout(self.snapshot_timeout):
                    manifest = await save_snapshot(
                        sandbox.qmp, dest, disk=files.disk, ram=files.ram if files.shared_ram else None,
                        clone=self.pool.clone, memory_mib=files.spec.memory_mib, vcpus=files.spec.vcpus,
                        accel=sandbox.accelerator.value, image_digest=files.spec.image.digest,
                        qemu_version=version, machine=self._machine(files.spec, sandbox.accelerator),
                        parent=files.parent, labels=labels, resume=resume,
                        content_digest=content_digest, time_limit=self.snapshot_timeout,
                    )
            except TimeoutError:
                raise SnapshotError(f"snapshot of {sandbox.id} did not finish within "
                                    f"{self.snapshot_timeout:.0f}s", code="snapshot_timeout") from None
        # The sandbox's state now descends from this snapshot.
        files.parent = manifest.id
        if resume:
            # The guest clock stood still while the VM was stopped.
            with contextlib.suppress(Exception):
                await sandbox.guest.set_clock()
        return Snapshot(dest, manifest)

    async def pause(self, sandbox: QemuSandbox, dest: Path | str | None = None, *,
                    labels: dict[str, str] | None = None) -> Snapshot:
        """Snapshot the sandbox and destroy it: the session's state lives on only in the snapshot."""
        snap = await self.snapshot(sandbox, dest, resume=False, labels=labels)
        await self.destroy(sandbox)
        return snap

    @staticmethod
    def _machine(spec: VMSpec, accel: Accelerator) -> str:
        """What the migration stream depends on: the command line minus paths, names and host facts.

        A NIC counts with its MAC (which travels in the device state), not with its tap descriptor."""
        placeholder = Path("/p")
        mac = getattr(spec.network, "mac", None) if spec.network is not None else None
        config = QemuConfig(binary="qemu", accel=accel, kernel=placeholder, initrd=placeholder,
                            disk=placeholder, qmp_socket=placeholder, agent_socket=placeholder,
                            memory_mib=spec.memory_mib, vcpus=spec.vcpus, kernel_args=spec.kernel_args,
                            tap_fd=3 if spec.network is not None else None, mac=mac)
        return "sha256:" + hashlib.sha256("\0".join(build_argv(config)).encode()).hexdigest()

    def _snapshot(self, snapshot: Snapshot | Path | str) -> Snapshot:
        if isinstance(snapshot, Snapshot):
            return snapshot
        path = self.pool.snapshot_dir(snapshot) if isinstance(snapshot, str) else snapshot
        return Snapshot.open(path)

    def _grant_private_ram(self, snap: Snapshot) -> tuple[int, ...]:
        """Let VM uids open the frozen RAM file (they map it privately): a group only they join."""
        ram = snap.path / RAM_FILE
        if not self.drop_privileges or snap.manifest.ram is None:
            return ()
        gid = ram.stat().st_gid
        if gid == 0:
            # A range of its own, below the VM uids, so no VM's own uid/gid can ever be this group.
            gid = VM_UID_BASE - 1 - secrets.randbelow(_SNAPSHOT_GID_COUNT)
            os.chown(ram, 0, gid)
        os.chmod(ram, 0o660)
        os.chmod(snap.path, 0o711)
        return (gid,)

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

    @property
    def templates_dir(self) -> Path:
        return self.pool.templates_dir

    def open_snapshot(self, snapshot_id: str) -> Snapshot:
        if not is_id(snapshot_id, "snap"):
            raise CapsaError(f"snapshot {snapshot_id!r} not found", code="snapshot_not_found", status=404)
        path = self.pool.snapshot_dir(snapshot_id)
        if not path.is_dir():
            raise CapsaError(f"snapshot {snapshot_id} not found", code="snapshot_not_found", status=404)
        return Snapshot.open(path)

    def list_snapshot_ids(self) -> list[str]:
        return [sid for sid in self.pool.list_snapshots() if is_id(sid, "snap")]

    async def restore(self, snapshot: Snapshot | Path | str, spec: VMSpec, *, sandbox_id: str | None = None,
                      ram_mode: RamMode = RamMode.COPY, refresh: bool = True) -> SnapshotSandbox:
        """A new running sandbox from ``snapshot``. ``refresh=False`` skips the reseed and clock (tests)."""
        if self._closed:
            raise RuntimeError_("the runtime is closed")
        if spec.network is not None and not all(hasattr(spec.network, a) for a in _NETWORK_FIELDS):
            raise BootError(f"spec.network must describe a tap ({', '.join(_NETWORK_FIELDS)}), "
                            f"got {spec.network!r}")
        snap = await asyncio.to_thread(self._snapshot, snapshot)
        sid = sandbox_id or new_id("sbx")
        if not _SANDBOX_ID_RE.match(sid):
            raise BootError(f"invalid sandbox id {sid!r}")
        if sid in self._sandboxes or sid in self._booting:
            raise BootError(f"sandbox {sid} already exists")
        try:
            binary = qemu_binary()
        except HostInfoError as exc:
            raise BootError(str(exc)) from exc
        accel = self._check_restorable(snap, spec)
        self._booting.add(sid)
        owner = self._owner()
        try:
            pool_dir = self.pool.sandbox_dir(sid, create=True, owner=owner)
            try:
                plan = await asyncio.to_thread(
                    plan_restore, snap.path, pool_dir, clone=self.pool.clone, mode=ram_mode, owner=owner,
                    memory_mib=spec.memory_mib, vcpus=spec.vcpus, image_digest=spec.image.digest)
                groups: tuple[int, ...] = ()
                if ram_mode is RamMode.PRIVATE:
                    # Concurrent branches must agree on one group for the file.
                    async with self._grant_lock:
                        groups = await asyncio.to_thread(self._grant_private_ram, snap)
                files = _VmFiles(spec=spec, pool_dir=pool_dir, disk=plan.disk, ram=plan.ram,
                                 shared_ram=plan.shared_ram, parent=snap.id)
                return await self._launch(binary, spec, sid, accel, self.boot_timeout, files=files,
                                          owner=owner, extra_args=list(plan.extra_args),
                                          disk_cow=self.pool.cow, plan=plan, extra_groups=groups,
                                          refresh=refresh)
            except BaseException:
                await asyncio.to_thread(self.pool.remove_sandbox, sid)
                raise
        finally:
            self._booting.discard(sid)

    async def branch(self, snapshot: Snapshot | Path | str, n: int, spec: VMSpec, *,
                     ram_mode: RamMode = RamMode.PRIVATE) -> list[SnapshotSandbox]:
        """``n`` independent sandboxes from one snapshot, restored concurrently. All or nothing."""
        check_branch_count(n)
        snap = await asyncio.to_thread(self._snapshot, snapshot)
        results = await asyncio.gather(*(self.restore(snap, spec, ram_mode=ram_mode) for _ in range(n)),
                                       return_exceptions=True)
        made = [r for r in results if isinstance(r, SnapshotSandbox)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(self.destroy(sb) for sb in made), return_exceptions=True)
            raise errors[0]
        return made

    # -- teardown ----------------------------------------------------------------------------------------

    async def destroy(self, sandbox: object) -> None:
        await super().destroy(sandbox)
        if isinstance(sandbox, SnapshotSandbox):
            await asyncio.to_thread(self.pool.remove_sandbox, sandbox.id)

    async def cleanup_orphans(self) -> list[str]:
        removed = await super().cleanup_orphans()
        keep = set(self._sandboxes) | self._booting
        for sid in await asyncio.to_thread(self.pool.prune_sandboxes, keep):
            removed.append(f"{sid}: removed pool files")
        return removed

    def delete_snapshot(self, snapshot: Snapshot | Path | str) -> bool:
        sid = snapshot.id if isinstance(snapshot, Snapshot) else Path(snapshot).name
        return self.pool.remove_snapshot(sid)


if TYPE_CHECKING:
    def _is_snapshot_capable(runtime: SnapshotRuntime) -> SnapshotCapable:
        return runtime  # mypy checks that the runtime provides every SnapshotCapable operation
