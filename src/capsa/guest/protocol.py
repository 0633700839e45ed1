"""The guest channel's wire format, shared by the guest daemon and the host client.

One byte stream (a virtio-serial port in the guest, a Unix socket on the host) carries frames of
many concurrent requests. Each frame is::

    header (24 bytes, big endian)
      magic    4s   b"CPSA"
      version  u8   PROTOCOL_VERSION
      kind     u8   Kind
      flags    u16  reserved, 0
      stream   u32  request id chosen by the host; 0 = the connection itself
      meta_len u32  length of the JSON object that follows (0 = empty object)
      data_len u32  length of the raw bytes after the JSON
      crc      u32  crc32 of the 20 bytes above
    meta  JSON object, UTF-8
    data  raw bytes

The header checksum lets the decoder tell a real frame from payload bytes that happen to contain
the magic, so it can resynchronise after garbage (a host reconnecting mid-frame, a corrupted
write) without guessing. Flow control is by credit: each side may have at most ``INITIAL_WINDOW``
unacknowledged data bytes in flight per stream and direction, and the receiver returns credit with
``WINDOW`` frames as it consumes data. That keeps memory bounded on both sides and stops a slow
consumer on one stream from stalling the whole channel.

Daemon instances. Every start of the guest daemon picks a fresh random instance id. Each time it
opens the port it announces itself with a *hello*: an ``EVENT`` frame on stream 0 with meta
``{"event": "hello", "instance": id, "pid": ..., "protocol": PROTOCOL_VERSION}``; ``health`` reports
the same ``instance``. A host that knows an instance may name it in each ``REQUEST`` (meta
``"instance"``); a daemon with another id refuses such a request, without running it, with an ERROR
``guest_unavailable`` whose meta carries its own ``instance``. So when the daemon dies and PID 1
restarts it, the host learns at once (the hello; a virtio-serial host socket does not notice the
guest closing its port) that every request in flight was lost, and requests that were still on
their way to the dead instance are refused rather than run by its successor. A request without
``"instance"`` is served by any instance. Both additions are optional fields of existing frame
kinds, so the wire format stays version 1.

Standard library only: this module is copied into the guest image.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHUNK_SIZE",
    "HEADER",
    "HELLO_EVENT",
    "INITIAL_WINDOW",
    "INSTANCE_KEY",
    "MAGIC",
    "MAX_DATA",
    "MAX_LISTING_BYTES",
    "MAX_META",
    "PROCESS_OUTPUT_KEPT",
    "PROTOCOL_VERSION",
    "UNAVAILABLE",
    "Decoder",
    "Frame",
    "FrameTooLarge",
    "Kind",
    "encode_frame",
    "hello_instance",
]

MAGIC = b"CPSA"
PROTOCOL_VERSION = 1
HEADER = struct.Struct(">4sBBHIIII")
_PREFIX = struct.Struct(">4sBBHIII")  # the checksummed part of the header

MAX_META = 64 * 1024
MAX_DATA = 1024 * 1024
CHUNK_SIZE = 64 * 1024
INITIAL_WINDOW = 1024 * 1024
MAX_STREAM = 0xFFFFFFFF
HELLO_EVENT = "hello"  # meta["event"] of the daemon's announcement (EVENT on stream 0)
INSTANCE_KEY = "instance"  # meta key naming a daemon instance (hello, health, REQUEST, ERROR)
UNAVAILABLE = "guest_unavailable"  # error code: the daemon instance a request was meant for is gone
# Result sizes both sides hold to: the guest never sends more, and the host fails a call whose guest does
# (``protocol_error``), so a hostile guest cannot make the host buffer without bound.
MAX_LISTING_BYTES = 32 * 1024 * 1024  # file_list: the JSON array; a larger directory is refused (too_large)
PROCESS_OUTPUT_KEPT = 1024 * 1024  # proc_output: the last bytes of each of stdout/stderr a guest keeps


class Kind(enum.IntEnum):
    REQUEST = 1  # host -> guest: meta {"op": ..., args}; data: optional inline payload
    DATA = 2  # either way: a chunk of a stream (meta may name a channel: {"ch": "stdout"})
    END = 3  # either way: no more DATA from this side on this stream
    RESULT = 4  # guest -> host: final success; the stream is finished
    ERROR = 5  # either way: final failure {"code": ..., "message": ...}; the stream is finished
    CANCEL = 6  # host -> guest: abandon the request (kills its process)
    WINDOW = 7  # either way: {"n": bytes} more data may be sent on this stream
    EVENT = 8  # either way: an in-stream notification (process started, terminal resize)


class FrameTooLarge(ValueError):
    """An attempt to encode a frame beyond the protocol's hard limits."""


@dataclass(frozen=True)
class Frame:
    kind: Kind
    stream: int
    meta: dict[str, Any] = field(default_factory=dict)
    data: bytes = b""
    malformed: bool = False
    """True for ERROR frames the local decoder made up for bytes it could not decode."""

    @property
    def code(self) -> str:
        value = self.meta.get("code")
        return value if isinstance(value, str) else "internal_error"

    @property
    def message(self) -> str:
        value = self.meta.get("message")
        return value if isinstance(value, str) else ""


def encode_frame(kind: Kind, stream: int, meta: dict[str, Any] | None = None, data: bytes = b"") -> bytes:
    """Serialise one frame; raises :class:`FrameTooLarge` or ``ValueError`` for what cannot be sent."""
    if not 0 <= stream <= MAX_STREAM:
        raise ValueError(f"stream id out of range: {stream}")
    raw_meta = b""
    if meta:
        raw_meta = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    if len(raw_meta) > MAX_META:
        raise FrameTooLarge(f"frame meta is {len(raw_meta)} bytes, limit {MAX_META}")
    if len(data) > MAX_DATA:
        raise FrameTooLarge(f"frame data is {len(data)} bytes, limit {MAX_DATA}")
    prefix = _PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(kind), 0, stream, len(raw_meta), len(data))
    return b"".join((prefix, struct.pack(">I", zlib.crc32(prefix)), raw_meta, data))


def hello_instance(frame: Frame) -> str | None:
    """The instance id a daemon's hello frame announces, or None if ``frame`` is not a hello."""
    if frame.kind != Kind.EVENT or frame.stream != 0 or frame.meta.get("event") != HELLO_EVENT:
        return None
    value = frame.meta.get(INSTANCE_KEY)
    return value if isinstance(value, str) and value else None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in frame meta")


_KINDS = frozenset(int(k) for k in Kind)


class Decoder:
    """Incremental frame decoder.

    ``feed`` never raises for any input and never waits for more than one bounded frame: bytes it
    cannot decode become ERROR frames with ``malformed=True`` (on the frame's stream when its header
    is trustworthy, else stream 0), and decoding resumes at the next valid header.
    """

    def __init__(self, max_meta: int = MAX_META, max_data: int = MAX_DATA) -> None:
        self._buf = bytearray()
        self._pos = 0  # start of the undecoded bytes in _buf (compacted once per feed)
        self._need = 0  # total bytes a partly received frame needs: skip re-parsing until then
        self._max_meta = max_meta
        self._max_data = max_data
        self._in_garbage = False  # one error per run of garbage, not one per byte

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def reset(self) -> None:
        """Drop a partial frame, e.g. when the peer disconnected."""
        self._buf.clear()
        self._pos = self._need = 0
        self._in_garbage = False

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        out: list[Frame] = []
        if len(self._buf) - self._pos < self._need:
            return out
        self._need = 0
        while self._step(out):
            pass
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        return out

    def _garbage(self, out: list[Frame], reason: str, skip: int) -> None:
        if not self._in_garbage:
            out.append(_malformed(0, "malformed_frame", reason))
            self._in_garbage = True
        self._pos += skip

    def _step(self, out: list[Frame]) -> bool:
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if not avail:
            return False
        if avail < len(MAGIC) and MAGIC.startswith(bytes(buf[pos:])):
            return False  # maybe the start of a frame: wait for more
        if not buf.startswith(MAGIC, pos):
            nxt = buf.find(MAGIC, pos + 1)
            if nxt < 0:
                # keep a tail that could be the start of the next magic
                keep = 0
                for n in range(min(len(MAGIC) - 1, avail - 1), 0, -1):
                    if MAGIC.startswith(bytes(buf[-n:])):
                        keep = n
                        break
                self._garbage(out, "bytes outside any frame", avail - keep)
                return False
            self._garbage(out, "bytes outside any frame", nxt - pos)
            return True
        if avail < HEADER.size:
            return False
        _magic, version, kind, _flags, stream, meta_len, data_len, crc = HEADER.unpack_from(buf, pos)
        with memoryview(buf) as view:
            header_ok = zlib.crc32(view[pos: pos + _PREFIX.size]) == crc
        if not header_ok:
            self._garbage(out, "frame header checksum mismatch", 1)
            return True
        # The header is genuine from here on, so errors can name its stream.
        if meta_len > self._max_meta or data_len > self._max_data:
            self._in_garbage = True  # the oversize body that follows is skipped as garbage silently
            out.append(_malformed(stream, "frame_too_large",
                                  f"frame of {meta_len}+{data_len} bytes exceeds the limits "
                                  f"{self._max_meta}+{self._max_data}"))
            self._pos += HEADER.size
            return True
        total = HEADER.size + meta_len + data_len
        if avail < total:
            self._need = total
            return False
        self._in_garbage = False
        body = pos + HEADER.size
        with memoryview(buf) as view:
            raw_meta = bytes(view[body: body + meta_len])
            payload = bytes(view[body + meta_len: pos + total])
        self._pos += total
        if version != PROTOCOL_VERSION:
            out.append(_malformed(stream, "unsupported_version",
                                  f"protocol version {version} is not supported (want {PROTOCOL_VERSION})"))
            return True
        if kind not in _KINDS:
            out.append(_malformed(stream, "malformed_frame", f"unknown frame kind {kind}"))
            return True
        meta: Any = {}
        if meta_len:
            try:
                meta = json.loads(raw_meta.decode("utf-8"), parse_constant=_reject_constant)
            except (ValueError, RecursionError) as exc:
                out.append(_malformed(stream, "malformed_frame", f"frame meta is not valid JSON: {exc}"))
                return True
            if not isinstance(meta, dict):
                out.append(_malformed(stream, "malformed_frame", "frame meta must be a JSON object"))
                return True
        out.append(Frame(Kind(kind), stream, meta, payload))
        return True


def _malformed(stream: int, code: str, message: str) -> Frame:
    return Frame(Kind.ERROR, stream, {"code": code, "message": message}, b"", malformed=True)
