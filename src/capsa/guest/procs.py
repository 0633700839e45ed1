"""Running commands: foreground exec (streamed), background processes (buffered, polled later)."""

from __future__ import annotations

import contextlib
import fcntl
import grp
import heapq
import itertools
import os
import pwd
import select
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capsa.guest.cgroups import (
    Unplaced,
    born_in_command_group,
    enter_work,
    forget_command,
    kill_command,
    oom_kills,
    place_command,
)
from capsa.guest.channel import ChannelGone, Stream
from capsa.guest.errors import OpError, from_os_error
from capsa.guest.layout import command_layout
from capsa.guest.protocol import PROCESS_OUTPUT_KEPT, Kind

__all__ = [
    "DEFAULT_MAX_OUTPUT",
    "HOLD",
    "HOLD_PREFIX",
    "RING_SIZE",
    "SHELL",
    "CommandSpec",
    "ProcessTable",
    "RingBuffer",
    "op_exec",
    "parse_command",
]

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
MAX_MAX_OUTPUT = 1024 * 1024 * 1024
RING_SIZE = PROCESS_OUTPUT_KEPT
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# After the command itself exits, descendants that inherited its pipes may keep them open
# forever (`cmd &`); stop collecting once they have been quiet this long.
DRAIN_IDLE = 0.2
# Big pipes and big reads: fewer wakeups per byte, which matters when the guest CPU is emulated.
PIPE_SIZE = 1024 * 1024
READ_SIZE = PIPE_SIZE
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _grow_pipes(proc: subprocess.Popen[bytes]) -> None:
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


def killpg(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    if sig == signal.SIGKILL:
        kill_command(pid)  # also what left the group or was mid-fork while it was signalled


def _exit_fields(returncode: int | None) -> dict[str, Any]:
    if returncode is None:
        return {"exit_code": None, "signal": None}
    if returncode < 0:
        return {"exit_code": None, "signal": -returncode}
    return {"exit_code": returncode, "signal": None}


def _positive_number(args: dict[str, Any], key: str) -> float | None:
    value = args.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise OpError("bad_request", f"{key} must be a positive number")
    return float(value)


def _feed_stdin(stream: Stream, proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    broken = False
    try:
        while True:
            frame = stream.next_frame()
            if frame is None:
                continue
            if frame.kind == Kind.END:
                break
            if frame.kind != Kind.DATA:
                continue
            if not broken:
                try:
                    view = memoryview(frame.data)
                    while view:
                        view = view[os.write(fd, view):]
                except OSError:
                    broken = True  # the command stopped reading; keep draining so the host is not stuck
            stream.consumed(len(frame.data))
    except (ChannelGone, OpError):
        pass
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()


class Deadlines:
    """One thread that runs the callbacks of every command's timeout when they fall due (a
    threading.Timer per command started a thread each time: milliseconds under TCG). With nothing
    scheduled it waits without a timeout, so an idle guest is not woken."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def call_later(self, delay: float, fn: Callable[[], None]) -> tuple[float, int, Callable[[], None]]:
        entry = (time.monotonic() + delay, next(self._seq), fn)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="capsa-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
        return entry

    def cancel(self, entry: tuple[float, int, Callable[[], None]]) -> None:
        with self._cond, contextlib.suppress(ValueError):
            self._heap.remove(entry)
            heapq.heapify(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception as exc:  # one command's timeout handling must not end everyone's
                print(f"capsa-guest: timeout callback failed: {exc!r}", file=sys.stderr)


DEADLINES = Deadlines()


def op_exec(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    spec = parse_command(args)
    timeout = _positive_number(args, "timeout")
    max_output = args.get("max_output", DEFAULT_MAX_OUTPUT)
    if (isinstance(max_output, bool) or not isinstance(max_output, int)
            or not 0 <= max_output <= MAX_MAX_OUTPUT):
        raise OpError("bad_request", f"max_output must be an integer between 0 and {MAX_MAX_OUTPUT}")
    want_stdin = args.get("stdin", False)
    if not isinstance(want_stdin, bool):
        raise OpError("bad_request", "stdin must be a boolean (true: the host streams it)")
    started = time.monotonic()
    proc = spawn(spec, stdin=subprocess.PIPE if want_stdin else subprocess.DEVNULL,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    spawn_ms = (time.monotonic() - started) * 1000
    _grow_pipes(proc)
    state = {"timed_out": False}

    def on_timeout() -> None:
        state["timed_out"] = True
        killpg(proc.pid)

    timer = DEADLINES.call_later(timeout, on_timeout) if timeout else None
    stream.on_cancel(lambda: killpg(proc.pid) if proc.returncode is None else None)
    stdin_thread = None
    if want_stdin:
        stdin_thread = threading.Thread(target=_feed_stdin, args=(stream, proc), daemon=True)
        stdin_thread.start()
    stream.send(Kind.EVENT, {"started": True, "pid": proc.pid})
    counts = {"stdout": 0, "stderr": 0}
    killed_by_oom: int | None = None
    try:
        _pump(stream, proc, counts, max_output)
        returncode = proc.wait()
    finally:
        if timer:
            DEADLINES.cancel(timer)
        if proc.poll() is None:
            killpg(proc.pid)
            proc.wait()
        killed_by_oom = oom_kills(proc.pid)  # before reaped() removes the command's cgroup
        reaped(proc)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    if stream.cancelled.is_set():
        raise ChannelGone("request cancelled")
    result = _exit_fields(returncode)
    result.update(
        timed_out=state["timed_out"],
        stdout_bytes=counts["stdout"], stderr_bytes=counts["stderr"],
        stdout_truncated=counts["stdout"] > max_output, stderr_truncated=counts["stderr"] > max_output,
        duration=time.monotonic() - started, pid=proc.pid, spawn_ms=round(spawn_ms, 3),
        # The kernel's own count for this command's cgroup: true when an OOM killer (global or a memory
        # cgroup's) killed any of its processes, whatever the kernel log says.
        oom_killed=bool(killed_by_oom),
    )
    stream.result(result)


def _pump(stream: Stream, proc: subprocess.Popen[bytes], counts: dict[str, int], limit: int) -> None:
    """Forward both pipes until EOF (or quiet after exit); beyond ``limit`` drain without sending."""
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
    exited_at: float | None = None
    last_data = time.monotonic()
    try:
        while sel.get_map():
            events = sel.select(0.05)
            now = time.monotonic()
            for key, _ in events:
                ch = key.data
                chunk = os.read(key.fd, READ_SIZE)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                last_data = now
                sent = counts[ch]
                counts[ch] = sent + len(chunk)
                if sent < limit:
                    stream.send_data(chunk[: limit - sent], {"ch": ch})
            if stream.cancelled.is_set():
                raise ChannelGone("request cancelled")
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and not events and now - max(exited_at, last_data) > DRAIN_IDLE:
                break
    finally:
        sel.close()


# -- background processes ------------------------------------------------------------------------


class RingBuffer:
    """The last ``size`` bytes of a stream, with absolute offsets so pollers can ask for 'new since'."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self._size = size
        self._buf = bytearray()
        self.total = 0
        self._lock = threading.Lock()

    @property
    def start(self) -> int:
        return self.total - len(self._buf)

    def append(self, data: bytes) -> None:
        with self._lock:
            self._buf += data
            self.total += len(data)
            excess = len(self._buf) - self._size
            if excess > 0:
                del self._buf[:excess]

    def read(self, since: int = 0) -> tuple[bytes, int, int]:
        """Bytes from offset ``since`` (or the oldest kept), their start offset, and the end offset."""
        with self._lock:
            start = self.total - len(self._buf)
            begin = max(since, start)
            return bytes(self._buf[begin - start:]), begin, self.total


class BackgroundProcess:
    def __init__(self, spec: CommandSpec, proc: subprocess.Popen[bytes]) -> None:
        self.spec = spec
        self.proc = proc
        self.pid = proc.pid
        self.started_at = time.time()
        self.stdout = RingBuffer()
        self.stderr = RingBuffer()
        self.exited = threading.Event()
        self.changed = threading.Condition()
        """Notified when output arrives and when the process is reported exited (``proc_stream`` waits)."""
        self.stdin_lock = threading.Lock()
        self.returncode: int | None = None
        self.finished_at: float | None = None
        self._last_output = time.monotonic()
        self._collector = threading.Thread(target=self._collect, name=f"capsa-bg-{self.pid}", daemon=True)
        self._collector.start()
        threading.Thread(target=self._wait, name=f"capsa-bgwait-{self.pid}", daemon=True).start()

    def _collect(self) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout.fileno(), selectors.EVENT_READ, self.stdout)
        sel.register(self.proc.stderr.fileno(), selectors.EVENT_READ, self.stderr)
        try:
            while sel.get_map():
                for key, _ in sel.select():
                    chunk = os.read(key.fd, READ_SIZE)
                    if chunk:
                        key.data.append(chunk)
                        self._last_output = time.monotonic()
                        with self.changed:
                            self.changed.notify_all()
                    else:
                        sel.unregister(key.fd)
        finally:
            sel.close()
            self.proc.stdout.close()
            self.proc.stderr.close()

    def _wait(self) -> None:
        returncode = self.proc.wait()
        reaped(self.proc)
        # Report the exit only once the output it wrote is collected, so "not running" means "all
        # output is there" -- unless descendants keep the pipes open and busy (then give up after a while).
        exited_at = time.monotonic()
        while self._collector.is_alive() and time.monotonic() < exited_at + 5.0:
            self._collector.join(0.05)
            if time.monotonic() - max(self._last_output, exited_at) > DRAIN_IDLE:
                break
        self.returncode = returncode
        self.finished_at = time.time()
        self.exited.set()
        with self.changed:
            self.changed.notify_all()
        with self.stdin_lock:
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pid": self.pid, "cmd": self.spec.display, "running": not self.exited.is_set(),
            "started_at": self.started_at, "finished_at": self.finished_at,
            "stdin_open": self.proc.stdin is not None and not self.proc.stdin.closed,
        }
        out.update(_exit_fields(self.returncode if self.exited.is_set() else None))
        return out


class ProcessTable:
    """Background processes of this guest, shared by every host connection (they outlive them)."""

    KEEP_FINISHED = 256

    def __init__(self) -> None:
        self._procs: OrderedDict[int, BackgroundProcess] = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, args: dict[str, Any]) -> BackgroundProcess:
        pid = args.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise OpError("bad_request", "pid must be an integer")
        with self._lock:
            proc = self._procs.get(pid)
        if proc is None:
            raise OpError("no_such_process", f"no background process with pid {pid}")
        return proc

    def _prune(self) -> None:
        finished = [pid for pid, p in self._procs.items() if p.exited.is_set()]
        for pid in finished[: max(0, len(finished) - self.KEEP_FINISHED)]:
            del self._procs[pid]

    def op_start(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        spec = parse_command(args)
        keep_stdin = args.get("stdin", False)
        if not isinstance(keep_stdin, bool):
            raise OpError("bad_request", "stdin must be a boolean")
        proc = spawn(spec, stdin=subprocess.PIPE if keep_stdin else subprocess.DEVNULL,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _grow_pipes(proc)
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)  # proc_stdin waits with select, cancellable
        bg = BackgroundProcess(spec, proc)
        with self._lock:
            self._procs[bg.pid] = bg
            self._prune()
        stream.result(bg.info())

    def op_list(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        with self._lock:
            procs = list(self._procs.values())
        stream.result({"processes": [p.info() for p in procs]})

    def op_wait(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        proc = self._get(args)
        timeout = _positive_number(args, "timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not proc.exited.wait(0.2):
            if stream.cancelled.is_set():
                raise ChannelGone("request cancelled")
            if deadline is not None and time.monotonic() >= deadline:
                break
        stream.result(proc.info())

    def op_kill(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        proc = self._get(args)
        sig = args.get("signal", signal.SIGTERM)
        if isinstance(sig, bool) or not isinstance(sig, int) or not 0 < sig < signal.NSIG:
            raise OpError("bad_request", "signal must be a signal number")
        if not proc.exited.is_set():
            killpg(proc.pid, sig)
            # Give the process a moment so the answer usually shows it gone.
            proc.exited.wait(1.0)
        stream.result(proc.info())

    def op_output(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        proc = self._get(args)
        meta = proc.info()
        for name, ring in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            since = args.get(f"{name}_from", 0)
            if isinstance(since, bool) or not isinstance(since, int) or since < 0:
                raise OpError("bad_request", f"{name}_from must be a non-negative offset")
            chunk, begin, end = ring.read(since)
            meta[f"{name}_start"] = begin
            meta[f"{name}_end"] = end
            meta[f"{name}_truncated"] = begin > since
            if chunk:
                stream.send_data(chunk, {"ch": name})
        stream.result(meta)

    def op_stdin(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        """Write the request's inline data to the process's stdin (waits while the pipe is full)."""
        proc = self._get(args)
        with proc.stdin_lock:
            pipe = _open_stdin(proc)
            view = memoryview(data)
            while view:
                if stream.cancelled.is_set():
                    raise ChannelGone("request cancelled")
                if proc.exited.is_set():
                    raise OpError("process_exited", f"process {proc.pid} has exited")
                _, ready, _ = select.select([], [pipe], [], 0.2)
                if not ready:
                    continue
                try:
                    view = view[os.write(pipe.fileno(), view):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    raise OpError("stdin_closed", f"process {proc.pid} closed its stdin") from None
        stream.result(dict(proc.info(), bytes=len(data)))

    def op_close_stdin(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        """Close the process's stdin (it reads EOF). Closing it twice is not an error."""
        proc = self._get(args)
        with proc.stdin_lock:
            if proc.proc.stdin is None:
                raise OpError("stdin_closed", f"process {proc.pid} was started without stdin")
            with contextlib.suppress(OSError):
                proc.proc.stdin.close()
        stream.result(proc.info())

    def op_stream(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        """Output from ``stdout_from``/``stderr_from`` as it is written, until the process has exited and
        every byte it wrote was sent. EVENT {"streaming"} first, then DATA meta ``{"ch", "offset"}`` (the
        chunk's first byte) and ``lost`` when the ring buffer no longer held bytes from the asked offset;
        RESULT = ProcessInfo + ``stdout_end``/``stderr_end``. The host cancelling ends it; the process
        keeps running."""
        proc = self._get(args)
        offsets: dict[str, int] = {}
        for name in ("stdout", "stderr"):
            since = args.get(f"{name}_from", 0)
            if isinstance(since, bool) or not isinstance(since, int) or since < 0:
                raise OpError("bad_request", f"{name}_from must be a non-negative offset")
            offsets[name] = since
        rings = (("stdout", proc.stdout), ("stderr", proc.stderr))
        stream.send(Kind.EVENT, {"streaming": True, "pid": proc.pid})
        while True:
            if stream.cancelled.is_set():
                raise ChannelGone("request cancelled")
            done = proc.exited.is_set()  # read before draining: output written before the exit is sent
            sent = False
            for name, ring in rings:
                chunk, begin, end = ring.read(offsets[name])
                if chunk:
                    meta: dict[str, Any] = {"ch": name, "offset": begin}
                    if begin > offsets[name]:
                        meta["lost"] = begin - offsets[name]
                    stream.send_data(chunk, meta)
                    sent = True
                offsets[name] = max(offsets[name], end)
            if done and not sent:
                break
            with proc.changed:
                if not proc.exited.is_set() and all(ring.total <= offsets[name] for name, ring in rings):
                    proc.changed.wait(0.5)
        stream.result(dict(proc.info(), stdout_end=offsets["stdout"], stderr_end=offsets["stderr"]))

    def kill_all(self) -> None:
        kill_everything()


def _open_stdin(proc: BackgroundProcess) -> Any:
    pipe = proc.proc.stdin
    if proc.exited.is_set():
        raise OpError("process_exited", f"process {proc.pid} has exited")
    if pipe is None:
        raise OpError("stdin_closed", f"process {proc.pid} was started without stdin (start it with stdin)")
    if pipe.closed:
        raise OpError("stdin_closed", f"the stdin of process {proc.pid} is closed")
    return pipe
