"""The QEMU command line the driver builds (shape, accelerator specifics, refusing bad input)."""

from __future__ import annotations

from pathlib import Path

import pytest

from capsa.node.runtime.base import Accelerator
from capsa.node.runtime.qemu.cmdline import (
    SANDBOX_OPTIONS,
    QemuConfig,
    build_argv,
    kernel_cmdline,
    tcg_cache_mib,
)


def _config(**overrides: object) -> QemuConfig:
    base: dict[str, object] = dict(
        binary="/usr/bin/qemu-system-x86_64", accel=Accelerator.TCG, kernel=Path("/img/vmlinux"),
        initrd=Path("/img/initrd.cpio.gz"), disk=Path("/vm/disk.img"), qmp_socket=Path("/vm/run/qmp.sock"),
        agent_socket=Path("/vm/run/agent.sock"), memory_mib=384, vcpus=2, tsc_khz=2299998,
    )
    base.update(overrides)
    return QemuConfig(**base)  # type: ignore[arg-type]


def _option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_tcg_command_line() -> None:
    argv = build_argv(_config())
    assert argv[0] == "/usr/bin/qemu-system-x86_64"
    machine = _option(argv, "-M")[0]
    assert machine.startswith("microvm,") and "acpi=on" in machine and "pit=on" in machine
    assert _option(argv, "-accel") == ["tcg,thread=multi,tb-size=128"]
    assert _option(build_argv(_config(tcg_tb_mib=None)), "-accel") == ["tcg,thread=multi"]
    assert _option(argv, "-cpu") == ["max"]
    assert _option(argv, "-m") == ["384M"] and _option(argv, "-smp") == ["2"]
    for flag in ("-nodefaults", "-no-user-config", "-no-reboot"):
        assert flag in argv
    assert _option(argv, "-display") == ["none"]
    assert _option(argv, "-sandbox") == [SANDBOX_OPTIONS]
    assert "elevateprivileges=deny" in SANDBOX_OPTIONS and "spawn=deny" in SANDBOX_OPTIONS
    assert "tsc_early_khz=2299998" in _option(argv, "-append")[0]
    assert "capsa.device=/dev/vport1p1" in _option(argv, "-append")[0]
    assert _option(argv, "-qmp") == ["unix:/vm/run/qmp.sock,server=on,wait=off"]
    assert "socket,id=agent,path=/vm/run/agent.sock,server=on,wait=off" in _option(argv, "-chardev")
    assert "virtserialport,chardev=agent,name=agent0,nr=1" in _option(argv, "-device")
    assert any(d.startswith("id=root,file=/vm/disk.img,format=raw") for d in _option(argv, "-drive"))


def test_translation_cache_follows_guest_memory() -> None:
    assert [tcg_cache_mib(m) for m in (128, 256, 512, 1024, 2048, 4096)] == [128, 128, 128, 512, 1024, 1024]
    argv = build_argv(_config(memory_mib=1024, tcg_tb_mib=tcg_cache_mib(1024)))
    assert _option(argv, "-accel") == ["tcg,thread=multi,tb-size=512"]


def test_no_network_device_unless_asked() -> None:
    argv = build_argv(_config())
    assert "-netdev" not in argv
    assert not any("virtio-net" in d for d in _option(argv, "-device"))
    with_net = build_argv(_config(tap_fd=5, mac="52:54:00:12:34:56"))
    assert _option(with_net, "-netdev") == ["tap,id=net0,fd=5,vhost=off"]
    assert "virtio-net-device,netdev=net0,mac=52:54:00:12:34:56" in _option(with_net, "-device")


def test_kvm_command_line() -> None:
    argv = build_argv(_config(accel=Accelerator.KVM))
    assert _option(argv, "-accel") == ["kvm"]
    assert _option(argv, "-cpu") == ["host,-arch-capabilities"]
    machine = _option(argv, "-M")[0]
    assert "pit=off" in machine and "pic=off" in machine
    assert "tsc_early_khz" not in _option(argv, "-append")[0]


def test_kernel_cmdline_appends_extra_args() -> None:
    line = kernel_cmdline(_config(kernel_args=("capsa.hostname=box",), tsc_khz=None))
    assert line.startswith("console=ttyS0 root=/dev/vda")
    assert line.endswith("capsa.hostname=box")
    assert "tsc_early_khz" not in line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"accel": Accelerator.AUTO}, "concrete accelerator"),
        ({"memory_mib": 8}, "memory_mib"),
        ({"vcpus": 0}, "vcpus"),
        ({"vcpus": 65}, "vcpus"),
        ({"kernel_args": ("a b",)}, "whitespace"),
        ({"kernel_args": ("",)}, "empty"),
        ({"disk": Path("/vm/disk,format=qcow2")}, "contains ','"),
    ],
)
def test_bad_config_is_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**overrides)
