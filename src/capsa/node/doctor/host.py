"""Checks of the machine: the accelerator VMs would get, QEMU, btrfs and loop devices for the storage pool,
nftables for the sandbox firewall, cgroups, and the user QEMU runs as."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from capsa.node.doctor.report import Check, DoctorConfig, run_command, vm_user
from capsa.node.net.sandbox_net import GUEST_SUBNET, SandboxNet, ServicePorts, render_ruleset
from capsa.node.runtime.accel import parse_accel
from capsa.node.runtime.base import Accelerator, BootError, VMSpec
from capsa.node.runtime.hostinfo import HostInfoError, qemu_binary, qemu_version
from capsa.node.runtime.qemu import QemuRuntime, WorkdirStorage
from capsa.node.runtime.qemu.process import QemuProcessError, isolation_prefix
from capsa.node.runtime.workdir import VM_UID_BASE
from capsa.node.storage.filecopy import probe_reflink
from capsa.node.storage.mounts import filesystem_of, mounts

__all__ = ["MIN_QEMU", "REQUIRED_CGROUP_CONTROLLERS", "accelerator", "btrfs", "cgroups", "nftables", "qemu",
           "qemu_user"]

MIN_QEMU = (7, 2)
"""The oldest QEMU the node is run and tested with (Debian 12's): the runtime relies on ``-M microvm`` with
ACPI, ``x-ignore-shared`` migration through a passed descriptor and ``-sandbox ...,spawn=deny``, and a
snapshot's device layout is only comparable within one QEMU."""

REQUIRED_CGROUP_CONTROLLERS: tuple[str, ...] = ()
"""Host cgroup v2 controllers the node needs: none today. The node makes no host cgroup per VM (QEMU is
bounded by ``-m`` and ``-smp``); the cgroups that bound a sandbox's commands are inside its VM. A node that
starts placing VMs in host cgroups names the controllers here, and the check then requires them."""

_LOOP_CONTROL = Path("/dev/loop-control")
_KVM_FIX = ("give the VM users read-write access to /dev/kvm (a kvm group and mode 0660: VMs get the "
            "device's group), or set CAPSA_ACCEL=auto to fall back to TCG")


def _qemu_missing(exc: Exception) -> Check:
    return Check("qemu", False, str(exc), "apt-get install qemu-system-x86 (Debian 12: QEMU 7.2)")


async def accelerator(cfg: DoctorConfig) -> Check:
    """The accelerator the node's VMs would get, settled by the runtime exactly as a first boot settles it
    (and cached the same way): a KVM probe boot where the VM user can open /dev/kvm, else TCG."""
    name = "accelerator"
    try:
        requested = parse_accel(cfg.settings.accel)
        binary = qemu_binary()
    except (ValueError, HostInfoError) as exc:
        return Check(name, False, str(exc), "set CAPSA_ACCEL (or --accel) to auto, kvm or tcg, and install "
                                            "qemu-system-x86")
    # A probe boot's VM directory lives in a scratch state dir, removed afterwards; the decision is
    # cached in the real cache dir, where the node's runtime reads it.
    scratch = Path(cfg.settings.cache_dir) / f".doctor-{secrets.token_hex(4)}"
    runtime = QemuRuntime(cfg.settings.model_copy(update={"state_dir": scratch}), accel=requested,
                          storage=WorkdirStorage())
    try:
        decision = await runtime.settle_accelerator(VMSpec(image=cfg.image) if cfg.image else None)
    except BootError as exc:
        fix = (_KVM_FIX if exc.code in ("kvm_unavailable", "kvm_boot_failed") else
               "the guest image does not boot (the log has QEMU's output): rebuild it with "
               "`capsa image build --force`")
        return Check(name, False, str(exc).splitlines()[0], fix)
    finally:
        await runtime.close()
        await asyncio.to_thread(shutil.rmtree, scratch, True)
    if decision is None:
        return Check(name, True, "kvm: /dev/kvm opens for the VM user; whether a guest boots under it is "
                                 "settled by a probe boot on the first start (no guest image built yet)")
    if decision.accel is Accelerator.KVM:
        return Check(name, True, f"kvm ({decision.reason})")
    code, out = await run_command([binary, "-accel", "help"])
    if code != 0 or "tcg" not in out.split():
        return Check(name, False, f"tcg ({decision.reason}), but {binary} lists no tcg accelerator: {out}",
                     "install Debian's qemu-system-x86, whose QEMU has TCG")
    if requested is Accelerator.TCG:
        return Check(name, True, "tcg (requested: software emulation, slower than kvm)")
    return Check(name, True, f"tcg, the fallback (software emulation): {decision.reason}")


async def qemu(cfg: DoctorConfig) -> Check:
    """QEMU is installed, at least :data:`MIN_QEMU`, with the microvm machine."""
    try:
        binary = qemu_binary()
        version = await asyncio.to_thread(qemu_version, binary)
    except HostInfoError as exc:
        return _qemu_missing(exc)
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    wanted = ".".join(map(str, MIN_QEMU))
    if numbers < MIN_QEMU:
        return Check("qemu", False, f"{binary} is QEMU {version}; capsa needs {wanted} or newer",
                     f"install QEMU {wanted} or newer (Debian 12's qemu-system-x86)")
    code, out = await run_command([binary, "-machine", "help"])
    if code != 0 or not re.search(r"^microvm\b", out, re.MULTILINE):
        return Check("qemu", False, f"{binary} (QEMU {version}) has no microvm machine",
                     "install Debian's qemu-system-x86, built with the microvm machine")
    return Check("qemu", True, f"{binary}: QEMU {version} (>= {wanted}), microvm machine present")


async def btrfs(cfg: DoctorConfig) -> Check:
    """The storage pool can be copy-on-write: a configured directory that reflinks, or what the loop pool
    needs (mkfs.btrfs, btrfs in the kernel, root, a free loop device)."""
    name = "btrfs"
    path = cfg.storage.path
    if path is not None:
        if not path.is_dir():
            return Check(name, False, f"CAPSA_STORAGE_PATH {path} is not a directory",
                         "point CAPSA_STORAGE_PATH at an existing btrfs directory, or unset it (loop pool)")
        fstype = filesystem_of(path).fstype
        if not await asyncio.to_thread(probe_reflink, path):
            return Check(name, False, f"CAPSA_STORAGE_PATH {path} is on {fstype}, which cannot reflink: "
                                      "sandbox disks and snapshots would be full copies",
                         "point CAPSA_STORAGE_PATH at a btrfs directory, or unset it (a btrfs loop pool)")
        return Check(name, True, f"CAPSA_STORAGE_PATH {path} on {fstype} reflinks")
    mkfs = shutil.which("mkfs.btrfs")
    if mkfs is None:
        return Check(name, False, "mkfs.btrfs not found: the node cannot make its btrfs loop pool",
                     "apt-get install btrfs-progs")
    if not await _kernel_has_btrfs():
        return Check(name, False, "the kernel has no btrfs (not in /proc/filesystems, no module)",
                     "modprobe btrfs, or run a kernel with btrfs")
    pool = (cfg.state_dir / "storage" / "pool").resolve()
    if any(m.mount_point == pool and m.fstype == "btrfs" for m in mounts()):
        return Check(name, True, f"{mkfs} present; the loop pool is mounted at {pool}")
    if os.geteuid() != 0:
        return Check(name, False, "mounting the btrfs loop pool needs root",
                     "run the node as root, or set CAPSA_STORAGE_PATH to a btrfs directory")
    code, out = (await run_command(["losetup", "-f"]) if _is_char_device(_LOOP_CONTROL)
                 else (1, f"{_LOOP_CONTROL} missing"))
    if code != 0:
        return Check(name, False, f"no free loop device ({out})",
                     "modprobe loop; in a container, run it privileged with /dev/loop-control and /dev/loop*")
    return Check(name, True, f"{mkfs} present, btrfs in the kernel, loop devices free ({out} next); the "
                             f"pool will be a sparse btrfs loop file under {cfg.state_dir / 'storage'}")


def _is_char_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(path.stat().st_mode)
    except OSError:
        return False


def _btrfs_registered() -> bool:
    try:
        return re.search(r"\bbtrfs$", Path("/proc/filesystems").read_text(), re.MULTILINE) is not None
    except OSError:
        return False


async def _kernel_has_btrfs() -> bool:
    """btrfs is registered, or its module can be loaded (mounting loads it)."""
    return _btrfs_registered() or (await run_command(["modprobe", "-n", "-q", "btrfs"]))[0] == 0


async def nftables(cfg: DoctorConfig) -> Check:
    """The sandbox firewall (the very ruleset a sandbox gets, on a tap) loads in a scratch network
    namespace, which disappears with the process that made it."""
    name = "nftables"
    for tool, package in (("nft", "nftables"), ("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return Check(name, False, f"{tool} not found", f"apt-get install {package}")
    if os.geteuid() != 0:
        return Check(name, False, "sandbox namespaces and nftables need root: sessions with an egress "
                                  "policy would be refused", "run the node as root")
    hosts = list(GUEST_SUBNET.hosts())
    tap = "cxdoctor" + secrets.token_hex(3)
    net = SandboxNet("doctor", "doctor", tap, str(hosts[1]), str(hosts[0]), GUEST_SUBNET.prefixlen,
                     "02:ca:00:00:00:01", ServicePorts())
    script = ('ip link set lo up && ip tuntap add dev "$1" mode tap && nft -f - '
              '&& nft list ruleset >/dev/null')
    code, out = await run_command(["unshare", "--net", "--", "/bin/sh", "-c", script, "sh", tap],
                                  stdin=f"flush ruleset\n{render_ruleset(net)}".encode())
    if code != 0:
        return Check(name, False, f"the sandbox firewall does not load in a scratch network namespace: "
                                  f"{' '.join(out.split())[:300]}",
                     "load the nf_tables, nft_nat and nft_ct modules (or run the node privileged)")
    _, version = await run_command(["nft", "--version"])
    return Check(name, True, f"the sandbox ruleset (netdev ingress, inet nat and filter) loads on a tap in "
                             f"a scratch network namespace ({version or 'nft'})")


async def cgroups(cfg: DoctorConfig) -> Check:
    """The host's cgroup v2 hierarchy has :data:`REQUIRED_CGROUP_CONTROLLERS`."""
    found = [m for m in mounts() if m.fstype == "cgroup2"]
    if not found:
        layout, available = "no cgroup v2 hierarchy (cgroup v1 only)", []
    else:
        root = found[0].mount_point
        layout = "cgroup v2" + ("" if root == Path("/sys/fs/cgroup") else f" at {root} (hybrid with v1)")
        try:
            available = (root / "cgroup.controllers").read_text().split()
        except OSError:
            available = []
    missing = [c for c in REQUIRED_CGROUP_CONTROLLERS if c not in available]
    listed = ", ".join(available) or "none"
    if missing:
        return Check("cgroups", False, f"{layout}: controllers {', '.join(missing)} missing (has: {listed})",
                     "boot with the unified cgroup v2 hierarchy (systemd.unified_cgroup_hierarchy=1)")
    need = ", ".join(REQUIRED_CGROUP_CONTROLLERS) or "none on the host: VMs are bounded by QEMU's -m/-smp"
    return Check("cgroups", True, f"{layout}, controllers: {listed}; capsa needs {need}")


async def qemu_user(cfg: DoctorConfig) -> Check:
    """QEMU can be started as it runs: as a per-VM uid with no supplementary groups, in a network namespace
    of its own (checked by starting a shell that way)."""
    name = "vm_user"
    user = vm_user()
    if user is None:
        return Check(name, False, f"the node is not root: QEMU would run as this user (uid {os.geteuid()}) "
                                  "for every sandbox, without a uid of its own per VM",
                     "run the node as root: it drops each QEMU to a per-VM uid")
    try:
        prefix = isolation_prefix(user, ())
    except QemuProcessError as exc:
        return Check(name, False, str(exc), "apt-get install util-linux")
    script = "id -u; id -G; tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\\n' ' '"
    code, out = await run_command([*prefix, "/bin/sh", "-c", script])
    lines = out.splitlines()
    if code != 0 or len(lines) < 3 or lines[0] != str(user[0]) or lines[1] != str(user[1]):
        return Check(name, False, f"cannot start a process as the VM user {user[0]} in a network namespace "
                                  f"of its own (unshare --net, setpriv): {' '.join(out.split())[:300]}",
                     "run the node as root with CAP_SYS_ADMIN and CAP_SETUID (privileged in a container)")
    links = lines[2].split()
    return Check(name, True, f"QEMU runs as per-VM uids from {VM_UID_BASE} (setpriv, no supplementary "
                             "groups; as root no user namespace is needed) in a network namespace of its "
                             f"own: a shell started so ran as uid {lines[0]}, groups {lines[1]}, links "
                             f"{', '.join(links) or 'none'}")
