"""A small real HTTP CONNECT proxy for tests (the corporate proxy behind ``CAPSA_EGRESS_UPSTREAM_PROXY``):
h11 parses each CONNECT, the proxy checks ``Proxy-Authorization`` when it wants one, records what it was
asked (one JSON line per CONNECT when run as a process), dials the target and splices bytes both ways.

In-process: ``proxy = ConnectProxy(...); await proxy.start("127.0.0.1")``. As a process (e.g. inside a
test's network namespace): ``python -m tests.support.connect_proxy --host 10.0.0.1 --port 3128
--log /tmp/proxy.jsonl [--auth user:pass]``; it prints ``ready`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import h11

__all__ = ["ConnectProxy", "Tunnel"]


@dataclass
class Tunnel:
    target: str
    authorization: str | None
    status: int
    peer: str


@dataclass
class ConnectProxy:
    auth: str | None = None
    """``user:password`` the proxy demands (407 otherwise); None: anyone."""
    log_path: Path | None = None
    tunnels: list[Tunnel] = field(default_factory=list)
    connections: int = 0
    """Connections accepted (a refused CONNECT counts too)."""
    server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int = 0) -> int:
        self.server = await asyncio.start_server(self._handle, host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    def _record(self, tunnel: Tunnel) -> None:
        self.tunnels.append(tunnel)
        if self.log_path is not None:
            with self.log_path.open("a") as f:
                f.write(json.dumps(tunnel.__dict__) + "\n")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        peer = str(writer.get_extra_info("peername")[0])
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                    continue
                break
            if not isinstance(event, h11.Request) or event.method != b"CONNECT":
                writer.write(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
                return
            target = event.target.decode()
            auth = dict(event.headers).get(b"proxy-authorization")
            shown = auth.decode() if auth is not None else None
            wanted = None if self.auth is None else "Basic " + base64.b64encode(self.auth.encode()).decode()
            if wanted is not None and shown != wanted:
                self._record(Tunnel(target, shown, 407, peer))
                writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\nproxy-authenticate: Basic\r\n"
                             b"content-length: 21\r\n\r\nproxy secret: hunter2")
                return
            host, _, port = target.rpartition(":")
            try:
                up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            except OSError:
                self._record(Tunnel(target, shown, 502, peer))
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
                return
            self._record(Tunnel(target, shown, 200, peer))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            rest = conn.trailing_data[0]
            if rest:
                up_writer.write(rest)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (ConnectionError, h11.ProtocolError):
            pass
        finally:
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if dst.can_write_eof():
                dst.write_eof()


async def _main(args: argparse.Namespace) -> None:
    proxy = ConnectProxy(auth=args.auth, log_path=Path(args.log))
    await proxy.start(args.host, args.port)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--auth")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(parser.parse_args()))
    sys.exit(0)
