"""TLS towards the sandbox, terminated with its own CA (ca.py): which name gets a leaf, the ClientHello read
before the handshake (clienthello.py) so the leaf is issued off the event loop, and the handshake itself, on
the TLS listener and inside a CONNECT tunnel.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable

from capsa.common.addresses import is_ip_literal
from capsa.node.egress.ca import leaf_name
from capsa.node.egress.clienthello import MAX_HELLO, UNRECOGNIZED_NAME_ALERT, Hello, parse_client_hello
from capsa.node.egress.http1 import STREAM_LIMIT, Client, guarded, until
from capsa.node.egress.sandboxes import SandboxEgress

__all__ = ["Serve", "TlsFront", "tls_leaf"]

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, str], Awaitable[None]]
"""Serves a TLS connection whose handshake is done, for the server name it is pinned to."""


def tls_leaf(sbx: SandboxEgress, name: str | None) -> str | None:
    """The leaf name that serves ``name`` for this sandbox, or None when the name is refused."""
    host = (name or "").lower().rstrip(".")
    if not host or is_ip_literal(host) or not sbx.ca.covers(host):
        return None
    rule = sbx.policy.rule_for(host)
    return None if rule is None else leaf_name(host, rule.is_wildcard)


def _audit_handshake(sbx: SandboxEgress, host: str, exc: BaseException, timeout: float) -> None:
    """Allowed by policy, but the sandbox's client did not finish its side of the TLS handshake (it gave
    up, distrusts the session CA, or was too slow): on the record rather than dropped silently."""
    if isinstance(exc, TimeoutError):
        why = f"did not complete within {timeout:g} s"
    else:
        why = f"failed: {exc.__class__.__name__}"
        if isinstance(exc, ssl.SSLError) and exc.reason:
            why += f" ({exc.reason})"
    sbx.audit(kind="tls", decision="error", source=sbx.guest_ip, destination=host[:255],
              reason=f"the TLS handshake with the sandbox's client {why}")


async def _peek_hello(conn: socket.socket, left: Callable[[], float]) -> Hello | None:
    """The connection's ClientHello, read without consuming it; None if it closed first."""
    loop = asyncio.get_running_loop()
    while True:
        ready: asyncio.Future[None] = loop.create_future()
        def wake(f: asyncio.Future[None] = ready) -> None:
            if not f.done():
                f.set_result(None)

        loop.add_reader(conn.fileno(), wake)
        try:
            await asyncio.wait_for(ready, left())
        finally:
            loop.remove_reader(conn.fileno())
        try:
            data = conn.recv(MAX_HELLO, socket.MSG_PEEK)
        except BlockingIOError:
            continue
        if not data:
            return None
        hello = parse_client_hello(data)
        if hello.complete:
            return hello
        # Part of a hello is queued: the socket stays readable until the rest comes, so wait a little.
        await asyncio.sleep(0.02)


class TlsFront:
    """The sandboxes' TLS server side; ``handshake_timeout`` bounds every handshake (and ClientHello)."""

    def __init__(self, handshake_timeout: float) -> None:
        self.handshake_timeout = handshake_timeout
        self._sni: weakref.WeakKeyDictionary[ssl.SSLObject, str] = weakref.WeakKeyDictionary()
        self._contexts: dict[str, ssl.SSLContext] = {}

    def add(self, sbx: SandboxEgress) -> None:
        """Make the context of TLS inside the sandbox's CONNECT tunnels: the leaf is issued (off the loop)
        before the handshake starts, so the callback only looks it up."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])

        def on_sni(sslobj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _ctx: ssl.SSLContext
                   ) -> int | None:
            leaf = tls_leaf(sbx, name)
            leaf_ctx = sbx.ca.cached_context(leaf) if leaf is not None else None
            if leaf_ctx is None:
                sbx.audit(kind="tls", decision="deny", destination=name or "<no SNI>",
                          reason="TLS server name missing or not allowed by policy")
                return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
            sslobj.context = leaf_ctx
            if isinstance(sslobj, ssl.SSLObject) and name is not None:
                self._sni[sslobj] = name.lower().rstrip(".")
            return None

        ctx.sni_callback = on_sni
        self._contexts[sbx.sandbox_id] = ctx

    def drop(self, sandbox_id: str) -> None:
        self._contexts.pop(sandbox_id, None)

    async def start_tls(self, sbx: SandboxEgress, client: Client, host: str) -> str | None:
        """TLS over a CONNECT tunnel to ``host`` (whose leaf is issued already); the server name the
        client's handshake asked for, or None when there was no handshake."""
        ctx = self._contexts.get(sbx.sandbox_id)
        leaf = tls_leaf(sbx, host)
        if ctx is None or leaf is None:
            return None
        try:
            # Nothing may be awaited before start_tls: a ClientHello read into the stream would be lost.
            # (The CONNECT issued the leaf before answering.)
            await asyncio.wait_for(client.writer.start_tls(ctx), self.handshake_timeout)
        except (ssl.SSLError, OSError, TimeoutError, ConnectionError) as exc:
            _audit_handshake(sbx, host, exc, self.handshake_timeout)
            return None
        sslobj = client.writer.get_extra_info("ssl_object")
        return self._sni.get(sslobj) if isinstance(sslobj, ssl.SSLObject) else None

    async def accept(self, sbx: SandboxEgress, conn: socket.socket, serve: Serve) -> None:
        """A connection of the TLS listener: its source checked, its ClientHello's name checked and the leaf
        for it issued, the handshake, then ``serve``."""
        writer: asyncio.StreamWriter | None = None
        owned = False

        def close() -> None:
            # Once a transport owns the socket only the transport may close it: closing the fd under it
            # would let a new connection reuse the number while the transport still unregisters it.
            if writer is not None:
                writer.close()
            elif not owned:
                conn.close()

        async def run() -> None:
            nonlocal writer, owned
            try:
                source = str(conn.getpeername()[0])
            except OSError:
                return
            if source != sbx.guest_ip:
                sbx.audit(kind="tls", decision="deny", source=source,
                          reason="connection from an address that is not the sandbox's")
                return
            hello = await _peek_hello(conn, until(time.monotonic() + self.handshake_timeout))
            if hello is None:
                return
            leaf = tls_leaf(sbx, hello.server_name) if hello.valid else None
            if leaf is None or hello.server_name is None:
                sbx.audit(kind="tls", decision="deny", source=source,
                          destination=(hello.server_name or "<no SNI>")[:255],
                          reason="TLS server name missing or not allowed by policy")
                with contextlib.suppress(OSError):
                    conn.send(UNRECOGNIZED_NAME_ALERT)
                return
            host = hello.server_name.lower().rstrip(".")
            ctx = await sbx.ca.context_for(leaf)
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
            owned = True  # from here on the transport (or its failed handshake) closes the socket
            try:
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, conn, ssl=ctx, ssl_handshake_timeout=self.handshake_timeout)
            except (TimeoutError, ssl.SSLError, OSError) as exc:
                _audit_handshake(sbx, host, exc, self.handshake_timeout)
                return
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            sbx.writers.add(writer)
            try:
                await serve(reader, writer, host)
            finally:
                sbx.writers.discard(writer)

        await guarded(sbx.sandbox_id, run, close)
