"""Just enough of the DNS wire format (RFC 1035) for the stub and the broker's resolver.

The stub only ever answers one question with A records or an error code, and the resolver only reads A
records, so a small strict codec is safer here than a general library: anything unusual is refused.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

__all__ = [
    "NOERROR",
    "NXDOMAIN",
    "QTYPE_A",
    "QTYPE_AAAA",
    "REFUSED",
    "SERVFAIL",
    "DnsFormatError",
    "Question",
    "build_error",
    "build_query",
    "build_response",
    "parse_a_answers",
    "parse_query",
]

QTYPE_A = 1
QTYPE_AAAA = 28
QCLASS_IN = 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5

_HEADER = struct.Struct("!HHHHHH")


class DnsFormatError(ValueError):
    pass


@dataclass(frozen=True)
class Question:
    id: int
    name: str
    """Lower-cased, without the trailing dot; labels that are not plain ASCII are kept escaped."""
    qtype: int
    qclass: int
    flags: int
    raw_question: bytes


def _read_name(data: bytes, offset: int, *, allow_pointers: bool) -> tuple[str, int]:
    labels: list[str] = []
    end: int | None = None
    jumps = 0
    total = 0
    while True:
        if offset >= len(data):
            raise DnsFormatError("name runs past the message")
        length = data[offset]
        if length & 0xC0 == 0xC0:
            if not allow_pointers or offset + 1 >= len(data):
                raise DnsFormatError("unexpected compression pointer")
            jumps += 1
            if jumps > 16:
                raise DnsFormatError("compression loop")
            if end is None:
                end = offset + 2
            offset = ((length & 0x3F) << 8) | data[offset + 1]
            continue
        if length & 0xC0:
            raise DnsFormatError("bad label type")
        offset += 1
        if length == 0:
            break
        label = data[offset:offset + length]
        if len(label) != length:
            raise DnsFormatError("label runs past the message")
        total += length + 1
        if total > 255:
            raise DnsFormatError("name too long")
        labels.append("".join(chr(b) if 0x21 <= b < 0x7F and b != 0x5C else f"\\{b:03d}" for b in label))
        offset += length
    return ".".join(labels).lower(), (end if end is not None else offset)


def _encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise DnsFormatError(f"bad label in {name!r}")
        out += bytes([len(raw)]) + raw
    return bytes(out) + b"\x00"


def parse_query(data: bytes) -> Question:
    """Parse a standard query holding exactly one question; raise :class:`DnsFormatError` otherwise."""
    if len(data) < _HEADER.size:
        raise DnsFormatError("short message")
    qid, flags, qd, _an, _ns, _ar = _HEADER.unpack_from(data)
    if flags & 0x8000:
        raise DnsFormatError("not a query")
    if (flags >> 11) & 0xF != 0:
        raise DnsFormatError("unsupported opcode")
    if qd != 1:
        raise DnsFormatError("exactly one question is supported")
    name, off = _read_name(data, _HEADER.size, allow_pointers=False)
    if off + 4 > len(data):
        raise DnsFormatError("truncated question")
    qtype, qclass = struct.unpack_from("!HH", data, off)
    return Question(qid, name, qtype, qclass, flags, data[_HEADER.size:off + 4])


def build_response(q: Question, rcode: int, addresses: list[str] | None = None, ttl: int = 30) -> bytes:
    """An authoritative-looking answer to ``q`` with A records (never recursion available)."""
    answers = [a for a in (addresses or []) if isinstance(ipaddress.ip_address(a), ipaddress.IPv4Address)]
    flags = 0x8000 | 0x0400 | (q.flags & 0x0100) | (rcode & 0xF)  # QR, AA, copy RD, RA stays 0
    out = bytearray(_HEADER.pack(q.id, flags, 1, len(answers), 0, 0))
    out += q.raw_question
    for addr in answers:
        out += struct.pack("!HHHIH", 0xC00C, QTYPE_A, QCLASS_IN, ttl, 4) + ipaddress.IPv4Address(addr).packed
    return bytes(out)


def build_error(data: bytes, rcode: int) -> bytes | None:
    """A bare error reply echoing only the id, for messages too malformed to parse."""
    if len(data) < 2:
        return None
    return _HEADER.pack(int.from_bytes(data[:2], "big"), 0x8000 | rcode, 0, 0, 0, 0)


def build_query(qid: int, name: str, qtype: int = QTYPE_A) -> bytes:
    return _HEADER.pack(qid, 0x0100, 1, 0, 0, 0) + _encode_name(name) + struct.pack("!HH", qtype, QCLASS_IN)


def parse_a_answers(data: bytes, qid: int, name: str) -> tuple[int, list[str]]:
    """Return ``(rcode, IPv4 addresses)`` from a response to our query ``qid`` for ``name``."""
    if len(data) < _HEADER.size:
        raise DnsFormatError("short response")
    rid, flags, qd, an, _ns, _ar = _HEADER.unpack_from(data)
    if rid != qid or not flags & 0x8000:
        raise DnsFormatError("response does not match the query")
    off = _HEADER.size
    for _ in range(qd):
        qname, off = _read_name(data, off, allow_pointers=True)
        if qname != name.lower().rstrip("."):
            raise DnsFormatError("response is for another name")
        off += 4
    addresses: list[str] = []
    for _ in range(an):
        _rname, off = _read_name(data, off, allow_pointers=True)
        if off + 10 > len(data):
            raise DnsFormatError("truncated record")
        rtype, rclass, _ttl, rdlen = struct.unpack_from("!HHIH", data, off)
        off += 10
        rdata = data[off:off + rdlen]
        off += rdlen
        if len(rdata) != rdlen:
            raise DnsFormatError("truncated rdata")
        if rtype == QTYPE_A and rclass == QCLASS_IN and rdlen == 4:
            addresses.append(str(ipaddress.IPv4Address(rdata)))
    return flags & 0xF, addresses
