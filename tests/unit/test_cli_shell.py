"""``capsa shell`` driven through a pseudo-terminal against the API stack (fake runtime: real guest daemons
as host processes): a terminal (``tty``), raw mode (Ctrl-C reaches the remote shell), resize on SIGWINCH,
the exit status passed through, the local terminal restored, and a one-line error without a TTY."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tests.support.api_stack import ApiStack
from tests.support.pty_driver import PtyDriver

pytestmark = pytest.mark.timeout(120)

CAPSA = str(Path(sys.executable).with_name("capsa"))


@pytest.fixture
def stack(stack: ApiStack) -> ApiStack:
    """Shell sessions may outlive the default heartbeat timeout on a loaded machine."""
    return stack


async def _session(stack: ApiStack, key: str) -> str:
    async with stack.client(key) as client:
        made = await client.post("/v1/sessions", json={})
        assert made.status_code == 201, made.text
        return str(made.json()["id"])


def _env(stack: ApiStack, key: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CAPSA_API_URL": stack.url, "CAPSA_API_KEY": key,
            "TERM": "xterm", "HOME": os.environ.get("HOME", "/root")}


async def test_shell_runs_tty_resizes_and_passes_the_exit_status(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    sid = await _session(stack, key)
    async with PtyDriver.spawn([CAPSA, "shell", sid, "--cmd", "PS1='$ ' exec /bin/sh -i"],
                               env=_env(stack, key), cols=91, rows=27) as term:
        term.send(b"tty; stty size; echo mark-$((6*7))\r")
        end = await term.expect(b"mark-42")
        out = term.output.decode(errors="replace")
        assert "/dev/pts/" in out and "27 91" in out
        term.set_size(123, 45)
        term.send(b"stty size\r")
        end = await term.expect(b"45 123", after=end)
        # The foreground program says when it runs: the echo of the typed line came back before the shell
        # had started it, and a Ctrl-C sent then could reach the shell between reading the line and
        # starting the program, which then slept its 100 s (failed under load).
        term.send(b"python3 -c 'import time; print(\"started-\" + str(2+3), flush=True); time.sleep(100)'\r")
        end = await term.expect(b"started-5", after=end)
        term.send(b"\x03")  # raw mode: Ctrl-C goes to the remote shell's foreground program; the shell stays
        term.send(b"echo after-$((1+1))\r")
        await term.expect(b"after-2", after=end)
        term.send(b"exit 3\r")
        assert await term.wait() == 3


async def test_shell_restores_the_local_terminal(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    sid = await _session(stack, key)
    # The outer program checks its terminal's mode before and after `capsa shell` (a child on the same tty).
    probe = (f"import subprocess, sys, termios\nbefore = termios.tcgetattr(0)\n"
             f"code = subprocess.call([{CAPSA!r}, 'shell', {sid!r}, '--cmd', 'exit 7'])\n"
             f"after = termios.tcgetattr(0)\nprint('restored' if before == after else 'changed', code)\n")
    async with PtyDriver.spawn([sys.executable, "-c", probe], env=_env(stack, key)) as term:
        await term.expect(b"restored 7")
        assert await term.wait() == 0


async def test_shell_without_a_tty_is_a_one_line_error(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    sid = await _session(stack, key)
    proc = await asyncio.create_subprocess_exec(CAPSA, "shell", sid, env=_env(stack, key),
                                                stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    stderr = err.decode()
    assert proc.returncode == 2
    assert stderr.count("\n") == 1 and stderr.startswith("error: capsa shell needs a terminal")


async def test_shell_reports_an_unknown_session_in_one_line(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with PtyDriver.spawn([CAPSA, "shell", "ses_doesnotexist0000000000"], env=_env(stack, key)) as term:
        assert await term.wait() == 1
        text = term.output.decode(errors="replace").strip()
        assert text.startswith("error: ") and "not_found" in text and "\n" not in text
