"""The guest channel's wire format: encoding, limits, resynchronisation, and a fuzzed decoder."""

from __future__ import annotations

import itertools
import json
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsa.guest.protocol import (
    HEADER,
    MAGIC,
    MAX_DATA,
    MAX_META,
    PROTOCOL_VERSION,
    Decoder,
    Frame,
    FrameTooLarge,
    Kind,
    encode_frame,
)


def raw_frame(kind: int, stream: int, meta: bytes = b"", data: bytes = b"", *,
              version: int = PROTOCOL_VERSION, meta_len: int | None = None, data_len: int | None = None,
              magic: bytes = MAGIC) -> bytes:
    """A frame built by hand, so tests can break any field."""
    prefix = struct.pack(">4sBBHIII", magic, version, kind, 0, stream,
                         len(meta) if meta_len is None else meta_len,
                         len(data) if data_len is None else data_len)
    return prefix + struct.pack(">I", zlib.crc32(prefix)) + meta + data


def valid(frames: list[Frame]) -> list[Frame]:
    return [f for f in frames if not f.malformed]


def errors(frames: list[Frame]) -> list[Frame]:
    return [f for f in frames if f.malformed]


def test_round_trip_every_kind() -> None:
    dec = Decoder()
    for kind in Kind:
        raw = encode_frame(kind, 42, {"op": "x", "n": [1, 2], "s": "é"}, b"\x00\xffdata")
        (frame,) = dec.feed(raw)
        assert frame == Frame(kind, 42, {"op": "x", "n": [1, 2], "s": "é"}, b"\x00\xffdata")
    assert dec.buffered == 0


def test_empty_meta_and_data_is_header_only() -> None:
    raw = encode_frame(Kind.END, 1)
    assert len(raw) == HEADER.size
    assert Decoder().feed(raw) == [Frame(Kind.END, 1, {}, b"")]


def test_byte_by_byte_feed_gives_the_same_frames() -> None:
    frames = [encode_frame(Kind.DATA, i, {"ch": "stdout"}, bytes([i]) * i) for i in range(1, 20)]
    dec = Decoder()
    out: list[Frame] = []
    for b in b"".join(frames):
        out += dec.feed(bytes([b]))
    assert [f.stream for f in out] == list(range(1, 20))
    assert all(f.data == bytes([f.stream]) * f.stream for f in out)


def test_encoder_enforces_limits() -> None:
    encode_frame(Kind.DATA, 1, None, b"x" * MAX_DATA)
    with pytest.raises(FrameTooLarge):
        encode_frame(Kind.DATA, 1, None, b"x" * (MAX_DATA + 1))
    with pytest.raises(FrameTooLarge):
        encode_frame(Kind.REQUEST, 1, {"op": "x" * MAX_META})
    with pytest.raises(ValueError):
        encode_frame(Kind.DATA, -1)
    with pytest.raises(ValueError):
        encode_frame(Kind.DATA, 1 << 32)
    with pytest.raises(ValueError):
        encode_frame(Kind.REQUEST, 1, {"x": float("nan")})


def test_garbage_before_a_frame_gives_one_error_then_the_frame() -> None:
    good = encode_frame(Kind.REQUEST, 5, {"op": "health"})
    out = Decoder().feed(b"\x00garbage CPS noise" * 50 + good)
    assert len(errors(out)) == 1
    assert errors(out)[0].stream == 0 and errors(out)[0].code == "malformed_frame"
    assert valid(out) == [Frame(Kind.REQUEST, 5, {"op": "health"})]


def test_garbage_alone_is_dropped_but_a_partial_magic_is_kept() -> None:
    dec = Decoder()
    assert len(dec.feed(b"xxxxxxCP")) == 1
    assert dec.buffered == 2  # "CP" might start a frame
    assert dec.feed(b"SA") == []  # "CPSA": a header may follow
    # The rest of that would-be header is garbage: the decoder gives up on it, then reads a frame.
    out = dec.feed(b"\x09" * 30 + encode_frame(Kind.END, 3))
    assert valid(out) == [Frame(Kind.END, 3)]


def test_corrupted_header_checksum_resyncs_on_stream_zero() -> None:
    good = encode_frame(Kind.RESULT, 9, {"a": 1})
    bad = bytearray(encode_frame(Kind.RESULT, 8, {"a": 1}))
    bad[10] ^= 0xFF  # the stream id: the checksum no longer matches
    out = Decoder().feed(bytes(bad) + good)
    assert [f.stream for f in errors(out)] == [0]
    assert valid(out) == [Frame(Kind.RESULT, 9, {"a": 1})]


def test_unknown_version_is_reported_on_its_stream_and_skipped() -> None:
    out = Decoder().feed(raw_frame(Kind.REQUEST, 7, b'{"op":"x"}', version=99) + encode_frame(Kind.END, 8))
    assert [(f.stream, f.code) for f in errors(out)] == [(7, "unsupported_version")]
    assert valid(out) == [Frame(Kind.END, 8)]


def test_unknown_kind_is_reported_on_its_stream() -> None:
    out = Decoder().feed(raw_frame(200, 11, b"{}", b"abc") + encode_frame(Kind.END, 12))
    assert [(f.stream, f.code) for f in errors(out)] == [(11, "malformed_frame")]
    assert valid(out) == [Frame(Kind.END, 12)]


@pytest.mark.parametrize("meta", [b"{not json", b"[1, 2]", b'"str"', b"\xff\xfe", b'{"x": NaN}',
                                  b"[" * 100000 + b"]" * 100000])
def test_bad_meta_is_reported_on_its_stream(meta: bytes) -> None:
    dec = Decoder(max_meta=300000)
    out = dec.feed(raw_frame(Kind.REQUEST, 13, meta) + encode_frame(Kind.END, 14))
    assert [(f.stream, f.code) for f in errors(out)] == [(13, "malformed_frame")]
    assert valid(out) == [Frame(Kind.END, 14)]


def test_oversize_frame_is_refused_without_waiting_for_its_body() -> None:
    dec = Decoder()
    out = dec.feed(raw_frame(Kind.DATA, 21, data_len=MAX_DATA + 1))
    assert [(f.stream, f.code) for f in out] == [(21, "frame_too_large")]
    # The body that follows is skipped as garbage; the next real frame is decoded.
    out = dec.feed(b"\x00" * 5000 + encode_frame(Kind.END, 22))
    assert valid(out) == [Frame(Kind.END, 22)]
    out = Decoder().feed(raw_frame(Kind.REQUEST, 23, meta_len=MAX_META + 1))
    assert [(f.stream, f.code) for f in out] == [(23, "frame_too_large")]


def test_magic_inside_payload_does_not_confuse_the_decoder() -> None:
    payload = (MAGIC + b"\x01\x02" + b"\x00" * 30) * 100
    frames = [encode_frame(Kind.DATA, 1, {"ch": "stdout"}, payload), encode_frame(Kind.END, 1)]
    out = Decoder().feed(b"".join(frames))
    assert [f.kind for f in out] == [Kind.DATA, Kind.END] and out[0].data == payload


def test_meta_survives_as_json_objects() -> None:
    meta = {"op": "exec", "cmd": ["a", "b"], "env": {"K": "V"}, "timeout": 1.5, "stdin": True, "n": None}
    (frame,) = Decoder().feed(encode_frame(Kind.REQUEST, 1, meta))
    assert frame.meta == json.loads(json.dumps(meta))


# -- fuzzing -------------------------------------------------------------------------------------

SMALL_META = 256
SMALL_DATA = 1024
frames_strategy = st.lists(
    st.tuples(st.sampled_from(list(Kind)), st.integers(0, 2**32 - 1),
              st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=10), max_size=3),
              st.binary(max_size=200)),
    max_size=8,
)


def _encode_all(items: list[tuple[Kind, int, dict[str, object], bytes]]) -> bytes:
    return b"".join(encode_frame(k, s, m, d) for k, s, m, d in items)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4000), st.lists(st.integers(0, 4000), max_size=10))
def test_random_bytes_never_raise_and_never_hang(data: bytes, cuts: list[int]) -> None:
    dec = Decoder(max_meta=SMALL_META, max_data=SMALL_DATA)
    points = sorted({0, len(data), *[c for c in cuts if c <= len(data)]})
    for a, b in itertools.pairwise(points):
        for frame in dec.feed(data[a:b]):
            assert isinstance(frame, Frame)
    # Bounded buffering: never more than one maximal frame is waited for ...
    assert dec.buffered <= HEADER.size + SMALL_META + SMALL_DATA
    # ... so after at most that much filler, a real frame always gets through.
    out = dec.feed(b"\x00" * (HEADER.size + SMALL_META + SMALL_DATA) + encode_frame(Kind.END, 77))
    assert valid(out)[-1] == Frame(Kind.END, 77)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frames_strategy, st.lists(st.integers(0, 10000), max_size=10))
def test_valid_frames_split_anywhere_decode_exactly(items: list[tuple[Kind, int, dict[str, object], bytes]],
                                                    cuts: list[int]) -> None:
    raw = _encode_all(items)
    dec = Decoder(max_meta=SMALL_META * 4, max_data=SMALL_DATA)
    points = sorted({0, len(raw), *[c for c in cuts if c <= len(raw)]})
    out: list[Frame] = []
    for a, b in itertools.pairwise(points):
        out += dec.feed(raw[a:b])
    assert out == [Frame(k, s, m, d) for k, s, m, d in items]
    assert dec.buffered == 0


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frames_strategy,
       st.lists(st.tuples(st.integers(0, 10000), st.integers(0, 255)), min_size=1, max_size=6),
       st.lists(st.integers(0, 10000), max_size=4))
def test_mutated_frames_give_errors_not_exceptions(items: list[tuple[Kind, int, dict[str, object], bytes]],
                                                   flips: list[tuple[int, int]], cuts: list[int]) -> None:
    raw = bytearray(_encode_all(items) + encode_frame(Kind.RESULT, 1, {"last": True}))
    for pos, value in flips:
        if raw:
            raw[pos % len(raw)] = value
    dec = Decoder(max_meta=SMALL_META * 4, max_data=SMALL_DATA)
    points = sorted({0, len(raw), *[c for c in cuts if c <= len(raw)]})
    out: list[Frame] = []
    for a, b in itertools.pairwise(points):
        out += dec.feed(bytes(raw[a:b]))
    for frame in out:
        if frame.malformed:
            assert frame.kind == Kind.ERROR and frame.code in (
                "malformed_frame", "frame_too_large", "unsupported_version")
        else:
            assert isinstance(frame.meta, dict) and isinstance(frame.kind, Kind)
    tail = dec.feed(b"\x00" * (HEADER.size + SMALL_META * 4 + SMALL_DATA) + encode_frame(Kind.END, 5))
    assert valid(tail)[-1] == Frame(Kind.END, 5)
