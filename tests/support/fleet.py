"""Several hosts' worth of capsa on this machine, started as a user would: ``capsa control`` replicas and
``capsa node`` processes with their own state directories (tests/integration/test_multinode.py,
test_fleet_store.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from tests.support.served import CAPSA, ROOT, Served, free_port, spawn

__all__ = ["cli", "enrol_token", "listed_nodes", "start_control", "start_node"]


def cli(url: str, key: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CAPSA_API_URL": url, "CAPSA_API_KEY": key}
    return subprocess.run([*CAPSA, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def start_control(workdir: Path, db_url: str, key: str, env: Mapping[str, str] | None = None) -> Served:
    port = free_port()
    args = ["control", "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(workdir / "control")]
    return spawn(args,
                 url=f"http://127.0.0.1:{port}", state_dir=workdir / "control", log_dir=workdir,
                 env={"CAPSA_DATABASE_URL": db_url, "CAPSA_BOOTSTRAP_KEY": key, **(env or {})},
                 name="control", ready_path="/v1/health", timeout=120)


def enrol_token(control_url: str, key: str) -> str:
    made = cli(control_url, key, "nodes", "token", "--json")
    assert made.returncode == 0, made.stderr
    return str(json.loads(made.stdout)["token"])


def start_node(workdir: Path, name: str, control_url: str, token: str,
               env: Mapping[str, str] | None = None) -> tuple[Served, str]:
    """``capsa node`` with its own state dir (and no warm pool); returns it once it printed
    ``node <id> registered``."""
    state, port = workdir / name, free_port()
    out, err = workdir / f"{name}.out", workdir / f"{name}.err"
    args = ["node", "--control-url", control_url, "--enrol-token", token, "--state-dir", str(state),
            "--listen", f"127.0.0.1:{port}", "--accel", "tcg"]
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([*CAPSA, *args], stdout=o, stderr=e, text=True, cwd=ROOT,
                                env={**os.environ, "CAPSA_POOL_SIZE": "0", **(env or {})})
    node = Served(f"http://127.0.0.1:{port}", state, proc, out, err)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for line in out.read_text().splitlines():
            words = line.split()
            if len(words) == 3 and words[0] == "node" and words[2] == "registered":
                return node, words[1]
        if proc.poll() is not None:
            raise AssertionError(f"capsa node exited {proc.returncode}: {node.errors()}")
        time.sleep(0.3)
    node.stop()
    raise AssertionError(f"capsa node did not register: {node.errors()}")


def listed_nodes(url: str, key: str) -> dict[str, dict[str, object]]:
    listed = cli(url, key, "nodes", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    return {str(n["id"]): n for n in json.loads(listed.stdout)["items"]}
