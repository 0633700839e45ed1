"""gVisor ``runsc`` as a peer: an OCI bundle over capsa's guest rootfs, no network.

Two figures per runsc build:

* ``create_first_exec_s``: ``runsc run --detach`` of a long-lived init (``sleep infinity``) then
  ``runsc exec <id> true``: a sandbox is up and has run its first command, like capsa's create + first
  exec. Deleting it is outside the timing.
* ``run_true_oneshot_s``: ``runsc run`` of ``true`` alone, which also tears the sandbox down.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from peers.install import PeerUnavailable

__all__ = ["measure_runsc"]


def _write_bundle(bundle: Path, rootfs: Path, args: list[str]) -> None:
    config = {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": args,
                    "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "cwd": "/"},
        # The shared rootfs copy is read-only; writes go to the tmpfs mounts.
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "peer",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")]},
    }
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(config))


class _Runsc:
    def __init__(self, exe: Path, platform: str, state: Path) -> None:
        self.base = [str(exe), "--root", str(state), "--network=none", f"--platform={platform}"]
        self.live: list[str] = []

    def __call__(self, *args: str, timeout: float = 120) -> None:
        # A detached sandbox inherits runsc's stdout/stderr and keeps them open, so reading them
        # through pipes would wait for the sandbox to exit: they go to a file instead.
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.run([*self.base, *args], stdout=log, stderr=log, timeout=timeout,
                                  check=False, stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                log.seek(0)
                tail = " | ".join(log.read().strip().splitlines()[-3:])
                raise PeerUnavailable(f"runsc {args[0]} exited {proc.returncode}: {tail}")

    def delete(self, cid: str) -> None:
        subprocess.run([*self.base, "delete", "--force", cid], capture_output=True, check=False, timeout=60)
        if cid in self.live:
            self.live.remove(cid)


def measure_runsc(exe: Path, platform: str, rootfs: Path, n: int) -> dict[str, Any]:
    """Times both figures ``n`` times each; every container is deleted, the state dir removed."""
    work = Path(tempfile.mkdtemp(prefix="capsa-bench-runsc-", dir="/var/tmp"))
    runsc = _Runsc(exe, platform, work / "state")
    try:
        _write_bundle(work / "daemon", rootfs, ["sleep", "infinity"])
        _write_bundle(work / "oneshot", rootfs, ["true"])
        # One unmeasured round so page cache and the binary's first start are not in the figures.
        runsc("run", "--bundle", str(work / "oneshot"), "warmup")
        runsc.delete("warmup")
        create: list[float] = []
        oneshot: list[float] = []
        for i in range(n):
            cid = f"peer{i}"
            t0 = time.perf_counter()
            runsc.live.append(cid)
            runsc("run", "--detach", "--bundle", str(work / "daemon"), cid)
            runsc("exec", cid, "true")
            create.append(time.perf_counter() - t0)
            runsc.delete(cid)
            cid = f"once{i}"
            t0 = time.perf_counter()
            runsc.live.append(cid)
            runsc("run", "--bundle", str(work / "oneshot"), cid)
            oneshot.append(time.perf_counter() - t0)
            runsc.delete(cid)
        version = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                                 check=False).stdout.splitlines()[0]
        return {"create_first_exec": create, "run_true_oneshot": oneshot, "version": version}
    finally:
        for cid in list(runsc.live):
            runsc.delete(cid)
        shutil.rmtree(work, ignore_errors=True)
