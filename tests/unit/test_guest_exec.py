"""Commands through the real guest daemon (a host process on a Unix socket): exec, background
processes, terminals, health, entropy, and bad requests."""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import platform
import pwd
import signal
import uuid

import pytest

from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import GuestError
from tests.support.guest_waits import wait_exit
from tests.support.local_guest import LocalGuest, guest_client, local_guest
from tests.support.processes import processes_with

__all__ = ["guest_client", "local_guest"]


async def wait_present(marker: str, tries: int = 200) -> list[int]:
    for _ in range(tries):
        found = processes_with(marker)
        if found:
            return found
        await asyncio.sleep(0.05)
    return []


async def wait_gone(marker: str, tries: int = 100) -> list[int]:
    for _ in range(tries):
        left = processes_with(marker)
        if not left:
            return []
        await asyncio.sleep(0.05)
    return processes_with(marker)


def rss_kib(pid: int | str = "self", field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


async def test_health(guest_client: GuestClient, local_guest: LocalGuest) -> None:
    h = await guest_client.health()
    assert h["status"] == "ok" and h["protocol"] == 1 and h["version"]
    assert h["pid"] == local_guest.pid
    assert h["kernel"] == platform.release()  # on a host, the host's kernel: the VM tests check it differs
    assert isinstance(h["uptime"], float) and h["uptime"] > 0


async def test_exec_shell_string_and_argv(guest_client: GuestClient) -> None:
    r = await guest_client.exec("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.signal, r.stdout, r.stderr) == (7, None, b"out\n", b"err\n")
    assert not r.timed_out and not r.stdout_truncated and r.duration > 0
    r = await guest_client.exec(["printf", "%s|", "a b", "$HOME", "*"])
    assert r.stdout == b"a b|$HOME|*|" and r.exit_code == 0


async def test_exec_env_cwd_and_user(guest_client: GuestClient, tmp_path: os.PathLike[str]) -> None:
    r = await guest_client.exec("echo $FOO-$PATH; pwd", env={"FOO": "bar"}, cwd=str(tmp_path))
    lines = r.stdout.decode().splitlines()
    assert lines[0].startswith("bar-/usr/local/sbin") and lines[1] == str(tmp_path)
    nobody = pwd.getpwnam("nobody")
    r = await guest_client.exec(["sh", "-c", "id -u; id -g; echo $HOME"], user="nobody", cwd="/")
    assert r.stdout.decode().split() == [str(nobody.pw_uid), str(nobody.pw_gid), nobody.pw_dir]


async def test_exec_bad_input_is_a_clear_error(guest_client: GuestClient) -> None:
    with pytest.raises(GuestError) as e:
        await guest_client.exec(["/no/such/binary"])
    assert e.value.code == "not_found" and "/no/such/binary" in e.value.message
    with pytest.raises(GuestError) as e:
        await guest_client.exec("true", cwd="/no/such/dir")
    assert e.value.code == "not_found"
    with pytest.raises(GuestError) as e:
        await guest_client.exec("true", cwd="relative")
    assert e.value.code == "bad_request"
    with pytest.raises(GuestError) as e:
        await guest_client.exec("true", user="no-such-user-capsa")
    assert e.value.code == "not_found"
    with pytest.raises(GuestError) as e:
        await guest_client.exec([])
    assert e.value.code == "bad_request"
    with pytest.raises(GuestError) as e:
        await guest_client.exec("true", env={"A=B": "x"})
    assert e.value.code == "bad_request"
    with pytest.raises(GuestError) as e:
        await guest_client.exec("true", timeout=-1)
    assert e.value.code == "bad_request"
    assert (await guest_client.exec("true")).exit_code == 0  # the daemon is fine


async def test_exec_reports_signals(guest_client: GuestClient) -> None:
    r = await guest_client.exec("kill -9 $$")
    assert r.exit_code is None and r.signal == signal.SIGKILL


async def test_exec_streams_stdin(guest_client: GuestClient) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # several windows of credit
    r = await guest_client.exec("sha256sum", stdin=data)
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    r = await guest_client.exec("wc -c", stdin=b"")
    assert r.stdout.strip() == b"0"
    # A command that never reads its stdin still finishes; the upload is abandoned, not stuck.
    r = await guest_client.exec("exit 3", stdin=os.urandom(8 * 1024 * 1024))
    assert r.exit_code == 3


async def test_exec_callbacks_see_output_as_it_arrives(guest_client: GuestClient) -> None:
    seen: list[tuple[str, bytes]] = []

    async def on_err(chunk: bytes) -> None:
        seen.append(("err", chunk))

    r = await guest_client.exec("for i in 1 2 3; do echo $i; echo e$i >&2; sleep 0.05; done",
                                on_stdout=lambda c: seen.append(("out", c)), on_stderr=on_err)
    assert b"".join(c for k, c in seen if k == "out") == r.stdout == b"1\n2\n3\n"
    assert b"".join(c for k, c in seen if k == "err") == r.stderr == b"e1\ne2\ne3\n"
    assert len([k for k, _ in seen if k == "out"]) >= 2  # streamed, not one chunk at the end


async def test_exec_timeout_kills_the_process_group(guest_client: GuestClient) -> None:
    marker = f"capsa-timeout-{uuid.uuid4().hex}"
    r = await guest_client.exec(f"sh -c 'sleep 300; : {marker}' & sh -c 'sleep 300; : {marker}'; echo never",
                                timeout=0.5)
    assert r.timed_out and r.signal == signal.SIGKILL and r.exit_code is None and b"never" not in r.stdout
    assert await wait_gone(marker) == []


async def test_the_command_becomes_the_spawned_process_with_its_argv_intact(
        guest_client: GuestClient) -> None:
    # The daemon spawns through a held shell shim that execs the program in place: the reported pid is the
    # program's own, it is a session leader, and argv (options-like words included) reaches it verbatim.
    r = await guest_client.exec(["cat", "/proc/self/stat"])
    fields = r.stdout.decode().rsplit(")", 1)[1].split()
    comm = r.stdout.decode().split("(", 1)[1].rsplit(")", 1)[0]
    pid = int(r.stdout.split()[0])
    assert (comm, pid, int(fields[2]), int(fields[3])) == ("cat", r.pid, r.pid, r.pid)  # pgrp, session
    r = await guest_client.exec(["sh", "-c", 'echo "$0|$1|$2|$$"', "-x", "--", "-n"])
    assert r.stdout.decode() == f"-x|--|-n|{r.pid}\n"
    r = await guest_client.exec("echo $0; exit 5")
    assert (r.stdout, r.exit_code) == (b"/bin/sh\n", 5)
    # A shell command line keeps the shell's own diagnostics: line numbers, and syntax errors before
    # anything runs.
    r = await guest_client.exec("true\ncapsa-no-such-program-xyz")
    assert r.exit_code == 127 and b": 2: " in r.stderr and b"capsa-no-such-program-xyz" in r.stderr
    r = await guest_client.exec("echo ran; if")
    assert r.exit_code == 2 and r.stdout == b"" and b"Syntax error" in r.stderr


async def test_program_lookup_errors_match_exec(guest_client: GuestClient,
                                                tmp_path: pathlib.Path) -> None:
    folder = str(tmp_path)
    (tmp_path / "prog").write_text('#!/bin/sh\necho ran "$@"\n')
    os.chmod(os.path.join(folder, "prog"), 0o644)
    with pytest.raises(GuestError) as e:
        await guest_client.exec(["./prog"], cwd=folder)
    assert e.value.code == "permission_denied" and "./prog" in e.value.message
    with pytest.raises(GuestError) as e:
        await guest_client.exec([folder])  # a directory
    assert e.value.code == "permission_denied"
    with pytest.raises(GuestError) as e:
        await guest_client.exec(["capsa-no-such-program-anywhere"])
    assert e.value.code == "not_found" and "capsa-no-such-program-anywhere" in e.value.message
    os.chmod(os.path.join(folder, "prog"), 0o755)
    r = await guest_client.exec(["./prog", "a"], cwd=folder)
    assert r.stdout == b"ran a\n"
    r = await guest_client.exec(["prog", "b"], cwd="/", env={"PATH": folder})  # PATH of the command's env
    assert r.stdout == b"ran b\n"


async def test_exec_timeout_kills_grandchildren(guest_client: GuestClient) -> None:
    marker = f"capsa-grandchild-{uuid.uuid4().hex}"
    r = await guest_client.exec(f"sh -c 'sh -c \"sleep 300; : {marker}\" & wait'; echo never", timeout=0.5)
    assert r.timed_out and r.signal == signal.SIGKILL and b"never" not in r.stdout
    assert await wait_gone(marker) == []


async def test_exec_output_beyond_the_limit_is_truncated_and_drained(guest_client: GuestClient) -> None:
    r = await guest_client.exec("head -c 100000 /dev/zero; echo tail >&2", max_output=1000)
    assert (len(r.stdout), r.stdout_truncated, r.stderr, r.stderr_truncated) == (1000, True, b"tail\n", False)
    assert r.exit_code == 0


async def test_one_gib_of_output_keeps_both_sides_bounded(guest_client: GuestClient,
                                                          local_guest: LocalGuest) -> None:
    before = rss_kib()
    seen = 0

    def count(chunk: bytes) -> None:
        nonlocal seen
        seen += len(chunk)

    r = await guest_client.exec("head -c 1073741824 /dev/zero; echo done >&2", on_stdout=count)
    grew_mib = (rss_kib() - before) / 1024
    daemon_peak_mib = rss_kib(local_guest.pid or 0, "VmHWM") / 1024
    print(f"1 GiB exec: client RSS growth {grew_mib:.1f} MiB, daemon peak RSS {daemon_peak_mib:.1f} MiB, "
          f"{r.duration:.2f} s")
    assert r.exit_code == 0 and r.stderr == b"done\n"
    assert r.stdout_truncated and len(r.stdout) == seen == 16 * 1024 * 1024
    assert grew_mib < 100
    assert daemon_peak_mib < 100


async def test_cancelling_exec_kills_the_command(guest_client: GuestClient) -> None:
    marker = f"capsa-cancel-{uuid.uuid4().hex}"
    task = asyncio.create_task(guest_client.exec(["sh", "-c", f"sleep 300; : {marker}"]))
    assert await wait_present(marker)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_gone(marker) == []
    assert (await guest_client.exec("echo still-here")).stdout == b"still-here\n"


async def test_host_disconnect_cancels_exec_but_background_processes_survive(local_guest: LocalGuest) -> None:
    marker = f"capsa-disc-{uuid.uuid4().hex}"
    first = await local_guest.client()
    bg = await first.start_process(["sh", "-c", f"echo started; sleep 300; : bg-{marker}"])
    task = asyncio.create_task(first.exec(["sh", "-c", f"sleep 300; : fg-{marker}"]))
    assert await wait_present(f"fg-{marker}")
    await first.close()
    with pytest.raises(GuestError):
        await task
    assert await wait_gone(f"fg-{marker}") == []
    second = await local_guest.client()
    info = (await wait_exit(second, bg.pid, timeout=0.1))
    assert info.running
    assert (await second.process_output(bg.pid)).stdout == b"started\n"
    await second.kill_process(bg.pid, signal.SIGKILL)
    assert await wait_gone(f"bg-{marker}") == []


async def test_background_process_lifecycle(guest_client: GuestClient) -> None:
    p = await guest_client.start_process("echo one; sleep 0.3; echo two >&2; sleep 300", env={"X": "1"})
    assert p.running and p.pid > 0 and p.exit_code is None and p.started_at > 0
    # Other work goes on meanwhile.
    assert (await guest_client.exec("echo between")).stdout == b"between\n"
    assert p.pid in [q.pid for q in await guest_client.list_processes() if q.running]
    waited = await wait_exit(guest_client, p.pid, timeout=0.6)
    assert waited.running  # wait with a timeout returns the state, still running
    out = await guest_client.process_output(p.pid)
    assert (out.stdout, out.stderr, out.running) == (b"one\n", b"two\n", True)
    killed = await guest_client.kill_process(p.pid, signal.SIGTERM)
    assert not killed.running and killed.signal == signal.SIGTERM
    final = await wait_exit(guest_client, p.pid)
    assert final.signal == signal.SIGTERM and final.finished_at is not None
    done = await guest_client.start_process(["sh", "-c", "exit 4"])
    assert (await wait_exit(guest_client, done.pid, timeout=10)).exit_code == 4


async def test_background_output_is_a_bounded_ring_with_offsets(guest_client: GuestClient) -> None:
    p = await guest_client.start_process("head -c 3145728 /dev/zero | tr '\\0' a; printf END")
    await wait_exit(guest_client, p.pid, timeout=30)
    out = await guest_client.process_output(p.pid)
    assert out.stdout_truncated and len(out.stdout) == 1024 * 1024
    assert out.stdout.endswith(b"aEND") and out.stdout_end == 3 * 1024 * 1024 + 3
    newer = await guest_client.process_output(p.pid, stdout_from=out.stdout_end - 2)
    assert newer.stdout == b"ND" and not newer.stdout_truncated


async def test_background_process_errors(guest_client: GuestClient) -> None:
    with pytest.raises(GuestError) as e:
        await wait_exit(guest_client, 999999999)
    assert e.value.code == "no_such_process"
    with pytest.raises(GuestError) as e:
        await guest_client.start_process(["/no/such/thing"])
    assert e.value.code == "not_found"
    p = await guest_client.start_process("sleep 300")
    with pytest.raises(GuestError) as e:
        await guest_client.kill_process(p.pid, 0)
    assert e.value.code == "bad_request"
    await guest_client.kill_process(p.pid, signal.SIGKILL)


async def test_pty_session(guest_client: GuestClient) -> None:
    pty = await guest_client.pty_open(["/bin/sh"], rows=30, cols=100, env={"PS1": "$ "})
    assert pty.pid > 0
    reader = pty.read()
    out = b""

    async def until(needle: bytes) -> None:
        nonlocal out
        while needle not in out:
            out += await anext(reader)

    await pty.write(b"tty; stty size\n")
    await until(b"30 100\r\n")
    await pty.resize(120, 40)
    await pty.write(b"stty size; exit 5\n")
    async for chunk in reader:
        out += chunk
    text = out.decode(errors="replace")
    assert "/dev/pts/" in text and "40 120" in text
    assert pty.exit_code == 5 and pty.closed


async def test_pty_close_hangs_up(guest_client: GuestClient) -> None:
    marker = f"capsa-pty-{uuid.uuid4().hex}"
    pty = await guest_client.pty_open(["sh", "-c", f"sleep 300; : {marker}"])
    assert await wait_present(marker)
    await pty.close()
    assert pty.closed
    assert await wait_gone(marker) == []


async def test_reseed_and_clock(guest_client: GuestClient) -> None:
    await guest_client.reseed()  # RNDADDENTROPY + RNDRESEEDCRNG on this host's /dev/random (as root)
    await guest_client.reseed(b"x" * 64)
    with pytest.raises(GuestError) as e:
        await guest_client.reseed(b"short")
    assert e.value.code == "bad_request"
    # The local daemon refuses to touch the host clock; the VM tests set the guest's.
    with pytest.raises(GuestError) as e:
        await guest_client.set_clock()
    assert e.value.code == "unsupported"
    with pytest.raises(GuestError) as e:
        await guest_client.set_clock(-5)
    assert e.value.code == "bad_request"


async def test_unknown_op_and_bad_arguments(guest_client: GuestClient) -> None:
    with pytest.raises(GuestError) as e:
        await guest_client.call("no_such_op")
    assert e.value.code == "unknown_op"
    bad: list[tuple[str, dict[str, object]]] = [
        ("exec", {"cmd": 5}), ("exec", {"cmd": "true", "max_output": "x"}), ("file_read", {"path": 3}),
        ("proc_kill", {"pid": "x"}), ("pty_open", {"rows": 0}), ("exec", {"cmd": "true", "stdin": "yes"})]
    for op, args in bad:
        with pytest.raises(GuestError) as e:
            await guest_client.call(op, args)
        assert e.value.code == "bad_request", (op, args)
    with pytest.raises(GuestError) as e:
        await guest_client.poweroff()
    assert e.value.code == "unsupported"


async def test_concurrent_requests_are_multiplexed(guest_client: GuestClient,
                                                   tmp_path: os.PathLike[str]) -> None:
    async def one(i: int) -> None:
        r = await guest_client.exec(f"sleep 0.{i % 5}; echo {i}")
        assert r.stdout == f"{i}\n".encode()
        data = os.urandom(100_000 + i)
        path = f"{tmp_path}/f{i}"
        await guest_client.write_file(path, data)
        assert await guest_client.read_file(path) == data

    await asyncio.gather(*(one(i) for i in range(24)))


async def test_a_stalled_reader_does_not_block_other_requests(guest_client: GuestClient,
                                                              tmp_path: os.PathLike[str]) -> None:
    path = f"{tmp_path}/big"
    await guest_client.write_file(path, os.urandom(8 * 1024 * 1024))
    stream = guest_client.iter_file(path)
    first = await anext(stream)  # take one chunk, then stop reading: the guest runs out of credit
    assert first
    r = await asyncio.wait_for(guest_client.exec("echo ok"), 30)
    assert r.stdout == b"ok\n"
    await stream.aclose()


async def test_set_hostname_is_validated_and_refused_on_a_host(guest_client: GuestClient) -> None:
    for bad in ["", "-x", "a b", "x" * 65, "é"]:
        with pytest.raises(GuestError) as e:
            await guest_client.set_hostname(bad)
        assert e.value.code == "bad_request", bad
    with pytest.raises(GuestError) as e:
        await guest_client.set_hostname("sandbox-1")
    assert e.value.code == "unsupported"
