"""The user-facing path end to end: a real ``capsa serve`` process, the ``capsa`` CLI and the README's
quick start (examples/quickstart.py) as subprocesses, real microVMs (TCG on this host).

After each journey the test checks that nothing of the closed sessions remains on the node: no QEMU
process under the state directory and no VM working directory.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.interrupt import sigint_default
from tests.support.leftovers import wait_no_vm_leftovers
from tests.support.served import CAPSA, KEY_RE, ROOT, Served, capsa, free_port, start_serve

# Every test starts `capsa serve`, whose node restores its warm pool at start.
pytestmark = pytest.mark.vm


def test_bootstrap_key_is_printed_only_on_first_start(fresh_state_dir: Path) -> None:
    state = fresh_state_dir / "state"
    first = start_serve(state, fresh_state_dir, env={"CAPSA_BOOTSTRAP_KEY": ""})
    try:
        match = KEY_RE.search(first.printed())
        assert match
        key = match.group(1)
        keys = capsa(first, key, "keys", "ls", "--json")
        assert keys.returncode == 0, keys.stderr
        assert [k["admin"] for k in json.loads(keys.stdout)["items"]] == [True]
    finally:
        assert first.stop() == 0
    second = start_serve(state, fresh_state_dir, env={"CAPSA_BOOTSTRAP_KEY": ""})
    try:
        assert "csk_" not in second.printed()
        assert capsa(second, key, "keys", "ls").returncode == 0  # the first key still works
    finally:
        assert second.stop() == 0
    given = "csk_givengivengi_" + "g" * 32
    third = start_serve(fresh_state_dir / "state2", fresh_state_dir, env={"CAPSA_BOOTSTRAP_KEY": given})
    try:
        assert given not in third.printed()  # a key the operator chose is never echoed
        assert capsa(third, given, "keys", "ls").returncode == 0
    finally:
        assert third.stop() == 0


def test_a_fresh_state_dir_serves_its_first_session_from_the_template_cache(fresh_state_dir: Path) -> None:
    key = "csk_tplcachetest_" + "t" * 32
    # The first node builds base (or finds it cached already); stopping lets a fresh copy reach the cache.
    first = start_serve(fresh_state_dir / "a", fresh_state_dir, env={"CAPSA_BOOTSTRAP_KEY": key})
    assert '"event": "base template ' in first.errors()  # a log line (JSON: stderr is a file)
    assert first.stop() == 0
    # A node on an empty state dir is ready only with base in place, and it comes from the cache.
    second = start_serve(fresh_state_dir / "b", fresh_state_dir, env={"CAPSA_BOOTSTRAP_KEY": key})
    try:
        assert '"event": "base template restored from the template cache"' in second.errors(), second.errors()
        imported = next((second.state_dir / "storage" / "pool" / "templates").glob("tpl-base-m256c1"))
        for path in [imported, *imported.rglob("*")]:
            st = path.lstat()
            assert st.st_uid == 0 and (st.st_mode & 0o777) == (0o711 if path.is_dir() else 0o600), path
        run = capsa(second, key, "run", "--", "sh", "-c", "echo from-cache")
        assert (run.returncode, run.stdout) == (0, "from-cache\n"), run.stderr
    finally:
        assert second.stop() == 0
    assert wait_no_vm_leftovers(second.state_dir) == []


def test_errors_are_one_line(server: tuple[Served, str]) -> None:
    served, _ = server
    wrong = capsa(served, "csk_wrongwrongwr_" + "w" * 32, "ls")
    assert wrong.returncode == 1 and wrong.stdout == ""
    assert wrong.stderr.startswith("error: unauthorized") and wrong.stderr.count("\n") == 1
    missing = capsa(served, None, "keys", "ls")
    assert missing.returncode == 1 and missing.stderr.startswith("error: unauthorized")
    down = subprocess.run([*CAPSA, "ls"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "CAPSA_API_URL": f"http://127.0.0.1:{free_port()}",
                               "CAPSA_API_KEY": "csk_x_y"})
    assert down.returncode == 1 and down.stderr.startswith("error: cannot reach capsa API")
    assert "Traceback" not in wrong.stderr + missing.stderr + down.stderr


def test_readme_quickstart_runs_and_leaves_nothing(server: tuple[Served, str]) -> None:
    served, admin = server
    made = capsa(served, admin, "keys", "create", "--tenant", "readme", "--json")
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)["key"]
    env = {**os.environ, "CAPSA_API_URL": served.url, "CAPSA_API_KEY": key}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                         text=True, env=env, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    sid = re.search(r"session (ses_\w+) is running", out)
    assert sid, out
    kernel = re.search(r"on kernel (\S+)", out)
    assert kernel and kernel.group(1) != platform.release()  # the code ran under the guest's own kernel
    assert "332833500\n" in out  # sum of squares below 1000, computed in the guest
    assert "read back: hello from inside the sandbox\n" in out
    assert "tick 1\ntick 2\ntick 3\n" in out
    assert f"session {sid.group(1)} is closed" in out

    listed = capsa(served, key, "ls", "--json")
    states = {s["id"]: s["state"] for s in json.loads(listed.stdout)["items"]}
    assert states == {sid.group(1): "closed"}
    assert wait_no_vm_leftovers(served.state_dir) == []


def test_cli_run_exec_ls_close_with_real_vms(server: tuple[Served, str]) -> None:
    served, admin = server
    key = capsa(served, admin, "keys", "create", "--tenant", "cli-e2e").stdout.strip()
    assert key.startswith("csk_")

    run = capsa(served, key, "run", "--", "sh", "-c", "uname -r; echo oops >&2; exit 7")
    assert run.returncode == 7, run.stderr
    assert run.stdout.strip() != platform.release() and run.stderr == "oops\n"
    reverse = "python3 -c 'import sys; print(sys.stdin.read()[::-1])'"
    interactive = capsa(served, key, "run", "-i", "--", reverse, stdin="olleh")
    assert (interactive.returncode, interactive.stdout) == (0, "hello\n"), interactive.stderr
    # The reader of the output goes away early: quiet exit 141, session closed anyway.
    env = {**os.environ, "CAPSA_API_URL": served.url, "CAPSA_API_KEY": key}
    head = subprocess.run(f"set -o pipefail; {CAPSA[0]} run -- 'seq 1 200000' | head -n 1", shell=True,
                          executable="/bin/bash", capture_output=True, text=True, env=env, timeout=600)
    assert (head.returncode, head.stdout) == (141, "1\n"), head.stderr
    assert "Traceback" not in head.stderr and "Exception" not in head.stderr
    assert json.loads(capsa(served, key, "ls", "--state", "running", "--json").stdout)["items"] == []

    # A long-lived session driven by several CLI calls.
    from capsa import Session

    with Session.create(api_url=served.url, api_key=key, metadata={"owner": "e2e"}) as s:
        first = capsa(served, key, "exec", s.id, "--", "sh", "-c", "echo 41 > /tmp/n")
        assert first.returncode == 0, first.stderr
        second = capsa(served, key, "exec", s.id, "--json", "--", "sh", "-c", "echo $(( $(cat /tmp/n) + 1 ))")
        assert json.loads(second.stdout)["stdout"] == "42\n"
        table = capsa(served, key, "ls")
        assert s.id in table.stdout and "owner=e2e" in table.stdout
        closed = capsa(served, key, "close", s.id)
        assert closed.returncode == 0 and closed.stdout == f"{s.id} closed\n"
        gone = capsa(served, key, "exec", s.id, "--", "true")
        assert gone.returncode == 125 and gone.stderr.startswith("error: invalid_state")
    assert wait_no_vm_leftovers(served.state_dir) == []


def test_ctrl_c_on_capsa_run_closes_the_session(server: tuple[Served, str]) -> None:
    served, admin = server
    key = capsa(served, admin, "keys", "create", "--tenant", "ctrl-c").stdout.strip()
    env = {**os.environ, "CAPSA_API_URL": served.url, "CAPSA_API_KEY": key}
    proc = subprocess.Popen([*CAPSA, "run", "--", "echo started; sleep 120"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, preexec_fn=sigint_default)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "started\n"  # the command is running inside the VM
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    items = json.loads(capsa(served, key, "ls", "--json").stdout)["items"]
    assert [s["state"] for s in items] == ["closed"]
    assert wait_no_vm_leftovers(served.state_dir) == []
