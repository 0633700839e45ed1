"""One QEMU process: spawning it unprivileged, its console and stderr, QMP, and stopping it for sure.

How QEMU is started (the node is root; every step execs the next, so the pid stays QEMU's)::

    unshare --net -- setpriv --reuid=U --regid=U --groups=…|--clear-groups --no-new-privs \
        -- prlimit --core=0:0 -- qemu-system-x86_64 …

``unshare --net`` gives QEMU a network namespace of its own holding only a loopback that is down: after
an escape from the guest the VM uid reaches no host address (control plane on loopback, internal
services, cloud metadata); a sandbox's NIC is a tap descriptor opened by the node in the sandbox's
namespace and inherited. The namespace is anonymous and disappears with QEMU. ``setpriv`` then drops to
the VM user (it must come after ``unshare``, which needs root). A node that is not root cannot make a
namespace this way; it uses an unprivileged user namespace (``unshare --user --map-current-user --net``)
when the kernel allows one, else QEMU shares the node's namespace and a warning says so once.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import shutil
import signal
import subprocess
from collections import deque
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from qemu.qmp import QMPClient

from capsa.node.runtime.workdir import VmDir

__all__ = ["BACKGROUND_NICE", "DEFAULT_CONSOLE_LIMIT", "QemuProcess", "QemuProcessError", "isolation_prefix"]

_log = logging.getLogger(__name__)

DEFAULT_CONSOLE_LIMIT = 1024 * 1024
_TAIL_BYTES = 16 * 1024


class QemuProcessError(Exception):
    """QEMU did not start, exited, or its monitor did not answer."""


class _BoundedLog:
    """A file that never exceeds ``limit`` bytes: when full it becomes ``<name>.1`` and a new one starts."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = max(limit, 4096)
        self._fh = self._open()
        self._size = 0
        self.tail: deque[bytes] = deque()
        self._tail_size = 0

    def write(self, data: bytes) -> None:
        self.tail.append(data)
        self._tail_size += len(data)
        while self._tail_size - len(self.tail[0]) >= _TAIL_BYTES:
            self._tail_size -= len(self.tail.popleft())
        if self._fh.closed:
            return
        if self._size + len(data) > self.limit:
            self._fh.close()
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self._fh = self._open()
            self._size = 0
        self._fh.write(data[: self.limit])
        self._size += min(len(data), self.limit)

    def _open(self) -> io.FileIO:
        # 0600: the guest console may print anything the guest knows.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        return io.FileIO(fd, "ab", closefd=True)

    def text_tail(self, limit: int = 4000) -> str:
        return b"".join(self.tail)[-limit:].decode(errors="replace")

    def close(self) -> None:
        self._fh.close()


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise QemuProcessError(f"{name} (util-linux) is not installed: QEMU cannot be started isolated")
    return path


@cache
def _unprivileged_netns() -> bool:
    """Whether this (non-root) process can give QEMU a network namespace through a user namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "--user", "--map-current-user", "--net", "--", "true"],
                           capture_output=True, check=False)
    if probe.returncode != 0:
        _log.warning("QEMU will share the node's network namespace: this user cannot create one (%s)",
                     probe.stderr.decode(errors="replace").strip())
    return probe.returncode == 0


def isolation_prefix(user: tuple[int, int] | None, groups: Sequence[int] = ()) -> list[str]:
    """The commands QEMU's argv runs under: a network namespace of its own, then (as root) the VM user
    ``user`` with exactly the supplementary ``groups``. Each execs the next."""
    if os.geteuid() != 0:
        if user is not None:
            raise QemuProcessError("only root can run QEMU as a VM user")
        if not _unprivileged_netns():
            return []
        return [_tool("unshare"), "--user", "--map-current-user", "--net", "--"]
    prefix = [_tool("unshare"), "--net", "--"]
    if user is not None:
        uid, gid = user
        who = [f"--reuid={uid}", f"--regid={gid}"]
        who.append(f"--groups={','.join(str(g) for g in groups)}" if groups else "--clear-groups")
        prefix += [_tool("setpriv"), *who, "--no-new-privs", "--"]
    return prefix


BACKGROUND_NICE = 19
"""Niceness of a VM restored in the background (warm pool): CFS gives a nice-19 thread ~1.5% of the
weight of a nice-0 one, so a refill only takes CPU that serving sandboxes leave idle."""


class QemuProcess:
    def __init__(self, argv: Sequence[str], vmdir: VmDir, *, user: tuple[int, int] | None = None,
                 extra_groups: Sequence[int] = (), console_limit: int = DEFAULT_CONSOLE_LIMIT,
                 pass_fds: Sequence[int] = (), nice: int = 0) -> None:
        self.argv = list(argv)
        self.nice = nice  # the CPU niceness QEMU starts with (every thread it makes inherits it)
        self.vmdir = vmdir
        self.user = user
        self.extra_groups = list(extra_groups)
        self.console_limit = console_limit
        self.pass_fds = tuple(pass_fds)  # e.g. a tap opened by the node: QEMU cannot open one itself
        self._proc: asyncio.subprocess.Process | None = None
        self._console: _BoundedLog | None = None
        self._stderr: deque[bytes] = deque(maxlen=64)
        self._pumps: list[asyncio.Task[None]] = []
        self._qmp: QMPClient | None = None
        self._qmp_lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def set_nice(self, nice: int) -> None:
        """Renice every thread of the running QEMU (Linux niceness is per thread; threads made later
        inherit it from the thread that makes them). Threads that exit meanwhile are skipped."""
        pid = self.pid
        if pid is None or self.returncode is not None:
            return
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        self.nice = nice

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    async def start(self) -> None:
        self._console = _BoundedLog(self.vmdir.console_log, self.console_limit)
        argv = self.argv
        prlimit = shutil.which("prlimit")
        if prlimit is not None:
            # A core dump of QEMU would hold the guest's memory (and any secret in it): never write one.
            # util-linux's prlimit lowers the soft and hard limits of itself, then execs QEMU (same pid);
            # setting it from outside needs CAP_SYS_RESOURCE, which a node in a container may lack.
            argv = [prlimit, "--core=0:0", "--", *argv]
        if self.nice:
            argv = [_tool("nice"), "-n", str(self.nice), *argv]  # coreutils nice: same pid, then exec
        try:
            argv = [*isolation_prefix(self.user, self.extra_groups), *argv]
        except QemuProcessError:
            self._console.close()
            raise
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=str(self.vmdir.run),
                # Its own process group: a Ctrl-C aimed at the node or CLI must not kill VMs behind its back.
                process_group=0,
                close_fds=True,
                pass_fds=self.pass_fds,
            )
        except OSError as exc:
            self._console.close()
            raise QemuProcessError(f"cannot start {self.argv[0]}: {exc}") from exc
        self.vmdir.write_pid(self._proc.pid)
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._pumps = [
            asyncio.create_task(self._pump(self._proc.stdout, self._console.write), name="qemu-console"),
            asyncio.create_task(self._pump(self._proc.stderr, self._stderr.append), name="qemu-stderr"),
        ]

    @staticmethod
    async def _pump(stream: asyncio.StreamReader, sink: object) -> None:
        assert callable(sink)
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            sink(chunk)

    def stderr_text(self) -> str:
        return b"".join(self._stderr).decode(errors="replace").strip()[-4000:]

    def console_tail(self, limit: int = 4000) -> str:
        return self._console.text_tail(limit) if self._console is not None else ""

    def exit_description(self) -> str:
        code = self.returncode
        if code is None:
            return "qemu is running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"qemu was killed by signal {-code} ({signal.Signals(-code).name})"
            return f"qemu was killed by signal {-code}"
        err = self.stderr_text()
        return f"qemu exited with code {code}" + (f": {err}" if err else "")

    async def wait(self) -> int:
        assert self._proc is not None
        code = await self._proc.wait()
        # Drain what QEMU printed before it died so that error messages are complete.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._pumps, return_exceptions=True), 2)
        return code

    async def connect_qmp(self, within: float) -> QMPClient:
        """Connect to the monitor socket, retrying while QEMU sets it up."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + within
        while True:
            if self.returncode is not None:
                await self.wait()
                raise QemuProcessError(self.exit_description())
            if self.vmdir.qmp_socket.exists():
                client = QMPClient(self.vmdir.root.name)
                try:
                    await asyncio.wait_for(client.connect(str(self.vmdir.qmp_socket)),
                                           max(0.1, deadline - loop.time()))
                    self._qmp = client
                    return client
                except Exception as exc:  # ConnectError, OSError, timeouts: QEMU may not be listening yet
                    with contextlib.suppress(Exception):
                        await client.disconnect()
                    if loop.time() >= deadline:
                        raise QemuProcessError(f"QMP did not answer within {within:.0f}s: {exc}") from exc
            elif loop.time() >= deadline:
                raise QemuProcessError(f"QMP socket did not appear within {within:.0f}s")
            # QEMU sets its monitor up within ~40 ms under TCG: look often then (a restore waits on it),
            # less often for a QEMU that takes longer.
            await asyncio.sleep(0.004 if loop.time() - started < 0.25 else 0.02)

    @property
    def monitor(self) -> QMPClient:
        """The connected QMP client (for migration commands); QemuProcessError before connect_qmp()."""
        if self._qmp is None:
            raise QemuProcessError("QMP is not connected")
        return self._qmp

    async def qmp(self, command: str, arguments: dict[str, object] | None = None,
                  within: float = 10) -> object:
        if self._qmp is None:
            raise QemuProcessError("QMP is not connected")
        async with self._qmp_lock:
            return await asyncio.wait_for(self._qmp.execute(command, arguments), within)

    async def _wait_exit(self, within: float) -> bool:
        assert self._proc is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._proc.wait()), within)
            return True
        except TimeoutError:
            return False

    def _signal(self, sig: int) -> None:
        assert self._proc is not None
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)

    async def stop(self, quit_timeout: float = 3.0, term_timeout: float = 3.0) -> str:
        """Make QEMU exit: QMP ``quit``, then SIGTERM, then SIGKILL. Returns which step ended it."""
        if self._proc is None:
            return "never started"
        how = "already exited"
        if self._proc.returncode is None:
            how = "sigkill"
            if self._qmp is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._qmp.execute("quit"), quit_timeout)
                if await self._wait_exit(quit_timeout):
                    how = "qmp quit"
            if self._proc.returncode is None:
                self._signal(signal.SIGTERM)
                if await self._wait_exit(term_timeout):
                    how = "sigterm"
            if self._proc.returncode is None:
                self._signal(signal.SIGKILL)
                await self._proc.wait()
        await self.close()
        return how

    async def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._signal(signal.SIGKILL)
            await self._proc.wait()
        await self.close()

    async def close(self) -> None:
        """Release the monitor connection, pump tasks and log file (the process must have exited)."""
        if self._qmp is not None:
            qmp, self._qmp = self._qmp, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(qmp.disconnect(), 2)
        if self._proc is not None and self._proc.returncode is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*self._pumps, return_exceptions=True), 2)
        for task in self._pumps:
            task.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)
        if self._console is not None:
            self._console.close()
