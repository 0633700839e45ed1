"""The guest daemon: serves the capsa protocol on a virtio-serial port (in a VM) or a Unix socket.

``python3 -m capsa.guest --device /dev/virtio-ports/agent0`` in the VM;
``python3 -m capsa.guest --listen-unix PATH`` to run the very same daemon on a host (tests).

Operations (REQUEST meta ``{"op": name, ...args}``; the answer is one RESULT or ERROR frame):

=============  ===========================================  ==========================================
op             arguments (and request body)                 answer (and DATA frames before it)
=============  ===========================================  ==========================================
health                                                      version, protocol, instance, pid, uptime, ...
exec           cmd (str: sh -c / list: argv), env, cwd,     EVENT {pid}; DATA {"ch": stdout|stderr};
               user, timeout, max_output, stdin (bool:      exit_code|signal, timed_out, *_truncated,
               body = DATA* END)                            *_bytes, duration, oom_killed
proc_start     cmd, env, cwd, user, stdin (bool: keep a     ProcessInfo (pid, cmd, running, exit ...,
               pipe for proc_stdin)                         stdin_open)
proc_stdin     pid; body: the bytes (inline, <= 1 MiB)      ProcessInfo + bytes; stdin_closed,
                                                            process_exited
proc_close_stdin pid                                        ProcessInfo (the process reads EOF)
proc_stream    pid, stdout_from, stderr_from (offsets)      EVENT {streaming}; DATA {"ch", "offset",
                                                            lost?} as written, until exited;
                                                            ProcessInfo + *_end
proc_list                                                   {"processes": [ProcessInfo]}
proc_kill      pid, signal                                  ProcessInfo
proc_output    pid, stdout_from, stderr_from (offsets)      DATA {"ch"}; ProcessInfo + *_start/_end/
                                                            _truncated
pty_open       cmd, cols, rows, env, cwd, user; then host   EVENT {pid}; DATA (terminal output);
               DATA = input, EVENT {cols, rows} = resize,   exit_code|signal
               EVENT {signal} = kill, END = ^D, CANCEL =
               hang up
file_read      path, offset, length                         DATA (content); FileInfo
file_write     path, mode; body = DATA* END                 FileInfo (atomic: temp file + rename)
file_list      path                                         DATA (JSON array of FileInfo); {count}
file_stat      path                                         FileInfo (lstat)
file_mkdir     path, parents, mode                          FileInfo
file_remove    path, recursive                              {}
file_rename    src, dst                                     FileInfo of dst
file_watch     path, recursive                              EVENT {watching}; DATA (JSON lines
                                                            {type, path, is_dir}) until CANCEL;
                                                            {reason: removed} if the dir goes
tar_export     path                                         DATA (PAX tar stream); {bytes}
tar_import     path; body = DATA* END (tar, gz/bz2/xz ok)   {members}; unsafe_archive on escapes
tcp_open       port (on 127.0.0.1), connect_timeout; then   EVENT {connected}; DATA (bytes from the
               host DATA = bytes, END = half-close,         port); {bytes_in, bytes_out} when the
               CANCEL = close                               server closes; port_unreachable
set_clock      unix_ns                                      previous_ns, step_ns
reseed         body: 16..4096 bytes of entropy (inline)     {bytes}
set_hostname   name                                         {hostname}
set_aslr       enabled: whether commands spawned from now   {enabled}
               on get a randomized layout (guest.layout)
poweroff                                                    {} then the init powers the VM off
=============  ===========================================  ==========================================

On every connection the daemon first sends a hello (EVENT on stream 0 naming its instance id, see
capsa.guest.protocol); requests addressed to another instance are refused with guest_unavailable.

Error codes: bad_request, unknown_op, not_found, permission_denied, is_a_directory,
not_a_directory, already_exists, directory_not_empty, no_space, no_such_process, not_executable,
unsafe_archive, port_unreachable, process_exited, stdin_closed, unsupported,
too_large (a listing over MAX_LISTING_BYTES), cancelled,
flow_control, too_many_requests, malformed_frame, frame_too_large, unsupported_version, guest_unavailable,
io_error, internal_error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from capsa.guest import cgroups, files
from capsa.guest.background import ProcessTable
from capsa.guest.channel import Connection, Handler
from capsa.guest.foreground import op_exec
from capsa.guest.layout import op_set_aslr
from capsa.guest.ports import op_tcp_open
from capsa.guest.protocol import Decoder
from capsa.guest.system import System
from capsa.guest.terminal import op_pty
from capsa.guest.watch import op_file_watch

__all__ = ["Daemon", "find_port", "main"]

READ_SIZE = 256 * 1024


class Daemon:
    """Operation table plus state that outlives host connections (background processes)."""

    def __init__(self, *, allow_clock: bool = True, allow_poweroff: bool = False) -> None:
        # Fresh on every start: a restarted daemon is a new instance, and the host must notice.
        self.instance = secrets.token_hex(8)
        self.processes = ProcessTable()
        self.system = System(allow_clock=allow_clock, allow_poweroff=allow_poweroff, instance=self.instance)
        self.ops: dict[str, Handler] = {
            "health": self.system.op_health,
            "set_clock": self.system.op_set_clock,
            "reseed": self.system.op_reseed,
            "poweroff": self.system.op_poweroff,
            "set_hostname": self.system.op_set_hostname,
            "set_aslr": op_set_aslr,
            "exec": op_exec,
            "proc_start": self.processes.op_start,
            "proc_list": self.processes.op_list,
            "proc_kill": self.processes.op_kill,
            "proc_output": self.processes.op_output,
            "proc_stdin": self.processes.op_stdin,
            "proc_close_stdin": self.processes.op_close_stdin,
            "proc_stream": self.processes.op_stream,
            "pty_open": op_pty,
            "file_read": files.op_read,
            "file_write": files.op_write,
            "file_list": files.op_list,
            "file_stat": files.op_stat,
            "file_mkdir": files.op_mkdir,
            "file_remove": files.op_remove,
            "file_rename": files.op_rename,
            "file_watch": op_file_watch,
            **files.TAR_OPS,
            "tcp_open": op_tcp_open,
        }

    def connection(self, write: Callable[[bytes], None]) -> Connection:
        return Connection(write, self.ops.get, instance=self.instance)

    def serve_stream(self, read: Callable[[], bytes], write: Callable[[bytes], None]) -> None:
        """Announce this instance, then serve one connection until ``read`` returns b"" (EOF) or fails."""
        conn = self.connection(write)
        conn.announce(pid=os.getpid())
        decoder = Decoder()
        try:
            while True:
                try:
                    chunk = read()
                except OSError:
                    break
                if not chunk:
                    break
                for frame in decoder.feed(chunk):
                    conn.handle(frame)
        finally:
            conn.close()

    # -- transports ------------------------------------------------------------------------------

    def serve_device(self, path: str) -> None:
        """Serve a virtio-serial port forever. EOF means the host side disconnected, not the end:
        requests bound to that host are cancelled, background processes keep running, and the next
        host connection starts a fresh decoder."""
        fd = _open_device(path)
        write_lock = threading.Lock()

        def write(raw: bytes) -> None:
            with write_lock:
                _write_all(fd, raw)

        while True:
            self.serve_stream(lambda: _read_port(fd), write)
            # Disconnected: the port reads EOF until the host reconnects. poll() reports POLLHUP
            # immediately in that state, so sleep between checks instead of spinning.
            while True:
                events = select.poll()
                events.register(fd, select.POLLIN)
                ready = events.poll(1000)
                if ready and ready[0][1] & select.POLLIN:
                    break
                time.sleep(0.05)

    def serve_fd(self, fd: int) -> None:
        """Serve one inherited connected descriptor (socket or pipe pair end) until EOF."""
        self.serve_stream(lambda: os.read(fd, READ_SIZE), lambda raw: _write_all(fd, raw))

    def serve_unix(self, path: str, ready_fd: int | None = None) -> None:
        """Accept any number of host connections on a Unix socket; each gets its own streams."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            server.bind(path)
            os.chmod(path, 0o600)
            server.listen(16)
            if ready_fd is not None:
                os.write(ready_fd, b"ready\n")
                os.close(ready_fd)
            try:
                while True:
                    client, _ = server.accept()
                    threading.Thread(target=self._serve_socket, args=(client,), daemon=True).start()
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _serve_socket(self, client: socket.socket) -> None:
        with client:
            self.serve_stream(lambda: client.recv(READ_SIZE), client.sendall)


def find_port(path: str, sysfs: str = "/sys/class/virtio-ports") -> str | None:
    """``path`` if it exists, else the /dev node of the virtio-serial port named like its basename.

    The /dev/virtio-ports/<name> links come from udev, which a minimal guest does not run; the kernel
    still publishes each port's name in sysfs.
    """
    if os.path.exists(path):
        return path
    want = os.path.basename(path)
    try:
        ports = sorted(os.listdir(sysfs))
    except OSError:
        return None
    for port in ports:
        try:
            with open(os.path.join(sysfs, port, "name")) as f:
                name = f.read().strip()
        except OSError:
            continue
        if name == want and os.path.exists(os.path.join("/dev", port)):
            return os.path.join("/dev", port)
    return None


def _open_device(path: str) -> int:
    announced = False
    while True:
        found = find_port(path)
        try:
            if found is None:
                raise FileNotFoundError(path)
            fd = os.open(found, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
            print(f"capsa-guest: serving {found}", file=sys.stderr, flush=True)
            return fd
        except FileNotFoundError:
            if not announced:
                print(f"capsa-guest: waiting for {path}", file=sys.stderr, flush=True)
                announced = True
            time.sleep(0.1)


def _read_port(fd: int) -> bytes:
    return os.read(fd, READ_SIZE)


def _write_all(fd: int, raw: bytes) -> None:
    view = memoryview(raw)
    while view:
        view = view[os.write(fd, view):]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="capsa-guest", description="capsa guest daemon")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--device", help="virtio-serial port to serve, e.g. /dev/virtio-ports/agent0")
    where.add_argument("--listen-unix", metavar="PATH", help="serve connections on a Unix socket")
    where.add_argument("--fd", type=int, help="serve one inherited connected descriptor until EOF")
    parser.add_argument("--ready-fd", type=int, help="write 'ready' to this descriptor once listening")
    parser.add_argument("--no-clock", action="store_true",
                        help="refuse set_clock and set_hostname (for daemons running on a host, not in a VM)")
    parser.add_argument("--allow-poweroff", action="store_true",
                        help="let the host ask for power off (sends SIGTERM to the init, PID 1)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    daemon = Daemon(allow_clock=not args.no_clock, allow_poweroff=args.allow_poweroff)

    def stop(signum: int, frame: Any) -> None:
        daemon.processes.kill_all()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # A predecessor killed without warning leaves the empty cgroups of the commands it ran.
    cgroups.sweep()
    try:
        if args.device:
            daemon.serve_device(args.device)
        elif args.listen_unix:
            daemon.serve_unix(args.listen_unix, args.ready_fd)
        else:
            daemon.serve_fd(args.fd)
    except KeyboardInterrupt:
        pass
    finally:
        daemon.processes.kill_all()
    return 0
