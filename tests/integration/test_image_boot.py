"""Boot the real guest image under QEMU microvm (TCG here) and watch the serial console.

The runtime driver (capsa.node.runtime.qemu) has its own tests; these only check what the image
itself is responsible for: the initramfs loads the virtio drivers, mounts the root disk and hands
over to the requested init, and its failure paths print a clear message and power the VM off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from capsa.common.image import GuestImage

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed"),
]

PROBE = """#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sysfs /sys
echo "PROBE kernel=$(uname -r)"
python3 -c 'import platform, ssl; print("PROBE python=" + platform.python_version())'
echo "PROBE port=$(cat /sys/class/virtio-ports/vport*/name)"
for m in virtio_mmio virtio_blk virtio_net virtio_console; do
    grep -q "^$m " /proc/modules && echo "PROBE module=$m"
done
echo "PROBE root=$(awk '$2 == "/" {print $1 " " $3 " " $4}' /proc/mounts | cut -d, -f1)"
echo o >/proc/sysrq-trigger
"""


def _tsc_khz() -> int:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    return 0


def _boot(image: GuestImage, disk: Path, workdir: Path, extra_append: str = "",
          timeout: float = 180) -> tuple[int, str]:
    """Boot and wait for QEMU to exit on its own (the guest powers off); return (rc, console)."""
    serial = workdir / "serial.log"
    append = ("console=ttyS0 root=/dev/vda rw quiet loglevel=1 panic=-1 pci=off tsc=reliable no_timer_check "
              f"8250.nr_uarts=1 random.trust_cpu=on tsc_early_khz={_tsc_khz()} {extra_append}")
    argv = [
        "qemu-system-x86_64",
        "-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on,acpi=on,pit=on,pic=on",
        "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", "1", "-m", "256M",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", f"file:{serial}",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", append,
        "-drive", f"id=root,file={disk},format=raw,if=none,aio=threads,cache=writeback",
        "-device", "virtio-blk-device,drive=root",
        "-device", "virtio-serial-device,max_ports=2",
        "-chardev", f"socket,id=agent,path={workdir / 'agent.sock'},server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=agent0",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        console = serial.read_text(errors="replace")
        pytest.fail(f"guest did not power off within {timeout} s; console:\n{console}")
    console = serial.read_text(errors="replace") if serial.exists() else ""
    assert proc.returncode == 0, err.decode(errors="replace")
    return proc.returncode, console


def _private_disk(image: GuestImage, workdir: Path) -> Path:
    disk = workdir / "disk.ext4"
    subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(image.rootfs), str(disk)], check=True)
    return disk


def test_boots_into_the_root_filesystem(guest_image: GuestImage, tmp_path: Path) -> None:
    disk = _private_disk(guest_image, tmp_path)
    probe = tmp_path / "probe.sh"
    probe.write_text(PROBE)
    # Put the probe into the disk copy without mounting it. debugfs's `write` takes a name in the
    # current directory (and /sbin is a symlink on merged-/usr Debian), hence the cd.
    script = tmp_path / "debugfs.cmds"
    script.write_text(f"cd /usr/sbin\nwrite {probe} capsa-probe\nsif capsa-probe mode 0100755\n")
    subprocess.run(["debugfs", "-w", "-f", str(script), str(disk)], check=True, capture_output=True)
    _, console = _boot(guest_image, disk, tmp_path, "capsa.init=/sbin/capsa-probe")
    lines = [line.strip() for line in console.splitlines() if line.startswith("PROBE ")]
    assert f"PROBE kernel={guest_image.kernel_release}" in lines, console
    assert guest_image.kernel_release != os.uname().release
    assert any(line.startswith("PROBE python=3.11.") for line in lines), console
    assert "PROBE port=agent0" in lines, console
    for m in ("virtio_mmio", "virtio_blk", "virtio_net", "virtio_console"):
        assert f"PROBE module={m}" in lines, console
    assert "PROBE root=/dev/vda ext4 rw" in lines, console
    assert "FATAL" not in console


def test_missing_root_disk_is_reported_and_the_vm_powers_off(guest_image: GuestImage, tmp_path: Path) -> None:
    disk = _private_disk(guest_image, tmp_path)
    _, console = _boot(guest_image, disk, tmp_path, "root=/dev/vdz")
    assert "capsa-initramfs: FATAL: root disk /dev/vdz did not appear" in console
    assert "Kernel panic" not in console


def test_missing_init_is_reported_and_the_vm_powers_off(guest_image: GuestImage, tmp_path: Path) -> None:
    disk = _private_disk(guest_image, tmp_path)
    _, console = _boot(guest_image, disk, tmp_path, "capsa.init=/sbin/does-not-exist")
    assert "capsa-initramfs: FATAL: /sbin/does-not-exist is missing from the root filesystem" in console
    assert "Kernel panic" not in console
