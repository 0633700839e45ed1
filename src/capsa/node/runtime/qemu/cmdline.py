"""The QEMU microvm command line, built from a plain description of one VM (no side effects here)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from capsa.node.runtime.base import Accelerator

__all__ = [
    "AGENT_PORT_NAME",
    "AGENT_PORT_NUMBER",
    "GUEST_AGENT_DEVICE",
    "SANDBOX_OPTIONS",
    "QemuConfig",
    "build_argv",
    "kernel_cmdline",
    "machine_fingerprint",
    "tcg_cache_mib",
]

AGENT_PORT_NAME = "agent0"
# The guest has no udev, so /dev/virtio-ports/<name> never appears. The port's node is /dev/vport<D>p<P>,
# D being the virtio device index (the order of the virtio devices on the command line below: the disk is
# virtio0, the serial device virtio1) and P the port number, pinned with nr=. Keep the order in sync.
AGENT_PORT_NUMBER = 1
GUEST_AGENT_DEVICE = f"/dev/vport1p{AGENT_PORT_NUMBER}"

# Seccomp filter: no obsolete syscalls, no set*id, no fork/exec, no scheduler/affinity changes. QEMU needs
# none of those once started, so a compromised QEMU cannot use them either.
SANDBOX_OPTIONS = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

_BASE_KERNEL_ARGS = (
    "console=ttyS0",
    "root=/dev/vda",
    "rw",
    "quiet",
    "loglevel=1",
    # Reboot at once on panic; with -no-reboot QEMU then exits, which the runtime reports as a failure.
    "panic=-1",
    "pci=off",
    "tsc=reliable",
    "no_timer_check",
    "8250.nr_uarts=1",
    "random.trust_cpu=on",
)


@dataclass(frozen=True)
class QemuConfig:
    binary: str
    accel: Accelerator
    kernel: Path
    initrd: Path
    disk: Path
    qmp_socket: Path
    agent_socket: Path
    memory_mib: int = 256
    vcpus: int = 1
    tsc_khz: int | None = None
    kernel_args: Sequence[str] = ()
    name: str | None = None
    tcg_tb_mib: int | None = 128
    """TCG translation cache size (:func:`tcg_cache_mib` picks it per guest). QEMU's default (1 GiB) lets an
    idle VM's RSS grow by hundreds of MiB of translated code; a smaller cache costs some retranslation.
    None keeps QEMU's default. Not part of the migration stream, so not of :func:`machine_fingerprint`."""
    tap_fd: int | None = None  # an already-open tap device (networking); None = no NIC at all
    mac: str | None = None
    extra_args: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.accel is Accelerator.AUTO:
            raise ValueError("QemuConfig needs a concrete accelerator (kvm or tcg), not auto")
        if not 16 <= self.memory_mib <= 1024 * 1024:
            raise ValueError(f"memory_mib must be between 16 and 1048576, got {self.memory_mib}")
        if not 1 <= self.vcpus <= 64:
            raise ValueError(f"vcpus must be between 1 and 64, got {self.vcpus}")
        for arg in self.kernel_args:
            if not arg or any(c.isspace() for c in arg):
                raise ValueError(f"kernel argument {arg!r} is empty or contains whitespace")
        for path in (self.kernel, self.initrd, self.disk, self.qmp_socket, self.agent_socket):
            # QEMU's option parser treats ',' as a separator; a path containing one would change the meaning.
            if "," in str(path):
                raise ValueError(f"path {path} contains ',', which QEMU options cannot express")


def tcg_cache_mib(memory_mib: int) -> int:
    """The TCG translation cache for a guest of ``memory_mib``: 128 MiB up to 512 MiB of memory (a base
    guest's working set of code fits), half the memory above (at most 1 GiB). A guest running a browser
    executes far more code: when the cache fills, QEMU drops every translation and starts over, so a cache
    smaller than the working set makes each page load and screenshot pay for translation again. The host
    memory is only spent as code is translated."""
    return 128 if memory_mib <= 512 else min(1024, memory_mib // 2)


def kernel_cmdline(config: QemuConfig) -> str:
    args = list(_BASE_KERNEL_ARGS)
    args.append(f"capsa.device={GUEST_AGENT_DEVICE}")
    if config.accel is Accelerator.TCG and config.tsc_khz:
        # Under TCG the guest cannot calibrate its TSC on its own (RECIPES.md).
        args.append(f"tsc_early_khz={config.tsc_khz}")
    args.extend(config.kernel_args)
    return " ".join(args)


def build_argv(config: QemuConfig) -> list[str]:
    if config.accel is Accelerator.KVM:
        machine = "microvm,x-option-roms=off,isa-serial=on,rtc=on,acpi=on,pit=off,pic=off"
        accel = ["-accel", "kvm", "-cpu", "host,-arch-capabilities"]
    else:
        machine = "microvm,x-option-roms=off,isa-serial=on,rtc=on,acpi=on,pit=on,pic=on"
        tcg = "tcg,thread=multi" + (f",tb-size={config.tcg_tb_mib}" if config.tcg_tb_mib else "")
        accel = ["-accel", tcg, "-cpu", "max"]
    argv = [
        config.binary,
        "-M", machine,
        *accel,
        "-smp", str(config.vcpus),
        "-m", f"{config.memory_mib}M",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-no-reboot",
        "-sandbox", SANDBOX_OPTIONS,
    ]
    if config.name:
        argv += ["-name", config.name]
    argv += [
        # The serial console goes to QEMU's stdout, a pipe the runtime reads into a size-bounded log.
        "-chardev", "stdio,id=console,signal=off",
        "-serial", "chardev:console",
        "-qmp", f"unix:{config.qmp_socket},server=on,wait=off",
        "-kernel", str(config.kernel),
        "-initrd", str(config.initrd),
        "-append", kernel_cmdline(config),
        "-drive", f"id=root,file={config.disk},format=raw,if=none,aio=threads,cache=writeback,discard=unmap",
        "-device", "virtio-blk-device,drive=root",
        "-device", "virtio-serial-device,max_ports=2",
        "-chardev", f"socket,id=agent,path={config.agent_socket},server=on,wait=off",
        "-device", f"virtserialport,chardev=agent,name={AGENT_PORT_NAME},nr={AGENT_PORT_NUMBER}",
    ]
    if config.tap_fd is not None:
        mac = f",mac={config.mac}" if config.mac else ""
        argv += [
            "-netdev", f"tap,id=net0,fd={config.tap_fd},vhost=off",
            "-device", f"virtio-net-device,netdev=net0{mac}",
        ]
    argv += list(config.extra_args)
    return argv


def machine_fingerprint(accel: Accelerator, *, memory_mib: int, vcpus: int, kernel_args: Sequence[str] = (),
                        mac: str | None = None, nic: bool = False) -> str:
    """What a migration stream depends on: the command line minus paths, names and host facts.

    A NIC counts with its MAC (which travels in the device state), not with its tap descriptor."""
    placeholder = Path("/p")
    # tcg_tb_mib stays at its default: the translation cache's size does not change the stream.
    config = QemuConfig(binary="qemu", accel=accel, kernel=placeholder, initrd=placeholder, disk=placeholder,
                        qmp_socket=placeholder, agent_socket=placeholder, memory_mib=memory_mib, vcpus=vcpus,
                        kernel_args=tuple(kernel_args), tap_fd=3 if nic else None, mac=mac)
    return "sha256:" + hashlib.sha256("\0".join(build_argv(config)).encode()).hexdigest()
