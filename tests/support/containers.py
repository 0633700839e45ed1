"""capsa's container image under test: built (or reused) by scripts/build_image.py, run with podman the way
the Kubernetes manifests run it, stopped with SIGTERM, and the host checked for what it may leave behind
(tests/integration/test_container_fleet.py)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.served import ROOT

__all__ = ["Container", "HostSnapshot", "build_capsa_image", "containers_labelled", "host_snapshot",
           "loop_devices_into", "run_container"]

LABEL = "io.capsa.test"


def _host_options() -> list[str]:
    """podman run options every container of the tests needs on these machines, none of which changes
    what capsa does in it: runc, because crun refuses the hybrid cgroup hierarchy these hosts have (v1
    controllers beside a v2 mount); and this process's own open-file and process limits, because these
    hosts do not let root raise a limit (podman's defaults are higher; it clamps its own process limit to
    pid_max)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    procs = [n if n != resource.RLIM_INFINITY else pid_max for n in nproc]
    return ["--runtime", "runc", "--ulimit", f"nofile={nofile[0]}:{nofile[1]}",
            "--ulimit", f"nproc={min(procs[0], pid_max)}:{min(procs[1], pid_max)}"]


def build_capsa_image() -> dict[str, object]:
    """scripts/build_image.py's JSON: builds ``localhost/capsa:<key>`` or reuses it (venv: this Python's)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_image.py"), "--json",
                           "--venv", str(Path(sys.prefix))],
                          capture_output=True, text=True, timeout=3600, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout)
    return result


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)


@dataclass
class Container:
    """A detached podman container of the test run ``run_id``."""

    name: str

    def logs(self) -> str:
        """What it printed (stdout, then stderr)."""
        done = _podman("logs", self.name)
        return done.stdout + done.stderr

    def running(self) -> bool:
        state = _podman("inspect", "--format", "{{.State.Running}}", self.name)
        return state.stdout.strip() == "true"

    def wait_for_line(self, predicate: str, timeout: float = 600) -> str:
        """The first line of its output containing ``predicate``; fails if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.logs().splitlines():
                if predicate in line:
                    return line
            assert self.running(), f"{self.name} exited: {self.logs()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"{self.name} printed no {predicate!r}: {self.logs()[-3000:]}")

    def wait_http(self, url: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.running(), f"{self.name} exited: {self.logs()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"{url} did not answer 200: {self.logs()[-3000:]}")

    def stop(self, timeout: float = 180) -> int:
        """SIGTERM (what the kubelet sends), then its exit status once it has exited; the container is
        removed. SIGKILL only after ``timeout`` (then the status says so)."""
        _podman("kill", "--signal", "TERM", self.name)
        waited = _podman("wait", "--interval", "500ms", self.name, timeout=timeout + 10)
        if waited.returncode != 0:
            _podman("kill", "--signal", "KILL", self.name)
            _podman("wait", self.name)
            code = -9
        else:
            code = int(waited.stdout.strip() or -1)
        return code

    def remove(self) -> None:
        _podman("rm", "--force", "--time", "0", self.name)


def run_container(image: str, name: str, run_id: str, args: Sequence[str], *, env: Mapping[str, str],
                  mounts: Mapping[Path, str] = {}, options: Sequence[str] = ()) -> Container:
    """``podman run -d`` on the host network (see the test's docstring), labelled with ``run_id``;
    ``mounts``: host path -> container path (``:ro`` appended for read-only); ``options``: more of
    podman run's (user, privileges, tmpfs)."""
    argv = ["run", "--detach", "--name", name, "--label", f"{LABEL}={run_id}", "--network", "host",
            "--stop-signal", "TERM", *_host_options(), *options]
    for key, value in sorted(env.items()):
        argv += ["--env", f"{key}={value}"]
    for host, inside in mounts.items():
        argv += ["--volume", f"{host}:{inside}"]
    started = _podman(*argv, image, *args)
    assert started.returncode == 0, started.stderr
    return Container(name)


def containers_labelled(run_id: str) -> list[str]:
    """Containers (running or not) of the test run ``run_id``."""
    listed = _podman("ps", "--all", "--filter", f"label={LABEL}={run_id}", "--format", "{{.Names}}")
    return listed.stdout.split()


@dataclass(frozen=True)
class HostSnapshot:
    """What node containers on the host network could leave on the host (loop devices, network namespaces,
    links, nftables tables, mounts), limited to the lines naming one of the snapshot's needles (paths and
    prefixes of the test), so other work on the host does not count."""

    items: frozenset[str]

    def added_since(self, before: HostSnapshot) -> list[str]:
        return sorted(self.items - before.items)


def loop_devices_into(root: Path) -> list[str]:
    """Loop devices whose backing file is a file under ``root``, found by device and inode: a loop device
    attached in a container names its file by the path inside the container's bind mount (``/f`` for
    ``HOST/f`` mounted at ``/``), not the host's."""
    inodes = {(st.st_dev, st.st_ino) for f in root.rglob("*") if f.is_file() and not f.is_symlink()
              for st in [f.stat()]}
    listed = subprocess.run(["losetup", "--list", "--noheadings", "--raw", "--output",
                             "NAME,BACK-MAJ:MIN,BACK-INO"], capture_output=True, text=True, check=True)
    found = []
    for line in listed.stdout.splitlines():
        name, majmin, ino = line.replace("\\x20", "").split()
        major, minor = (int(n) for n in majmin.split(":"))
        if (os.makedev(major, minor), int(ino)) in inodes:
            found.append(f"loop device {name} -> a file under {root} (inode {ino})")
    return found


def host_snapshot(needles: Sequence[str]) -> HostSnapshot:
    items = {f"loop device {p.parent.parent.name} -> {p.read_text().strip()}"
             for p in Path("/sys/block").glob("loop*/loop/backing_file")}
    run = Path("/run/netns")
    items |= {f"netns {p.name}" for p in run.iterdir()} if run.is_dir() else set()
    items |= {f"link {p.name}" for p in Path("/sys/class/net").iterdir()}
    nft = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout
    items |= {f"nft {line}" for line in nft.splitlines()}
    items |= {f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    return HostSnapshot(frozenset(i for i in items if any(n in i for n in needles)))
