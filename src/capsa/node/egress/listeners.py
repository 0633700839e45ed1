"""A sandbox's listeners inside its network namespace (plain HTTP, TLS, the explicit proxy, the DNS stub) and
the connections they accept, counted against the sandbox's and the node's caps (limits.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from capsa.node.egress.dns import DnsServerProtocol, stub_answer
from capsa.node.egress.http1 import STREAM_LIMIT, guarded
from capsa.node.egress.limits import BrokerLimits
from capsa.node.egress.request_head import Mode
from capsa.node.egress.request_loop import RequestLoop
from capsa.node.egress.sandboxes import SandboxEgress
from capsa.node.egress.tls import TlsFront
from capsa.node.net.nsexec import open_listener
from capsa.node.net.sandbox_net import ServicePorts

__all__ = ["Listeners"]

_log = logging.getLogger(__name__)


class Listeners:
    """Opens and closes the sandboxes' listeners and hands their connections to ``requests`` (through the
    ``tls`` front's handshake for the TLS listener)."""

    def __init__(self, limits: BrokerLimits, requests: RequestLoop, tls: TlsFront) -> None:
        self.limits, self.requests, self.tls = limits, requests, tls
        self.connection_cap = limits.connection_cap()
        """Connections the node serves at once, all sandboxes together (bounded by RLIMIT_NOFILE)."""
        self.active = 0

    async def open(self, sbx: SandboxEgress, host: str, netns: str | None, ports: ServicePorts) -> None:
        """Open the sandbox's listeners on ``host`` inside ``netns`` (``None``: this namespace)."""
        loop = asyncio.get_running_loop()
        try:
            modes: tuple[tuple[int, Mode], ...] = ((ports.http, "http"), (ports.proxy, "proxy"))
            for port, mode in modes:
                sock = await asyncio.to_thread(open_listener, netns, host, port)
                server = await asyncio.start_server(self._handler(sbx, mode), sock=sock, limit=STREAM_LIMIT)
                sbx.servers.append(server)
                sbx.bound[mode] = server.sockets[0].getsockname()[:2]
            # TLS on the DNAT-ed port: the broker reads the ClientHello's name before the handshake starts,
            # so the leaf for it can be issued off the event loop (see TlsFront.accept).
            tls_sock = await asyncio.to_thread(open_listener, netns, host, ports.tls)
            tls_sock.setblocking(False)
            sbx.listen_socks.append(tls_sock)
            sbx.bound["tls"] = tls_sock.getsockname()[:2]
            sbx.accept_tasks.append(asyncio.create_task(self._accept_tls(sbx, tls_sock)))
            usock = await asyncio.to_thread(open_listener, netns, host, ports.dns, socket.SOCK_DGRAM)
            transport, _ = await loop.create_datagram_endpoint(
                lambda: DnsServerProtocol(lambda q, src: stub_answer(sbx, host, q, src)), sock=usock)
            sbx.dns_transport = transport
            sbx.bound["dns"] = transport.get_extra_info("sockname")[:2]
        except BaseException:
            await self.close(sbx)
            raise

    async def close(self, sbx: SandboxEgress) -> None:
        """Close the sandbox's listeners and end its connections."""
        for server in sbx.servers:
            server.close()
        for accept in sbx.accept_tasks:
            accept.cancel()
        for sock in sbx.listen_socks:
            sock.close()
        for w in list(sbx.writers):
            w.close()
        for task in list(sbx.tasks):
            task.cancel()
        for server in sbx.servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        if sbx.tasks or sbx.accept_tasks:
            await asyncio.gather(*sbx.tasks, *sbx.accept_tasks, return_exceptions=True)
        sbx.servers.clear()
        sbx.accept_tasks.clear()
        sbx.listen_socks.clear()
        if sbx.dns_transport is not None:
            sbx.dns_transport.close()
            sbx.dns_transport = None

    def _enter(self, sbx: SandboxEgress, task: asyncio.Task[None]) -> bool:
        """Count a new connection against its sandbox's and the node's caps; False if either is full."""
        if len(sbx.tasks) >= self.limits.connections_per_sandbox:
            # Every connection costs descriptors and buffers: cap what one sandbox holds.
            sbx.audit(kind="http", decision="deny", reason="too many concurrent connections")
            return False
        if self.active >= self.connection_cap:
            sbx.audit(kind="http", decision="deny", reason="the node's egress connection cap is reached")
            return False
        sbx.tasks.add(task)
        self.active += 1
        task.add_done_callback(lambda t: self._leave(sbx, t))
        return True

    def _leave(self, sbx: SandboxEgress, task: asyncio.Task[None]) -> None:
        if task in sbx.tasks:
            sbx.tasks.discard(task)
            self.active -= 1

    async def _accept_tls(self, sbx: SandboxEgress, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
            await self.requests.serve(sbx, "tls", reader, writer, tls_host=host)

        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if sock.fileno() < 0:
                    return
                # EMFILE/ENFILE: the descriptor budget is spent; back off instead of spinning.
                _log.warning("egress TLS accept of %s failed: %s", sbx.sandbox_id, exc.__class__.__name__)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            task = asyncio.create_task(self.tls.accept(sbx, conn, serve))
            if not self._enter(sbx, task):
                task.cancel()
                conn.close()

    def _handler(self, sbx: SandboxEgress, mode: Mode
                 ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            if not self._enter(sbx, task):
                writer.close()
                return
            sbx.writers.add(writer)

            def close() -> None:
                sbx.writers.discard(writer)
                writer.close()

            await guarded(sbx.sandbox_id, lambda: self.requests.serve(sbx, mode, reader, writer), close)
            with contextlib.suppress(Exception):
                await writer.wait_closed()

        return handle
