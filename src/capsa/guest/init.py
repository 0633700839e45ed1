"""PID 1 of a capsa guest (``python3 -m capsa.guest.init``), started by the initramfs after switch_root.

It mounts the API filesystems, names the host, brings up loopback, runs the guest daemon (restarting
it when it dies), reaps every orphan, and on SIGTERM/SIGINT (or a daemon ``poweroff`` request, which
arrives as SIGTERM) stops everything, syncs and powers the VM off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

from capsa.guest import cgroups, quiet

__all__ = ["DEVICE", "cmdline_options", "main", "mount_all", "set_loopback_up"]

DEVICE = "/dev/virtio-ports/agent0"
DEFAULT_HOSTNAME = "capsa"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_RDONLY = 1
MS_REMOUNT = 32
RB_POWER_OFF = 0x4321FEDC
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

# (source, target, fstype, flags, options)
MOUNTS = (
    ("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
    ("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
    ("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755"),
    ("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=0620,ptmxmode=0666"),
    ("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
    ("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755"),
    ("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
)


def _log(message: str) -> None:
    print(f"capsa-init: {message}", file=sys.stderr, flush=True)


_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _mount(source: str, target: str, fstype: str | None, flags: int, options: str) -> None:
    rc = _c().mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                    ctypes.c_ulong(flags), options.encode() if options else None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _is_mountpoint(path: str) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def mount_all() -> None:
    """Mount what a userland expects; a mount the initramfs already moved over is kept."""
    for source, target, fstype, flags, options in MOUNTS:
        os.makedirs(target, exist_ok=True)
        if _is_mountpoint(target):
            continue
        try:
            _mount(source, target, fstype, flags, options)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                _log(f"{exc}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        link = os.path.join("/dev", name)
        if not os.path.lexists(link):
            try:
                os.symlink(target, link)
            except OSError as exc:
                _log(f"symlink {link}: {exc}")
    if not os.path.exists("/dev/ptmx"):
        try:
            os.symlink("pts/ptmx", "/dev/ptmx")
        except OSError as exc:
            _log(f"symlink /dev/ptmx: {exc}")


def cmdline_options(text: str | None = None) -> dict[str, str]:
    """The ``capsa.*`` options of the kernel command line, without the prefix."""
    if text is None:
        try:
            with open("/proc/cmdline") as f:
                text = f.read()
        except OSError:
            return {}
    options = {}
    for word in text.split():
        if word.startswith("capsa.") and "=" in word:
            key, value = word[len("capsa."):].split("=", 1)
            options[key] = value
    return options


def set_hostname(name: str) -> None:
    try:
        socket.sethostname(name)
    except OSError as exc:
        _log(f"sethostname {name!r}: {exc}")
        return
    try:
        with open("/etc/hostname", "w") as f:
            f.write(name + "\n")
    except OSError:
        pass  # a read-only root is fine: the kernel already has the name


def set_loopback_up() -> None:
    """``ip link set lo up`` without needing iproute2 in the image."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


class _Shutdown(Exception):
    pass


def _on_signal(signum: int, frame: object) -> None:
    raise _Shutdown(signal.Signals(signum).name)


def _wakeup_on_child_exit() -> int:
    """A descriptor that becomes readable when a child exits (SIGCHLD), so the main loop notices a dead
    daemon at once instead of at its next poll. Returns the read end."""
    read_fd, write_fd = os.pipe()  # both ends close-on-exec: the daemon and commands never see them
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a Python handler, so the wakeup fd fires
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    return read_fd


def _wait_for_event(wakeup_fd: int, timeout: float | None) -> None:
    try:
        ready, _, _ = select.select([wakeup_fd], [], [], timeout)
    except InterruptedError:
        return
    if ready:
        try:
            while os.read(wakeup_fd, 512):
                pass
        except BlockingIOError:
            pass


def _start_daemon(device: str) -> subprocess.Popen[bytes]:
    env = {
        "PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "linux",
        "PYTHONPATH": os.environ.get("PYTHONPATH", "/usr/lib/capsa"),
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "capsa.guest", "--device", device, "--allow-poweroff"],
        env=env, cwd="/", close_fds=True,
    )


def _reap(daemon: subprocess.Popen[bytes] | None) -> bool:
    """Collect every exited child; True when the daemon was among them."""
    daemon_died = False
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return daemon_died
        if pid == 0:
            return daemon_died
        if daemon is not None and pid == daemon.pid:
            daemon.returncode = os.waitstatus_to_exitcode(status)
            daemon_died = True


def _power_off() -> None:
    _log("stopping")
    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 1.0)):
        try:
            os.kill(-1, sig)  # every process but ourselves
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.05)
        else:
            continue
        break
    os.sync()
    try:
        _mount("none", "/", None, MS_REMOUNT | MS_RDONLY, "")
    except OSError as exc:
        _log(f"remount / read-only: {exc}")
    os.sync()
    _c().reboot(ctypes.c_int(RB_POWER_OFF))
    # Still here: not PID 1 or no permission. Nothing sensible is left to do.
    _log(f"reboot(POWER_OFF) failed: {os.strerror(ctypes.get_errno())}")


def main() -> int:
    os.environ.setdefault("PATH", DEFAULT_PATH)
    os.umask(0o022)
    mount_all()
    options = cmdline_options()
    if options.get("hostname"):
        set_hostname(options["hostname"])
    elif socket.gethostname() in ("", "(none)"):
        set_hostname(DEFAULT_HOSTNAME)  # "(none)" confuses tools; the host can rename it later
    try:
        set_loopback_up()
    except OSError as exc:
        _log(f"loopback: {exc}")
    # Only in a capsa VM (the host names our port on the kernel command line); init's own tests run it as
    # PID 1 in namespaces on a host, whose cgroups are not ours to rearrange.
    if "device" in options and not cgroups.setup():
        _log("cgroup2 unavailable: user commands share the daemon's CPU and process budget")
    if "device" in options:
        for problem in quiet.quiet():
            _log(problem)
    device = options.get("device", DEVICE)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    wakeup_fd = _wakeup_on_child_exit()
    daemon: subprocess.Popen[bytes] | None = None
    restart_at = started = 0.0
    backoff = 0.0
    try:
        while True:
            if daemon is None and time.monotonic() >= restart_at:
                try:
                    daemon = _start_daemon(device)
                    started = time.monotonic()
                except OSError as exc:
                    _log(f"cannot start the guest daemon: {exc}")
                    restart_at = time.monotonic() + backoff
            if _reap(daemon) and daemon is not None:
                _log(f"guest daemon exited ({daemon.returncode}); restarting")
                # At once after a death (the host waits on it: its calls failed and it wants the new
                # instance's hello); back off only when it keeps dying right away.
                backoff = min(max(backoff * 2, 0.5), 10.0) if time.monotonic() - started < 5 else 0.0
                restart_at = time.monotonic() + backoff
                daemon = None
                continue
            # A running daemon: sleep until a signal (SIGCHLD of any child, SIGTERM) writes the wakeup
            # fd. No periodic wakeup: under TCG each one costs host CPU, times every idle sandbox.
            wait = None if daemon is not None else max(0.0, min(0.5, restart_at - time.monotonic()))
            _wait_for_event(wakeup_fd, wait)
    except _Shutdown as why:
        _log(f"received {why}")
    _power_off()
    return 0


if __name__ == "__main__":
    if os.getpid() != 1:
        print("capsa-init: must run as PID 1 (it powers the machine off when it stops)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
