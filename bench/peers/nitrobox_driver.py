"""Runs inside the nitrobox virtualenv (python3.13): times nitrobox create + first ``true``.

Usage: ``python nitrobox_driver.py ROOTFS N WORKDIR``; prints one JSON object on stdout.

nitrobox resolves an image's config (entrypoint, env, workdir) before every creation and, for a name it
does not know, asks a container registry; on this offline host that lookup alone takes ~37 s of DNS
time-outs per sandbox. The rootfs here is a plain directory with no image config, so its (empty) config
is put in nitrobox's in-memory image store first, as a lookup that had succeeded would have left it.
The first (unmeasured) creation is timed separately as ``first_create_s``.
"""

from __future__ import annotations

import json
import sys
import time

from nitrobox import Sandbox, SandboxConfig  # type: ignore[import-not-found]  # lives in the peer's own venv
from nitrobox.image.store import _image_store_populate  # type: ignore[import-not-found]  # lives in the peer's own venv


def main() -> None:
    rootfs, n, work = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    _image_store_populate(rootfs, {"cmd": None, "entrypoint": None, "env": {}, "working_dir": "/",
                                   "exposed_ports": []})

    def config() -> SandboxConfig:
        return SandboxConfig(image=rootfs, env_base_dir=f"{work}/env", rootfs_cache_dir=f"{work}/cache",
                             net_isolate=True)

    t0 = time.perf_counter()
    box = Sandbox(config(), name="warmup")
    out, code = box.run("true")
    first = time.perf_counter() - t0
    box.delete()
    if code != 0:
        raise SystemExit(f"nitrobox: `true` exited {code}: {out}")
    samples: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        box = Sandbox(config(), name=f"peer{i}")
        try:
            out, code = box.run("true")
            samples.append(time.perf_counter() - t0)
        finally:
            box.delete()
        if code != 0:
            raise SystemExit(f"nitrobox: `true` exited {code}: {out}")
    print(json.dumps({"create_first_exec": samples, "first_create_s": first}))


if __name__ == "__main__":
    main()
