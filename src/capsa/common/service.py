"""Running a long-lived capsa process (``capsa serve``, ``capsa control``, ``capsa node``) until a signal.

systemd, Kubernetes and ``kill`` send SIGTERM; a terminal sends SIGINT. Both must stop the process the same
way: the main coroutine is cancelled, so its ``finally`` blocks destroy VMs, remove taps and namespaces and
unmount storage before the process exits. uvicorn's own signal handling re-raises the signal after its server
stops, which ends the process before any of that runs, so servers started under :func:`run_service` must not
capture signals (see :class:`QuietServer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Coroutine, Generator
from typing import Any

import uvicorn

__all__ = ["STOP_SIGNALS", "QuietServer", "bind_tcp", "run_service", "wait_started"]

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signals to :func:`run_service`. Give it a
    ``uvicorn.Config(..., log_config=None)``: its request lines then go through the process's logging
    (:func:`capsa.common.logs.configure`, which blanks credentials carried in URLs)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def _main_with_signals(main: Coroutine[Any, Any, None]) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    received: list[int] = []

    def _stop(signum: int) -> None:
        if received:
            log.warning("already stopping (signal %d); cleaning up", signum)
            return
        received.append(signum)
        log.warning("received %s: stopping", signal.Signals(signum).name)
        task.cancel()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, _stop, signum)
    try:
        try:
            await task
        except asyncio.CancelledError:
            if not received:
                raise
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
    return 0


def run_service(main: Coroutine[Any, Any, None]) -> int:
    """Run ``main`` until it returns or SIGTERM/SIGINT arrives; then cancel it and wait for its cleanup.

    Returns 0 after a clean stop (by signal or because ``main`` returned); exceptions from ``main`` propagate.
    A second signal during cleanup is logged and otherwise ignored: cleanup is what leaves the host clean.
    """
    return asyncio.run(_main_with_signals(main))


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, bound before anything else starts (so a taken port fails first);
    the error names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Made by hand, not with socket.create_server: that one leaves the protocol 0, and asyncio turns Nagle
    # off only for sockets whose protocol says TCP, so every response on a kept-alive connection (its
    # head and body are two writes) waited for the client's delayed ACK: 40-45 ms per API call.
    # TCP_NODELAY on the listener is inherited by the connections it accepts.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as create_server: IPv6 only
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


async def wait_started(server: uvicorn.Server, task: asyncio.Task[None], *, name: str = "server") -> None:
    """Until ``server`` (running as ``task``) accepts connections; re-raises why it stopped if it did."""
    while not server.started:
        if task.done():
            task.result()  # re-raises why it stopped (e.g. the port is taken)
            raise OSError(f"{name} stopped before it started")
        await asyncio.sleep(0.02)
