"""Interactive terminals: a command on a pseudo-terminal, streamed both ways until it exits."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import select
import signal
import struct
import subprocess
import termios
import threading
from typing import Any

from capsa.guest.channel import ChannelGone, Stream
from capsa.guest.command import killpg, parse_command, reaped, spawn, write_all
from capsa.guest.errors import OpError
from capsa.guest.protocol import CHUNK_SIZE, Kind
from capsa.guest.results import exit_fields

__all__ = ["op_pty"]


def _size(args: dict[str, Any], key: str, default: int) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10000:
        raise OpError("bad_request", f"{key} must be an integer between 1 and 10000")
    return value


def _set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))  # struct winsize: rows first


def _make_controlling_tty() -> None:
    # Runs in the child after setsid(): stdin is the pty slave.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _default_shell(user: object) -> list[str]:
    """The user's login shell from the password database (the daemon's user when none is named), as a
    login shell (``-l``: /etc/profile and the user's profile set PATH, the prompt ...); /bin/sh if that
    shell is missing or not executable. An unknown user is left for parse_command to refuse."""
    shell = ""
    with contextlib.suppress(KeyError, TypeError, OverflowError):
        if isinstance(user, str):
            shell = pwd.getpwnam(user).pw_shell
        elif isinstance(user, int) and not isinstance(user, bool):
            shell = pwd.getpwuid(user).pw_shell
        else:
            shell = pwd.getpwuid(os.geteuid()).pw_shell
    if not shell or not os.path.isabs(shell) or not os.access(shell, os.X_OK) \
            or os.path.basename(shell) in ("nologin", "false"):
        shell = "/bin/sh"
    return [shell, "-l"]


def op_pty(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    """Open a terminal. Host frames: DATA = keyboard input, EVENT {"cols","rows"} = resize, EVENT
    {"signal": N} = signal the terminal's process group (the exit is still reported), END = ^D.

    Guest frames: EVENT {"pid"} once started, DATA = terminal output, RESULT with the exit status.
    CANCEL hangs the terminal up (SIGHUP to its process group).
    """
    if args.get("cmd") is None:
        args = dict(args, cmd=_default_shell(args.get("user")))
    cols = _size(args, "cols", 80)
    rows = _size(args, "rows", 24)
    spec = parse_command(args)
    spec.env.setdefault("TERM", "xterm-256color")
    master, slave = os.openpty()
    try:
        _set_size(slave, cols, rows)
        os.set_inheritable(slave, False)
        proc = spawn(spec, stdin=slave, stdout=slave, stderr=slave, preexec=_make_controlling_tty)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    stream.on_cancel(lambda: killpg(proc.pid, signal.SIGHUP) if proc.returncode is None else None)
    writer = threading.Thread(target=_input, args=(stream, master, proc), daemon=True)
    try:
        stream.send(Kind.EVENT, {"started": True, "pid": proc.pid})
        writer.start()
        _output(stream, master)
        returncode = _finish(proc)
    finally:
        if proc.poll() is None:
            killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reaped(proc)
        # Stop the input thread before closing: a reused descriptor number must not get its writes.
        stream.stop_inbox()
        if writer.is_alive():
            writer.join(5)
        os.close(master)
    if stream.cancelled.is_set():
        raise ChannelGone("terminal closed")
    stream.result(exit_fields(returncode))


def _finish(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(5)
    except subprocess.TimeoutExpired:
        # The terminal is gone (EIO) but the leader ignores it; it has nothing to talk to anymore.
        killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _output(stream: Stream, master: int) -> None:
    while not stream.cancelled.is_set():
        ready, _, _ = select.select([master], [], [], 0.2)
        if not ready:
            continue
        try:
            chunk = os.read(master, CHUNK_SIZE)
        except OSError:  # EIO: every slave fd is closed, the session is over
            return
        if not chunk:
            return
        stream.send_data(chunk)


def _input(stream: Stream, master: int, proc: subprocess.Popen[bytes]) -> None:
    try:
        for frame in stream.frames():
            if frame.kind == Kind.DATA:
                with contextlib.suppress(OSError):
                    write_all(master, frame.data)
                stream.consumed(len(frame.data))
            elif frame.kind == Kind.EVENT and "signal" in frame.meta:
                sig = frame.meta.get("signal")
                if isinstance(sig, int) and not isinstance(sig, bool) and 0 < sig < signal.NSIG:
                    killpg(proc.pid, sig)
            elif frame.kind == Kind.EVENT:
                cols, rows = frame.meta.get("cols"), frame.meta.get("rows")
                if (isinstance(cols, int) and isinstance(rows, int)
                        and 0 < cols <= 10000 and 0 < rows <= 10000):
                    with contextlib.suppress(OSError):
                        _set_size(master, cols, rows)
            elif frame.kind == Kind.END:
                with contextlib.suppress(OSError):
                    os.write(master, b"\x04")
    except (ChannelGone, OpError):
        return
