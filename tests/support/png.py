"""Reading screenshots in tests: an 8-bit truecolour PNG's rows (what Chromium and scrot write) and pixel
comparisons of regions, so a test can show an action changed what the screen shows.

(The same helpers as tests/integration/test_browser_vm.py's own, which can move here.)
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["dark_fraction", "differing", "png_pixels"]


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the RGB rows of an 8-bit RGB or RGBA PNG (alpha dropped)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                line[i] = (line[i] + _paeth(a, b, c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    if channels == 3:
        return width, height, rows
    return width, height, [bytes(r[i] for i in range(len(r)) if i % 4 < 3) for r in rows]


def dark_fraction(rows: list[bytes], box: tuple[int, int, int, int]) -> float:
    """The share of pixels in ``box`` (x0, y0, x1, y1) that are nearly black."""
    x0, y0, x1, y1 = box
    dark = total = 0
    for row in rows[y0:y1]:
        for x in range(x0, x1):
            total += 1
            dark += sum(row[3 * x:3 * x + 3]) < 120
    return dark / total


def differing(a: list[bytes], b: list[bytes], box: tuple[int, int, int, int]) -> int:
    """How many pixels of ``box`` differ between two screenshots of the same size."""
    x0, y0, x1, y1 = box
    return sum(ra[3 * x:3 * x + 3] != rb[3 * x:3 * x + 3] for ra, rb in zip(a[y0:y1], b[y0:y1], strict=True)
               for x in range(x0, x1))
