"""Starting a command: its arguments parsed and checked (cmd, env, cwd, user), the process spawned in a
session and a cgroup of its own before any of its code runs, killed with its group, reaped."""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import pwd
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Any

from capsa.guest.cgroups import (
    Unplaced,
    born_in_command_group,
    enter_work,
    forget_command,
    kill_command,
    place_command,
)
from capsa.guest.errors import OpError, from_os_error
from capsa.guest.layout import command_layout
from capsa.guest.limits import COMMAND_ENV_ENTRIES

__all__ = [
    "DRAIN_IDLE",
    "HOLD",
    "HOLD_PREFIX",
    "READ_SIZE",
    "SHELL",
    "CommandSpec",
    "grow_pipes",
    "kill_everything",
    "killpg",
    "parse_command",
    "reaped",
    "spawn",
    "write_all",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# After the command itself exits, descendants that inherited its pipes may keep them open
# forever (`cmd &`); stop collecting once they have been quiet this long.
DRAIN_IDLE = 0.2
# Big pipes and big reads: fewer wakeups per byte, which matters when the guest CPU is emulated.
PIPE_SIZE = 1024 * 1024
READ_SIZE = PIPE_SIZE
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def grow_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe.fileno(), F_SETPIPE_SZ, PIPE_SIZE)


@dataclass
class CommandSpec:
    argv: list[str]
    display: str
    env: dict[str, str]
    cwd: str
    uid: int | None
    gid: int | None
    groups: list[int] | None
    script: str | None = None
    """The shell command line when ``cmd`` was a string (``argv`` is then ``/bin/sh -c script``)."""


def _str_map(value: object, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise OpError("bad_request", f"{what} must be an object of strings")
    if len(value) > COMMAND_ENV_ENTRIES:
        raise OpError("bad_request", f"{what} has more than {COMMAND_ENV_ENTRIES} entries")
    for k, v in value.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise OpError("bad_request", f"invalid {what} entry {k!r}")
    return dict(value)


def parse_command(args: dict[str, Any]) -> CommandSpec:
    """Validate the common command arguments: cmd, env, cwd, user."""
    cmd = args.get("cmd")
    if isinstance(cmd, str):
        if not cmd.strip() or "\0" in cmd:
            raise OpError("bad_request", "cmd must be a non-empty string without NUL")
        argv = ["/bin/sh", "-c", cmd]
        display = cmd
    elif isinstance(cmd, list) and cmd and all(isinstance(a, str) and "\0" not in a for a in cmd):
        argv = list(cmd)
        display = " ".join(argv)
        if not argv[0]:
            raise OpError("bad_request", "cmd[0] must not be empty")
    else:
        raise OpError("bad_request",
                      "cmd must be a string (run by /bin/sh -c) or a non-empty list of strings")
    extra_env = _str_map(args.get("env"), "env")
    user = args.get("user")
    uid = gid = None
    groups: list[int] | None = None
    home = os.environ.get("HOME", "/root")
    user_name = None
    if user is not None:
        if not isinstance(user, str | int) or isinstance(user, bool):
            raise OpError("bad_request", "user must be a name or a uid")
        try:
            entry = pwd.getpwnam(user) if isinstance(user, str) else pwd.getpwuid(user)
        except KeyError:
            raise OpError("not_found", f"no such user: {user}") from None
        uid, gid, home, user_name = entry.pw_uid, entry.pw_gid, entry.pw_dir, entry.pw_name
        groups = sorted({g.gr_gid for g in grp.getgrall() if entry.pw_name in g.gr_mem} | {gid})
        if uid != os.geteuid() and os.geteuid() != 0:
            raise OpError("permission_denied", f"the guest daemon cannot switch to user {user}")
        if uid == os.geteuid():
            uid = gid = None  # nothing to switch; keeps unprivileged local daemons working
            groups = None
    cwd = args.get("cwd")
    if cwd is None:
        cwd = home if os.path.isdir(home) else "/"
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        raise OpError("bad_request", "cwd must be an absolute path")
    if not os.path.isdir(cwd):
        raise OpError("not_found", f"working directory does not exist: {cwd}")
    env = {"PATH": DEFAULT_PATH, "HOME": home, "LANG": "C.UTF-8"}
    if user_name is not None:
        env["USER"] = env["LOGNAME"] = user_name
    else:
        for key in ("USER", "LOGNAME", "TERM"):
            if key in os.environ:
                env[key] = os.environ[key]
    env.update(extra_env)
    return CommandSpec(argv, display, env, cwd, uid, gid, groups,
                       script=cmd if isinstance(cmd, str) else None)


_LIVE: set[subprocess.Popen[bytes]] = set()
_LIVE_LOCK = threading.Lock()


def kill_everything() -> None:
    """Kill the process group of every command still running (the daemon is shutting down)."""
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for proc in procs:
        if proc.returncode is None:
            killpg(proc.pid)


def reaped(proc: subprocess.Popen[bytes]) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(proc)
    forget_command(proc.pid)


SHELL = "/bin/sh"
# The first program of an argv command: stop until the daemon has placed it (its cgroup, its OOM score), then
# become the command itself, same pid. Two shell builtins, so none of the user's code runs before placement.
HOLD = 'kill -STOP $$; exec "$@"'
# A shell command line gets the stop in front, on its first line: no second exec, same $0, same line
# numbers. A syntax error on that line stops the shell before anything runs (then it is never held).
HOLD_PREFIX = "kill -STOP $$; "


def _check_program(spec: CommandSpec) -> None:
    """The errors exec would give for the command's program (the shim's exec cannot report them)."""
    name = spec.argv[0]
    denied = False
    for folder in [""] if "/" in name else os.get_exec_path(spec.env):
        path = os.path.join(spec.cwd, folder, name)
        if os.path.isfile(path):
            if os.access(path, os.X_OK):
                return
            denied = True
        elif os.path.exists(path):
            denied = True
    if denied:
        raise OpError("permission_denied", f"cannot execute {name}")
    raise OpError("not_found", f"command not found: {name}")


def _release(proc: subprocess.Popen[bytes]) -> None:
    """Wait for the held command to stop, place it, let it go on to exec the user's program."""
    try:
        # WNOWAIT: a shim that died instead (it should not) stays for Popen to reap with its status.
        info = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return
    if info is None or info.si_code != os.CLD_STOPPED:
        return
    place_command(proc.pid)
    os.kill(proc.pid, signal.SIGCONT)


def spawn(spec: CommandSpec, *, stdin: int, stdout: int, stderr: int,
          preexec: Any = None) -> subprocess.Popen[bytes]:
    """Start the command in a new session (it leads its process group, so timeout/kill take its
    descendants too) and in a cgroup of its own under ``work`` (see cgroups.py), before any of its code runs.

    Without ``preexec`` no Python runs between fork and exec, so CPython spawns with vfork (fork copies the
    daemon's page tables, about twice the cost under an emulated MMU), and the child is born in its
    command group (:func:`born_in_command_group`). When that is not possible (``work`` at its process cap)
    the child first runs the shell shim ``HOLD`` (for a shell command line, the shell itself with
    ``HOLD_PREFIX``), which stops itself; the daemon moves the stopped process into the command's cgroup
    and continues it, and it runs the user's code in place. ``preexec`` (terminals: the controlling tty)
    forks and joins the cgroup from inside the child instead.
    """
    def popen(argv: list[str], preexec_fn: Any) -> subprocess.Popen[bytes]:
        with command_layout():  # the child inherits this thread's personality (see capsa.guest.layout)
            return subprocess.Popen(
                argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=spec.cwd, env=spec.env,
                start_new_session=True, close_fds=True, user=spec.uid, group=spec.gid,
                extra_groups=spec.groups, preexec_fn=preexec_fn,
            )

    held = False
    try:
        if preexec is not None:
            def prepare() -> None:
                enter_work()
                preexec()

            proc = popen(spec.argv, prepare)
        else:
            try:
                proc = born_in_command_group(lambda: popen(spec.argv, None))
            except Unplaced:
                held = True
                if spec.script is not None:
                    proc = popen([SHELL, "-c", HOLD_PREFIX + spec.script], None)
                else:
                    _check_program(spec)
                    proc = popen([SHELL, "-c", HOLD, SHELL, *spec.argv], None)
    except FileNotFoundError:
        raise OpError("not_found", f"command not found: {spec.argv[0]}") from None
    except PermissionError:
        raise OpError("permission_denied", f"cannot execute {spec.argv[0]}") from None
    except OSError as exc:
        raise from_os_error(exc, spec.argv[0]) from None
    with _LIVE_LOCK:
        _LIVE.add(proc)
    if held:
        try:
            _release(proc)
        except BaseException:
            killpg(proc.pid)
            proc.wait()
            reaped(proc)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            raise
    return proc


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a blocking ``fd`` (raises OSError when it fails)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def killpg(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    if sig == signal.SIGKILL:
        kill_command(pid)  # also what left the group or was mid-fork while it was signalled
