"""capsa.guest.quiet.set_sysctls writes every setting it names and reports the ones a kernel lacks (the
PIT half runs only in a VM: tests/integration/test_guest_idle.py)."""

from __future__ import annotations

from pathlib import Path

from capsa.guest import quiet


def test_every_sysctl_is_written_and_missing_ones_are_reported(tmp_path: Path) -> None:
    # A kernel without the lockup watchdog has no /proc/sys/kernel/watchdog (nor, here, kernel/).
    present = tuple(entry for entry in quiet.SYSCTLS if entry[0].startswith("vm/"))
    for name, _ in present:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("old")
    assert quiet.set_sysctls(str(tmp_path)) == ["kernel/watchdog"]
    assert {name: (tmp_path / name).read_text() for name, _ in present} == dict(present)
