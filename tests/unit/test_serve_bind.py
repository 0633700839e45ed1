"""`capsa serve` must fail on a taken port before it creates the database or a bootstrap key."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from capsa import serve


async def test_taken_port_fails_before_any_state_is_created(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        state = tmp_path / "state"
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            await serve.run("127.0.0.1", port, state, None, "tcg")
    assert not state.exists(), "state dir was created although the port was taken"
