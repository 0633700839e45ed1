"""Where signed audit checkpoints go (:mod:`capsa.common.audit_checkpoint`): an append-only sink outside
the database, and the signer that numbers, links and signs each checkpoint before it is appended.

The sink is pluggable (:class:`CheckpointSink`: append one line, read every line back); the one here is a
local file opened ``O_APPEND`` and fsynced after every line (:class:`FileCheckpointSink`). A fleet can
plug in another (an object store with object lock, a WORM bucket) without touching the signer. Someone who
can write the database but not the sink or the key cannot make the chain look shorter than the newest
checkpoint says, nor forge a checkpoint that says less.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from capsa.common.audit_checkpoint import (
    LOG_GENESIS,
    Checkpoint,
    CheckpointInvalid,
    Purpose,
    key_id,
    line_digest,
    read_checkpoints,
    sign_checkpoint,
)

__all__ = ["CheckpointSink", "Checkpointer", "FileCheckpointSink"]

log = logging.getLogger(__name__)


class CheckpointSink(Protocol):
    """Append-only storage for checkpoint lines."""

    async def append(self, line: bytes) -> None:
        """Store one line durably (returns once it is)."""

    async def read(self) -> list[bytes]:
        """Every line stored, oldest first."""


class FileCheckpointSink:
    """A JSON-lines file (mode 0600) written with ``O_APPEND`` and fsynced after each line. Make it
    append-only for the database's owner too (``chattr +a``, a separate user, or a mount only this
    process writes) for the anchor to hold against someone who can write the state directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _append(self, line: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read(self) -> list[bytes]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        return [line for line in data.split(b"\n") if line.strip()]

    async def append(self, line: bytes) -> None:
        await asyncio.to_thread(self._append, line)

    async def read(self) -> list[bytes]:
        return await asyncio.to_thread(self._read)


class Checkpointer:
    """Signs checkpoints with the control plane's key and appends them to the sink, one at a time.

    It remembers, per tenant, the checkpoint with the highest ``seq`` this log holds (the strongest claim
    about the chain's length), so periodic checkpoints are written only for chains that moved."""

    def __init__(self, key: Ed25519PrivateKey, sink: CheckpointSink) -> None:
        self.key = key
        self.public = key.public_key()
        self.key_id = key_id(self.public)
        self.sink = sink
        self._lock = asyncio.Lock()
        self._loaded = False
        self._n = 0
        self._prev = LOG_GENESIS
        self._highest: dict[str, Checkpoint] = {}

    async def read(self) -> list[Checkpoint]:
        """Every checkpoint in the sink, each checked (raises :class:`CheckpointInvalid`)."""
        lines = await self.sink.read()
        return await asyncio.to_thread(read_checkpoints, lines, self.public)  # a signature check per line

    async def _load(self) -> None:
        if self._loaded:
            return
        lines = await self.sink.read()
        try:
            checkpoints = read_checkpoints(lines, self.public)
        except CheckpointInvalid as exc:
            # Keep appending after what is there: verification reports the bad line until an operator
            # starts a new log; refusing to checkpoint would only widen the window it does not cover.
            log.error("the audit checkpoint log does not check out: %s", exc)
            checkpoints = read_checkpoints(lines[:exc.line - 1], self.public)
            self._n = len(lines)
            self._prev = LOG_GENESIS
        else:
            self._n = len(checkpoints)
            self._prev = line_digest(checkpoints[-1]) if checkpoints else LOG_GENESIS
        for checkpoint in checkpoints:
            self._remember(checkpoint)
        self._loaded = True

    def _remember(self, checkpoint: Checkpoint) -> None:
        known = self._highest.get(checkpoint.tenant)
        if known is None or checkpoint.seq >= known.seq:
            self._highest[checkpoint.tenant] = checkpoint

    async def highest(self, tenant: str) -> Checkpoint | None:
        """The checkpoint with the highest ``seq`` for the tenant (the newest of those)."""
        async with self._lock:
            await self._load()
            return self._highest.get(tenant)

    async def tenants(self) -> Sequence[str]:
        async with self._lock:
            await self._load()
            return sorted(self._highest)

    async def write(self, tenant: str, seq: int, digest: str, purpose: Purpose = "head") -> Checkpoint:
        """Sign and append a checkpoint of the tenant's chain at event ``seq`` (hash ``digest``)."""
        async with self._lock:
            await self._load()
            checkpoint = Checkpoint(n=self._n + 1, prev=self._prev, tenant=tenant, seq=seq, hash=digest,
                                    time_us=int(time.time() * 1_000_000), purpose=purpose, key=self.key_id)
            await self.sink.append(sign_checkpoint(self.key, checkpoint))
            self._n, self._prev = checkpoint.n, line_digest(checkpoint)
            self._remember(checkpoint)
            return checkpoint
