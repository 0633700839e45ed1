"""Commands' address-space layout (capsa.guest.layout) through the real guest daemon on a Unix socket:
randomized by default, fixed after ``set_aslr`` false (ADDR_NO_RANDOMIZE handed to the child only), and
randomized again after ``set_aslr`` true. The daemon's own threads never keep the flag."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capsa.guest.layout import ADDR_NO_RANDOMIZE
from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import GuestError
from tests.support.guest_waits import wait_exit
from tests.support.local_guest import LocalGuest, guest_client, local_guest

__all__ = ["guest_client", "local_guest"]

_LIBC_START = "grep -m1 -E '/libc[.-]' /proc/self/maps | cut -d- -f1"


async def _personality(client: GuestClient, cmd: str | list[str] = ("cat", "/proc/self/personality")) -> int:
    result = await client.exec(list(cmd) if isinstance(cmd, tuple) else cmd)
    assert result.exit_code == 0, result.stderr
    return int(result.stdout.strip(), 16)


async def _libc_starts(client: GuestClient, n: int) -> set[str]:
    starts = set()
    for _ in range(n):
        result = await client.exec(_LIBC_START)
        assert result.exit_code == 0 and result.stdout.strip(), result.stderr
        starts.add(result.stdout.decode().strip())
    return starts


def _daemon_flags(pid: int) -> list[int]:
    return [int(Path(f"/proc/{pid}/task/{tid}/personality").read_text(), 16)
            for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(Path("/proc/sys/kernel/randomize_va_space").read_text().strip() == "0",
                    reason="this host does not randomize layouts at all")
async def test_randomized_by_default_fixed_on_request_and_back(guest_client: GuestClient,
                                                             local_guest: LocalGuest) -> None:
    assert not await _personality(guest_client) & ADDR_NO_RANDOMIZE
    assert len(await _libc_starts(guest_client, 4)) > 1

    await guest_client.set_aslr(False)
    assert await _personality(guest_client) & ADDR_NO_RANDOMIZE
    assert await _personality(guest_client, "cat /proc/self/personality") & ADDR_NO_RANDOMIZE  # sh -c too
    assert len(await _libc_starts(guest_client, 4)) == 1
    # A background process is spawned the same way.
    proc = await guest_client.start_process(["cat", "/proc/self/personality"])
    waited = await wait_exit(guest_client, proc.pid, timeout=10)
    assert waited.exit_code == 0
    output = await guest_client.process_output(proc.pid)
    assert int(output.stdout.strip(), 16) & ADDR_NO_RANDOMIZE
    # Only the children carry the flag: every thread of the daemon is as it was.
    assert not any(flags & ADDR_NO_RANDOMIZE for flags in _daemon_flags(local_guest.pid))

    await guest_client.set_aslr(True)
    assert not await _personality(guest_client) & ADDR_NO_RANDOMIZE
    assert len(await _libc_starts(guest_client, 4)) > 1


async def test_set_aslr_wants_a_boolean(guest_client: GuestClient) -> None:
    for bad in ("no", 0, None):
        with pytest.raises(GuestError) as caught:
            await guest_client.call("set_aslr", {"enabled": bad})
        assert caught.value.code == "bad_request"
    assert not await _personality(guest_client) & ADDR_NO_RANDOMIZE
