"""A ``capsa serve`` process under test (and the ``capsa`` CLI against it): start it, wait until it is
ready, stop it with the signal a test chooses, read what it printed.

:func:`spawn` is the general form (any ``capsa`` subcommand that serves HTTP with a readiness route);
:func:`start_serve` starts ``capsa serve`` the way the end-to-end tests run it. Pair a stop with
:mod:`tests.support.leftovers` to check that nothing stayed behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.vm import searchable_dir

__all__ = [
    "CAPSA",
    "KEY_RE",
    "ROOT",
    "START_TIMEOUT",
    "Served",
    "capsa",
    "free_port",
    "serve_workdir",
    "spawn",
    "start_serve",
]

ROOT = Path(__file__).resolve().parents[2]
CAPSA = [str(Path(sys.executable).with_name("capsa"))]
KEY_RE = re.compile(r"bootstrap admin key.*?(csk_[A-Za-z0-9_]+)")
START_TIMEOUT = 600.0  # the first start may build the guest image


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    """A running ``capsa`` server process; its stdout and stderr go to files in the log directory."""

    url: str
    state_dir: Path
    proc: subprocess.Popen[str]
    stdout: Path
    stderr: Path

    def printed(self) -> str:
        return self.stdout.read_text()

    def errors(self, tail: int = 2000) -> str:
        """The end of what it wrote to stderr (for assertion messages)."""
        return self.stderr.read_text()[-tail:]

    def bootstrap_key(self) -> str:
        """The admin key printed on the first start (``CAPSA_BOOTSTRAP_KEY=""``)."""
        match = KEY_RE.search(self.printed())
        assert match, f"no bootstrap key printed: {self.printed()!r}"
        return match.group(1)

    def stop(self, sig: signal.Signals = signal.SIGINT, timeout: float = 60.0) -> int:
        """Send ``sig`` (SIGINT: Ctrl-C; SIGTERM: systemd, Kubernetes, ``kill``) and wait for the exit;
        SIGKILL after ``timeout``. Returns the exit status (negative: killed by that signal)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def spawn(args: Sequence[str], *, url: str, state_dir: Path, log_dir: Path, env: dict[str, str] | None = None,
          name: str = "serve", ready_path: str = "/v1/ready", timeout: float = START_TIMEOUT,
          prefix: Sequence[str] = ()) -> Served:
    """Run ``capsa <args>`` from the repository root and wait until ``GET url+ready_path`` answers 200.
    ``CAPSA_API_KEY`` is removed from the environment; ``env`` is laid over it. Logs go to
    ``log_dir/<name>-<n>.out|err``. Raises AssertionError (with the stderr tail) if it exits or is not
    ready within ``timeout``. ``prefix``: a command that runs ``capsa`` (e.g. ``unshare`` with a private
    mount namespace)."""
    n = len(list(log_dir.glob(f"{name}-*.out")))
    out, err = log_dir / f"{name}-{n}.out", log_dir / f"{name}-{n}.err"
    full_env = {**os.environ, **(env or {})}
    full_env.pop("CAPSA_API_KEY", None)
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([*prefix, *CAPSA, *args], stdout=o, stderr=e, text=True, env=full_env,
                                cwd=ROOT)
    served = Served(url, state_dir, proc, out, err)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"capsa {args[0]} exited {proc.returncode}: {served.errors()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}{ready_path}", timeout=2).status_code == 200:
                return served
        time.sleep(0.3)
    served.stop()
    raise AssertionError(f"capsa {args[0]} did not become ready: {served.errors()}")


def start_serve(state_dir: Path, log_dir: Path, env: dict[str, str] | None = None,
                prefix: Sequence[str] = ()) -> Served:
    """``capsa serve`` on a free port with TCG and no warm pool unless ``env`` asks for one
    (``CAPSA_POOL_SIZE``): the "nothing left" checks then mean exactly no VM (a pool keeps idle VMs by
    design). Creation still goes through template restore."""
    port = free_port()
    return spawn(["serve", "--port", str(port), "--state-dir", str(state_dir), "--accel", "tcg"],
                 url=f"http://127.0.0.1:{port}", state_dir=state_dir, log_dir=log_dir,
                 env={"CAPSA_POOL_SIZE": "0", **(env or {})}, prefix=prefix)


def capsa(served: Served, key: str | None, *args: str, stdin: str | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The ``capsa`` CLI against ``served`` with API key ``key`` (``None``: no key at all)."""
    env = {**os.environ, "CAPSA_API_URL": served.url}
    env.pop("CAPSA_API_KEY", None)
    if key is not None:
        env["CAPSA_API_KEY"] = key
    return subprocess.run([*CAPSA, *args], capture_output=True, text=True, env=env, input=stdin,
                          timeout=timeout, cwd=ROOT)


@contextlib.contextmanager
def serve_workdir(prefix: str = "capsa-e2e-") -> Iterator[Path]:
    """A directory for a served process's state and logs, removed afterwards (see :func:`searchable_dir`)."""
    with searchable_dir(prefix, mode=0o755) as path:
        yield path
