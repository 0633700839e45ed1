"""Signed checkpoints of the tenant audit chains: the anchor that lives outside the database.

A checkpoint says "tenant T's chain had event ``seq`` with hash ``hash``" and is signed with the control
plane's Ed25519 key, a key the database never holds. Checkpoints are appended, one JSON object per line,
to an append-only log (:mod:`capsa.control.audit.anchor` writes it); each line also carries its number in
the log (``n``: 1, 2, ...) and the SHA-256 of the previous line's signed bytes (``prev``), so lines cut
from the middle of the log, reordered or edited are detected, and a line written without the key is
rejected. ``purpose`` is ``head`` (the chain's head at that moment) or ``retention`` (the events up to
``seq`` were verified and may be dropped: the chain's first stored event links to this hash).

Canonical form (version 1) of what is signed: the ASCII JSON encoding of ``{"v": 1, "n", "prev",
"tenant", "seq", "hash", "time_us", "purpose", "key"}`` with keys sorted, no whitespace. ``key`` is the
signer's key id (the first 16 hex digits of the SHA-256 of its raw public key). The line is that object
plus ``"sig"``: the base64 Ed25519 signature of the canonical bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "CHECKPOINT_VERSION",
    "LOG_GENESIS",
    "Checkpoint",
    "CheckpointInvalid",
    "Purpose",
    "ensure_signing_key",
    "key_id",
    "line_digest",
    "load_signing_key",
    "read_checkpoints",
    "sign_checkpoint",
]

CHECKPOINT_VERSION = 1
LOG_GENESIS = "0" * 64
Purpose = Literal["head", "retention"]
_PURPOSES = ("head", "retention")


class CheckpointInvalid(ValueError):
    """A line of the checkpoint log that does not check out (forged, edited, missing or out of order)."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"checkpoint log line {line}: {reason}")
        self.line = line
        self.reason = reason


@dataclass(frozen=True)
class Checkpoint:
    n: int
    """The line's number in the log (1, 2, ...)."""
    prev: str
    """SHA-256 (hex) of the previous line's signed bytes; 64 zeros for line 1."""
    tenant: str
    seq: int
    """The event of the tenant's chain this checkpoint vouches for (0: the chain was empty)."""
    hash: str
    """That event's hash."""
    time_us: int
    purpose: Purpose
    key: str
    """The signing key's id (:func:`key_id`)."""

    def signed_bytes(self) -> bytes:
        return json.dumps({"v": CHECKPOINT_VERSION, **asdict(self)}, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True, allow_nan=False).encode("ascii")


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def line_digest(checkpoint: Checkpoint) -> str:
    """What the next line's ``prev`` must be."""
    return hashlib.sha256(checkpoint.signed_bytes()).hexdigest()


def sign_checkpoint(key: Ed25519PrivateKey, checkpoint: Checkpoint) -> bytes:
    """The log line (JSON, newline-terminated) holding ``checkpoint`` and its signature."""
    payload = checkpoint.signed_bytes()
    signature = base64.b64encode(key.sign(payload)).decode("ascii")
    record = {**json.loads(payload), "sig": signature}
    return (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode("ascii")


def _parse(number: int, line: bytes) -> tuple[Checkpoint, bytes]:
    try:
        record = json.loads(line)
        if not isinstance(record, dict) or record.get("v") != CHECKPOINT_VERSION:
            raise ValueError("not a version 1 checkpoint")
        purpose = record["purpose"]
        if purpose not in _PURPOSES:
            raise ValueError(f"unknown purpose {purpose!r}")
        checkpoint = Checkpoint(n=int(record["n"]), prev=str(record["prev"]), tenant=str(record["tenant"]),
                                seq=int(record["seq"]), hash=str(record["hash"]),
                                time_us=int(record["time_us"]), purpose=purpose, key=str(record["key"]))
        signature = base64.b64decode(str(record["sig"]), validate=True)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise CheckpointInvalid(number, f"malformed ({exc})") from None
    return checkpoint, signature


def read_checkpoints(lines: Iterable[bytes], public: Ed25519PublicKey) -> list[Checkpoint]:
    """Every checkpoint of a log, oldest first, each checked: signed by ``public``'s key, numbered
    consecutively from 1, linked to the previous line. Raises :class:`CheckpointInvalid` at the first
    line that is not."""
    out: list[Checkpoint] = []
    expected_key = key_id(public)
    prev = LOG_GENESIS
    for number, line in enumerate(lines, start=1):
        checkpoint, signature = _parse(number, line)
        if checkpoint.key != expected_key:
            raise CheckpointInvalid(number, f"signed by key {checkpoint.key}, not by this control "
                                            f"plane's key {expected_key}")
        try:
            public.verify(signature, checkpoint.signed_bytes())
        except InvalidSignature:
            raise CheckpointInvalid(number, "the signature does not match (forged or edited)") from None
        if checkpoint.n != number:
            raise CheckpointInvalid(number, f"numbered {checkpoint.n} (lines were removed or reordered)")
        if checkpoint.prev != prev:
            raise CheckpointInvalid(number, "not linked to the previous line (lines were removed or "
                                            "reordered)")
        out.append(checkpoint)
        prev = line_digest(checkpoint)
    return out


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 private key in ``path`` (PEM, PKCS#8, unencrypted). Refuses a file that other users
    may read or write: the key is what makes a checkpoint trustworthy."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path}: the audit signing key must not be accessible to other users "
                         f"(mode {stat.S_IMODE(mode):04o}; chmod 600 it)")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 private key")
    return key


def ensure_signing_key(path: Path) -> Path:
    """Create ``path`` with a fresh Ed25519 key (mode 0600, never replacing an existing file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM,
                                                     serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption())
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return path
