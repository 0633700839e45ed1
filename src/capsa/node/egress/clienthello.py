"""The server name of a TLS ClientHello, read before the handshake starts.

The broker peeks at a connection's first bytes (without consuming them) to learn which name the sandbox
asks for, so the certificate for that name can be issued off the event loop before OpenSSL sees the
handshake. Only the server_name extension is read; everything else is OpenSSL's business.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_HELLO", "UNRECOGNIZED_NAME_ALERT", "Hello", "parse_client_hello"]

MAX_HELLO = 5 + 16384
"""A ClientHello that does not fit in one TLS record is refused (browsers and curl send one record)."""
UNRECOGNIZED_NAME_ALERT = bytes([0x15, 0x03, 0x01, 0x00, 0x02, 0x02, 0x70])
"""A fatal unrecognized_name alert record, sent before closing a connection whose name is refused."""


@dataclass(frozen=True)
class Hello:
    complete: bool
    """False: more bytes are needed."""
    server_name: str | None = None
    """The host name asked for; ``None`` in a complete hello without one (or not a ClientHello at all)."""
    valid: bool = True


_NEED_MORE = Hello(complete=False)
_INVALID = Hello(complete=True, valid=False)


def parse_client_hello(data: bytes) -> Hello:
    if len(data) < 5:
        return _NEED_MORE
    if data[0] != 0x16 or data[1] != 0x03:
        return _INVALID
    length = int.from_bytes(data[3:5], "big")
    if length > 16384:
        return _INVALID
    if len(data) < 5 + length:
        return _NEED_MORE
    body = data[5:5 + length]
    try:
        return _parse_handshake(body)
    except (IndexError, ValueError):
        return _INVALID


def _take(buf: bytes, pos: int, width: int) -> tuple[int, int]:
    if pos + width > len(buf):
        raise ValueError("truncated")
    return int.from_bytes(buf[pos:pos + width], "big"), pos + width


def _parse_handshake(body: bytes) -> Hello:
    if body[0] != 0x01:  # client_hello
        return _INVALID
    hs_len, pos = _take(body, 1, 3)
    if 4 + hs_len > len(body):
        return _INVALID  # spans records
    end = 4 + hs_len
    pos += 2 + 32  # legacy_version, random
    sid_len, pos = _take(body, pos, 1)
    pos += sid_len
    cs_len, pos = _take(body, pos, 2)
    pos += cs_len
    comp_len, pos = _take(body, pos, 1)
    pos += comp_len
    if pos == end:
        return Hello(complete=True)
    ext_total, pos = _take(body, pos, 2)
    ext_end = min(pos + ext_total, end)
    while pos + 4 <= ext_end:
        ext_type, pos = _take(body, pos, 2)
        ext_len, pos = _take(body, pos, 2)
        if ext_type == 0:
            return _server_name(body[pos:pos + ext_len])
        pos += ext_len
    return Hello(complete=True)


def _server_name(ext: bytes) -> Hello:
    list_len, pos = _take(ext, 0, 2)
    end = min(2 + list_len, len(ext))
    while pos + 3 <= end:
        kind, pos = _take(ext, pos, 1)
        name_len, pos = _take(ext, pos, 2)
        name = ext[pos:pos + name_len]
        pos += name_len
        if kind == 0:
            try:
                return Hello(complete=True, server_name=name.decode("ascii"))
            except UnicodeDecodeError:
                return _INVALID
    return Hello(complete=True)
