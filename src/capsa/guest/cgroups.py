"""Keep the guest controllable when user commands misbehave (fork bombs, CPU hogs, memory hogs).

init puts itself and the daemon in the ``agent`` cgroup with a high CPU weight and out of the OOM killer's
reach; every user command gets a cgroup of its own under ``work`` (low CPU weight, bounded process count)
and the normal OOM score before it runs any of the user's code: :func:`born_in_command_group` has the
daemon step into a fresh command group for the instant it forks, so the child starts life there (when
that is not possible the daemon spawns it held, see command.py, and :func:`place_command` moves it).
Without this, a fork bomb on a 1-vCPU guest starves the daemon and the host can no longer stop it.
Every step is best effort: a kernel without cgroup2 keeps working as before.

Standard library only: this module is copied into the guest image.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

__all__ = [
    "AGENT",
    "ROOT",
    "WORK",
    "WORK_PIDS_MAX",
    "WORK_PIDS_MIN",
    "Unplaced",
    "born_in_command_group",
    "enter_work",
    "forget_command",
    "kill_command",
    "oom_kills",
    "place_command",
    "setup",
    "sweep",
    "work_pids_max",
]

ROOT = "/sys/fs/cgroup"
AGENT = ROOT + "/agent"
WORK = ROOT + "/work"
WORK_PIDS_MAX = 4096
WORK_PIDS_MIN = 128
"""User commands may hold one process per MiB of guest memory, within these bounds (see work_pids_max)."""


def work_pids_max(mem_total_kib: int) -> int:
    """The process cap of ``work`` for a guest with ``mem_total_kib`` of memory: one per MiB. A flat 2048 let
    a fork bomb's processes (their kernel memory) overrun a 256 MiB guest: the daemon then answered health
    after 5-20 s and ended the 15 s-timeout bomb after up to 57 s (once, in CI, not within 75 s). With 256
    the daemon answered within 0.04 s and the bomb ended at 15.3 s (3 runs each, TCG)."""
    return max(WORK_PIDS_MIN, min(WORK_PIDS_MAX, mem_total_kib // 1024))


def _mem_total_kib() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return WORK_PIDS_MAX * 1024


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def setup(mount: bool = True) -> bool:
    """Create the two groups and move the calling process (init) into ``agent``. Returns False when the
    kernel offers no usable cgroup2 (nothing is changed then)."""
    if mount and not os.path.ismount(ROOT):
        import ctypes  # only needed here; keeps enter_work() (run between fork and exec) minimal

        libc = ctypes.CDLL(None, use_errno=True)
        # favordynmods (Linux 6.0+): moving a process between groups skips an RCU grace period, which is
        # most of what placing each command cost under an emulated CPU (~15-25 ms of a ~45 ms `true`);
        # forks and exits pay a little instead.
        if (libc.mount(b"cgroup2", ROOT.encode(), b"cgroup2", 0, b"nsdelegate,favordynmods") != 0
                and libc.mount(b"cgroup2", ROOT.encode(), b"cgroup2", 0, b"nsdelegate") != 0):
            return False
    for controller in ("cpu", "pids", "memory"):
        _write(ROOT + "/cgroup.subtree_control", "+" + controller)
    for path in (AGENT, WORK):
        with contextlib.suppress(FileExistsError, OSError):
            os.mkdir(path)
    if not os.path.isdir(AGENT) or not os.path.isdir(WORK):
        return False
    _write(AGENT + "/cpu.weight", "10000")
    _write(WORK + "/cpu.weight", "100")
    _write(WORK + "/pids.max", str(work_pids_max(_mem_total_kib())))
    # Per-command groups get the memory controller, for memory.oom.group (see enter_work).
    _write(WORK + "/cgroup.subtree_control", "+memory")
    moved = _write(AGENT + "/cgroup.procs", "0")
    # The daemon (a child of init) inherits this; enter_work() resets it for user commands.
    _write("/proc/self/oom_score_adj", "-1000")
    return moved


def _in_agent() -> bool:
    try:
        with open("/proc/self/cgroup") as f:
            return f.read().strip() == "0::/agent"
    except OSError:
        return False


# Decided once, in the daemon, before any fork: only a daemon that init placed in ``agent`` moves its
# commands (the same daemon run on a host by the tests must leave the host's cgroups alone).
_ACTIVE = _in_agent()


_SELF_OOM = "/proc/self/oom_score_adj"
# Groups of commands born in them (named n<sequence>, see born_in_command_group), by the command's pid;
# the other paths name a command's group c<pid>.
_BORN: dict[int, str] = {}
_SPAWN_LOCK = threading.Lock()
_SEQUENCE = itertools.count()


def _command_group(pid: int) -> str:
    return _BORN.get(pid) or f"{WORK}/c{pid}"


class Unplaced(Exception):
    """:func:`born_in_command_group` could not start the command in a group of its own; nothing was
    started (the caller falls back to spawning it held)."""


class _HasPid(Protocol):
    @property
    def pid(self) -> int: ...


_P = TypeVar("_P", bound=_HasPid)


def born_in_command_group(start: Callable[[], _P]) -> _P:
    """Call ``start`` (which forks and execs one command) while the daemon itself sits in a new, empty
    group under ``work`` with the normal OOM score, then step back into ``agent``. The child inherits
    both at fork, so the command is placed before any of its code runs, and it starts with one exec
    instead of a held shell step and a second exec (measured in the guest under TCG: ``true`` 25-37 ms
    this way, 55-70 ms held). Only one thread spawns at a time: every fork while the daemon is away
    from ``agent`` would land in that command's group. For the few milliseconds of the fork and exec
    the daemon is an ordinary OOM candidate in the command's group (oom.group): an OOM kill then takes
    the daemon too, and init restarts it, failing the calls in flight. The alternative, resetting the
    child's score after exec, would let the first processes a command forks keep -1000.

    The group keeps its name (``n<sequence>``: renaming it to ``c<pid>`` after the fork would change
    what a command that already runs reads in /proc/self/cgroup); kill_command, oom_kills and
    forget_command find it by the command's pid.
    A daemon that does not manage cgroups just calls ``start``.
    Raises :class:`Unplaced` without starting anything when the group cannot be made or entered,
    and when ``start`` fails with EAGAIN: ``work`` is at its process cap (a fork bomb), which a fork
    into ``agent`` is not bound by. Other exceptions of ``start`` propagate."""
    if not _ACTIVE:
        return start()  # nothing to place: a daemon run on a host leaves the host's cgroups alone
    with _SPAWN_LOCK:
        staged = f"{WORK}/n{next(_SEQUENCE)}"
        try:
            os.mkdir(staged)
        except OSError as exc:
            raise Unplaced(f"mkdir {staged}: {exc}") from None
        entered = (_write(staged + "/memory.oom.group", "1") and _write(_SELF_OOM, "0")
                   and _write(staged + "/cgroup.procs", "0"))
        try:
            if not entered:
                raise Unplaced(f"cannot enter {staged}")
            proc = start()
        except BaseException as exc:
            _home()
            with contextlib.suppress(OSError):
                os.rmdir(staged)
            if isinstance(exc, BlockingIOError):
                raise Unplaced(f"work is at its process cap: {exc}") from None
            raise
        _home()
    _BORN[proc.pid] = staged
    return proc


def _home() -> None:
    """Back into ``agent``, out of the OOM killer's reach again (the group first: until then a fork of
    ours would still land in the command's group)."""
    _write(AGENT + "/cgroup.procs", "0")
    _write(_SELF_OOM, "-1000")


def enter_work() -> None:
    """Run in a freshly forked child before exec: join a cgroup of its own under ``work`` (so everything
    the command forks can be killed at once, even processes that left its process group or were being
    forked while the group was signalled) and become an ordinary OOM victim."""
    if _ACTIVE:
        path = _command_group(os.getpid())
        try:
            os.mkdir(path)
        except OSError:
            path = WORK
        _write(path + "/cgroup.procs", "0")
        # If the OOM killer picks any process of this command, it takes the whole command: a fork
        # bomb whose leader dies of OOM must not leave its descendants hogging the guest.
        _write(path + "/memory.oom.group", "1")
        _write("/proc/self/oom_score_adj", "0")


def place_command(pid: int) -> None:
    """From the daemon: move the command ``pid`` (held before it runs user code, see command.spawn) into a
    cgroup of its own under ``work`` and make it an ordinary OOM victim, as :func:`enter_work` does from
    inside a child."""
    if _ACTIVE:
        path = _command_group(pid)
        try:
            os.mkdir(path)
        except OSError:
            path = WORK
        _write(path + "/memory.oom.group", "1")
        _write(path + "/cgroup.procs", str(pid))
        _write(f"/proc/{pid}/oom_score_adj", "0")


def kill_command(pid: int) -> None:
    """SIGKILL every process the command ``pid`` started (cgroup.kill, Linux 5.14+)."""
    if _ACTIVE:
        _write(_command_group(pid) + "/cgroup.kill", "1")


def forget_command(pid: int) -> None:
    """Remove the command's cgroup once it is empty (it stays while descendants it left behind run)."""
    if _ACTIVE:
        with contextlib.suppress(OSError):
            os.rmdir(_command_group(pid))
        # A group still holding what the command left running stays (sweep() removes it once empty,
        # at the next daemon start); the pid may be reused by the next command.
        _BORN.pop(pid, None)


def oom_kills(pid: int) -> int | None:
    """How many processes of the command ``pid`` any OOM killer (the kernel's global one or a memory
    cgroup's) has killed: the ``oom_kill`` counter of its cgroup's memory.events. None when the command has
    no cgroup of its own. Read it before :func:`forget_command` removes the group."""
    if not _ACTIVE:
        return None
    try:
        with open(_command_group(pid) + "/memory.events") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def sweep() -> int:
    """Remove the empty command groups a daemon that died without cleaning up left under ``work``
    (run at daemon start). Groups still holding processes stay. Returns how many were removed."""
    if not _ACTIVE:
        return 0
    removed = 0
    try:
        names = os.listdir(WORK)
    except OSError:
        return 0
    for name in names:
        if name[:1] in ("c", "n") and name[1:].isdigit():
            with contextlib.suppress(OSError):
                os.rmdir(f"{WORK}/{name}")
                removed += 1
    return removed
