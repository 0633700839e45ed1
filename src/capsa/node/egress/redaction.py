"""Keeping secrets out of what a bound destination sends back, on a stream, in bounded memory.

An upstream a secret is sent to may reflect it (an echo endpoint, an error page quoting the request). The
broker rewrites every form of a secret it knows to ``[REDACTED]`` and refuses a response that still holds a
long piece of one:

* the value itself, and any mix of percent-encoding (either hex case) and JSON escaping (``\\/``, ``\\"``,
  ``\\uXXXX``, either hex case) of its characters;
* base64 and base64url of any string that contains it (the characters that depend on the secret alone, at
  each of the three byte alignments), so ``Basic base64(user:secret)`` is caught too;
* a response holding any run of ``leak_run(len(secret))`` consecutive bytes of the raw value (a truncated
  echo) is refused: :class:`SecretLeak`.

What it cannot promise (docs/security.md): an upstream that holds the secret can always transform it in a way
no filter recognises (reversed, split, encrypted, hashed, case-changed): redaction stops accidental
reflection, it is not a barrier against a destination that wants to leak what it was given. The defence
against that is the binding itself: a secret goes to one exact, TLS-verified destination only.

Memory: the stream keeps at most ``window`` bytes beyond what it has released (the longest match minus one),
so a response of any size streams through in memory bounded by the secret lengths.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterable

__all__ = ["REDACTED", "PatternCache", "SecretLeak", "SecretPatterns", "StreamRedactor", "leak_run"]

REDACTED = b"[REDACTED]"
_MIN_B64 = 8  # shorter base64 cores would match ordinary text


class SecretLeak(Exception):
    """A response held a long piece of a secret that no redaction form covered."""


def leak_run(n: int) -> int:
    """How many consecutive bytes of an ``n``-byte secret make a response refused."""
    return min(24, max(12, n // 2))


def _hex_ci(byte: int) -> bytes:
    return b"".join(b"[" + re.escape(bytes([c])).lower() + re.escape(bytes([c])).upper() + b"]"
                    if chr(c).isalpha() else bytes([c]) for c in f"{byte:02X}".encode())


def _char_pattern(ch: str) -> bytes:
    """Every way one character of the secret may be written: itself, %XX per UTF-8 byte, a JSON escape."""
    raw = ch.encode()
    alts = [re.escape(raw)]
    alts.append(b"".join(b"%" + _hex_ci(b) for b in raw))
    json_escapes = {'"': b'\\\\"', "\\": b"\\\\\\\\", "/": b"\\\\/", "\b": b"\\\\b", "\f": b"\\\\f",
                    "\n": b"\\\\n", "\r": b"\\\\r", "\t": b"\\\\t"}
    if ch in json_escapes:
        alts.append(json_escapes[ch])
    if len(ch.encode("utf-16-be")) == 2:
        alts.append(b"\\\\[uU]" + b"".join(_hex_ci(b) for b in ch.encode("utf-16-be")))
    return b"(?:" + b"|".join(alts) + b")"


def _base64_cores(secret: bytes) -> list[bytes]:
    """The base64 characters fixed by ``secret`` alone, wherever it sits in the encoded string."""
    out: list[bytes] = []
    n = len(secret)
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + secret + b"\0\0")
        first = -(-8 * k // 6)
        last = (8 * (k + n) - 6) // 6
        core = enc[first:last + 1]
        if len(core) >= _MIN_B64:
            out += [core, core.replace(b"+", b"-").replace(b"/", b"_")]
    return out


class SecretPatterns:
    """The compiled forms of a set of secrets; shared by every stream that redacts them."""

    def __init__(self, secrets: Iterable[bytes]) -> None:
        values = sorted({s for s in secrets if s}, key=len, reverse=True)
        self.values = values
        alts: list[bytes] = []
        longest = 0
        for s in values:
            text = s.decode("utf-8", "replace")
            alts.append(b"".join(_char_pattern(c) for c in text))
            longest = max(longest, 12 * len(s))  # %XX%XX%XX per 3-byte char, or \uXXXX per char
            alts += [re.escape(c) for c in _base64_cores(s)]
        self._forms = re.compile(b"|".join(alts), re.DOTALL) if alts else None
        self.window = max(longest - 1, 0)
        # Leak check: any run of `run` bytes contains one whole anchor (a slice at a multiple of `step`).
        self._anchors: list[tuple[re.Pattern[bytes], bytes, int]] = []
        for s in values:
            run = leak_run(len(s))
            if len(s) <= run:
                continue
            size = run // 2
            step = run - size + 1
            anchors = {s[i:i + size]: i for i in range(0, len(s) - size + 1, step)}
            rx = re.compile(b"|".join(re.escape(a) for a in anchors), re.DOTALL)
            self._anchors.append((rx, s, run))
            self.window = max(self.window, run - 1)

    def __bool__(self) -> bool:
        return bool(self.values)

    def redact(self, data: bytes) -> bytes:
        """Every recognised form replaced (for a complete value, such as a header)."""
        return self._forms.sub(REDACTED, data) if self._forms is not None else data

    def matches(self, data: bytes) -> Iterable[re.Match[bytes]]:
        return self._forms.finditer(data) if self._forms is not None else ()

    def check_leak(self, data: bytes) -> None:
        """Raise :class:`SecretLeak` if ``data`` holds ``leak_run`` consecutive bytes of a raw secret."""
        for rx, secret, run in self._anchors:
            for m in rx.finditer(data):
                anchor = m.group()
                start = 0
                while (at := secret.find(anchor, start)) >= 0:
                    left = 0
                    while (left < at and m.start() - left > 0
                           and data[m.start() - left - 1] == secret[at - left - 1]):
                        left += 1
                    right = 0
                    end, s_end = m.end(), at + len(anchor)
                    while (s_end + right < len(secret) and end + right < len(data)
                           and data[end + right] == secret[s_end + right]):
                        right += 1
                    if left + len(anchor) + right >= run:
                        raise SecretLeak("response holds part of a secret")
                    start = at + 1


class StreamRedactor:
    """Redacts a body fed in pieces; holds back at most ``patterns.window`` bytes between pieces."""

    def __init__(self, patterns: SecretPatterns) -> None:
        self.patterns = patterns
        self._held = b""
        self._sent_tail = b""  # the last bytes released, for leak runs across pieces

    def feed(self, data: bytes) -> bytes:
        """Bytes safe to send now."""
        return self._release(self._held + data, final=False)

    def finish(self) -> bytes:
        """The rest, at the end of the body."""
        return self._release(self._held, final=True)

    def _release(self, buf: bytes, *, final: bool) -> bytes:
        cut = len(buf) if final else max(len(buf) - self.patterns.window, 0)
        out: list[bytes] = []
        pos = 0
        for m in self.patterns.matches(buf):
            if m.start() >= cut:
                break
            out += [buf[pos:m.start()], REDACTED]
            pos = m.end()
        cut = max(cut, pos)
        out.append(buf[pos:cut])
        self._held = buf[cut:]
        released = b"".join(out)
        self.patterns.check_leak(self._sent_tail + released)
        keep = self.patterns.window
        self._sent_tail = (self._sent_tail + released)[-keep:] if keep else b""
        return released


class PatternCache:
    """One sandbox's :class:`SecretPatterns`, built on first use and kept until the values they spell change:
    a policy change (:meth:`forget`) or a new ``generation`` of the tokens they hold."""

    def __init__(self) -> None:
        self._patterns: SecretPatterns | None = None
        self._generation = -1

    def get(self, generation: int, values: Callable[[], Iterable[bytes]]) -> SecretPatterns:
        if self._patterns is not None and self._generation != generation:
            self.forget()  # a token it holds changed: the old one's forms must go too
        if self._patterns is None:
            self._patterns = SecretPatterns(values())
            self._generation = generation
        return self._patterns

    def forget(self) -> None:
        if self._patterns is not None:
            self._patterns = None
            self._generation = -1
            re.purge()  # the compiled forms (which spell the secrets) also sit in re's cache
