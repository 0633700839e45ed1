"""The seams of the guest link: results declared once for both sides, the one table of guest-error
statuses at the node's edge, and the command limits the guest checks itself."""

from __future__ import annotations

import pytest

from capsa.common.errors import CapsaError
from capsa.guest.command import parse_command
from capsa.guest.errors import OpError
from capsa.guest.limits import COMMAND_ENV_ENTRIES, ENV_ENTRIES
from capsa.guest.results import FileInfo, ProcessInfo, WatchEvent
from capsa.node.guestlink.errors import GuestError, GuestRefused, GuestTimeout, GuestUnavailable
from capsa.node.statuses import status_of


def test_results_travel_as_meta_and_back() -> None:
    proc = ProcessInfo(pid=7, cmd="sleep 1", running=False, exit_code=None, signal=9, started_at=1.5,
                       finished_at=2.5, stdin_open=False)
    info = FileInfo(path="/a/b", name="b", type="file", size=3, mode=0o644, mtime=4.0)
    event = WatchEvent("created", "/a/b", False)
    assert ProcessInfo.from_meta(proc.to_meta()) == proc
    assert FileInfo.from_meta(info.to_meta()) == info
    assert WatchEvent.from_meta(event.to_meta()) == event


def test_results_from_a_hostile_guest_are_refused_or_narrowed() -> None:
    with pytest.raises(ValueError):
        WatchEvent.from_meta({"type": "exploded", "path": "/"})
    with pytest.raises(KeyError):
        FileInfo.from_meta({"path": "/a"})
    odd = ProcessInfo.from_meta({"pid": 3, "exit_code": True, "signal": "9", "stdin_open": 1})
    assert (odd.exit_code, odd.signal, odd.stdin_open) == (None, None, False)


def test_the_node_edge_decides_every_guest_status() -> None:
    assert status_of(GuestError("not_found", "m")) == 404
    assert status_of(GuestRefused("not_found", "m")) == 404
    assert status_of(GuestTimeout("m")) == 504
    assert status_of(GuestUnavailable("m")) == 503
    # A code the table does not know: the request's fault when the guest refused it, else the guest's.
    assert status_of(GuestRefused("made_up", "m")) == 400
    assert status_of(GuestError("made_up", "m")) == 502
    assert status_of(CapsaError("m", code="sandbox_not_found", status=404)) == 404


def test_the_guest_checks_the_env_limit_itself() -> None:
    assert ENV_ENTRIES < COMMAND_ENV_ENTRIES
    env = {f"V{i}": "x" for i in range(COMMAND_ENV_ENTRIES)}
    assert parse_command({"cmd": "true", "env": env}).env["V0"] == "x"
    env["ONE_MORE"] = "x"
    with pytest.raises(OpError) as refused:
        parse_command({"cmd": "true", "env": env})
    assert refused.value.code == "bad_request"
