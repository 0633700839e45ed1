"""capsa.guest.cgroups.born_in_command_group, on a directory tree standing in for cgroupfs: the daemon
steps into a fresh group for the fork and back into 'agent' after it, whatever the fork did; the group
is found by the command's pid; a fork refused for the process cap starts nothing and says so.

The real kernel behaviour (a child born in the group, the daemon's score restored) is shown in a VM by
tests/integration/test_guest_spawn_cgroup.py."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from capsa.guest import cgroups


@dataclass
class FakeProc:
    pid: int


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("agent", "work"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(cgroups, "AGENT", str(tmp_path / "agent"))
    monkeypatch.setattr(cgroups, "WORK", str(tmp_path / "work"))
    monkeypatch.setattr(cgroups, "_SELF_OOM", str(tmp_path / "oom_score_adj"))
    monkeypatch.setattr(cgroups, "_ACTIVE", True)
    monkeypatch.setattr(cgroups, "_BORN", {})
    real_rmdir = os.rmdir

    def rmdir(path: str) -> None:
        # cgroupfs removes a group whose only entries are its interface files; a directory does not.
        for control in ("cgroup.procs", "memory.oom.group"):
            if os.path.exists(os.path.join(path, control)) and not set(os.listdir(path)) - {
                    "cgroup.procs", "memory.oom.group"}:
                os.unlink(os.path.join(path, control))
        real_rmdir(path)

    monkeypatch.setattr(os, "rmdir", rmdir)
    return tmp_path


def _where(tree: Path) -> tuple[list[str], str]:
    """Groups that list the daemon ("0" written to their cgroup.procs last), and its OOM score."""
    inside = sorted(str(p.parent.relative_to(tree))
                    for p in tree.rglob("cgroup.procs") if p.read_text() == "0")
    return inside, (tree / "oom_score_adj").read_text()


def test_the_fork_happens_inside_a_fresh_group_and_the_daemon_goes_home(tree: Path) -> None:
    seen: list[tuple[list[str], str]] = []
    oom_group: list[str] = []

    def start() -> FakeProc:
        seen.append(_where(tree))
        oom_group.append((tree / seen[0][0][0] / "memory.oom.group").read_text())
        return FakeProc(4242)

    proc = cgroups.born_in_command_group(start)
    assert proc.pid == 4242
    (staged,), score = seen[0]
    assert staged.startswith("work/n") and score == "0"
    assert oom_group == ["1"]
    (tree / staged / "cgroup.procs").write_text("4242")  # now the child's entry, not the daemon's
    assert _where(tree) == (["agent"], "-1000")
    assert cgroups._command_group(4242) == str(tree / staged)
    cgroups.forget_command(4242)
    assert os.listdir(tree / "work") == [] and cgroups._command_group(4242) == str(tree / "work/c4242")


def test_a_group_left_busy_stays_and_the_pid_is_free_for_the_next_command(tree: Path) -> None:
    cgroups.born_in_command_group(lambda: FakeProc(77))
    group = Path(cgroups._command_group(77))
    (group / "left").write_text("a process the command left running")
    cgroups.forget_command(77)
    assert group.is_dir() and cgroups._command_group(77) == str(tree / "work/c77")
    cgroups.born_in_command_group(lambda: FakeProc(77))
    assert Path(cgroups._command_group(77)) not in (group, tree / "work/c77")


def test_a_fork_refused_for_the_process_cap_starts_nothing(tree: Path) -> None:
    def start() -> FakeProc:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    with pytest.raises(cgroups.Unplaced, match="process cap"):
        cgroups.born_in_command_group(start)
    assert os.listdir(tree / "work") == []
    assert _where(tree) == (["agent"], "-1000")


def test_other_failures_propagate_and_the_daemon_still_goes_home(tree: Path) -> None:
    def start() -> FakeProc:
        raise FileNotFoundError(2, "No such file or directory", "nope")

    with pytest.raises(FileNotFoundError):
        cgroups.born_in_command_group(start)
    assert os.listdir(tree / "work") == []
    assert _where(tree) == (["agent"], "-1000")


def test_a_group_that_cannot_be_made_is_unplaced_and_nothing_runs(tree: Path) -> None:
    (tree / "work").rmdir()
    ran: list[int] = []

    def start() -> FakeProc:
        ran.append(1)
        return FakeProc(1)

    with pytest.raises(cgroups.Unplaced):
        cgroups.born_in_command_group(start)
    assert ran == []


def test_a_daemon_that_does_not_manage_cgroups_just_starts(
        tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "_ACTIVE", False)
    assert cgroups.born_in_command_group(lambda: FakeProc(5)).pid == 5
    assert os.listdir(tree / "work") == [] and not (tree / "oom_score_adj").exists()
