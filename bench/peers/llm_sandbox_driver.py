"""Runs inside the bench's own virtualenv: times llm-sandbox session open + first ``true``.

Usage: ``python llm_sandbox_driver.py N N_ENV``; ``bwrap`` must be on PATH. Prints one JSON object.

llm-sandbox's default backend is Docker, which needs a Docker daemon (none runs on these hosts); its
daemonless ``bubblewrap`` backend runs commands in fresh namespaces over the host's own read-only
directories. Two figures:

* ``create_first_exec``: ``skip_environment_setup=True`` (no per-session Python virtualenv): the sandbox
  and its workspace, then ``true``;
* ``create_first_exec_python_env``: the default for ``lang="python"``, which builds a virtualenv in the
  session's workspace when it opens (seconds; fewer samples).
"""

from __future__ import annotations

import json
import os
import sys
import time

from llm_sandbox import SandboxSession  # type: ignore[import-not-found]  # lives in the peer's own venv


def _one(skip_env: bool) -> float:
    t0 = time.perf_counter()
    session = SandboxSession(backend="bubblewrap", lang="python", skip_environment_setup=skip_env)
    session.open()
    try:
        result = session.execute_command("true")
        elapsed = time.perf_counter() - t0
    finally:
        session.close()
    if result.exit_code != 0:
        raise SystemExit(f"llm-sandbox: `true` exited {result.exit_code}: {result.stderr}")
    return elapsed


def main() -> None:
    n, n_env = int(sys.argv[1]), int(sys.argv[2])
    _one(True)  # unmeasured warm-up
    fast = [_one(True) for _ in range(n)]
    slow = [_one(False) for _ in range(n_env)]
    docker = os.path.exists("/var/run/docker.sock")
    print(json.dumps({
        "create_first_exec": fast,
        "create_first_exec_python_env": slow,
        "docker_backend": "Docker daemon socket present (not measured here)" if docker else
                          "no Docker daemon on this host (/var/run/docker.sock absent)",
    }))


if __name__ == "__main__":
    main()
