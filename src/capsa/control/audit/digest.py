"""Size and SHA-256 of a file body as it streams through the control plane, for its ``file`` audit event
(nothing is buffered: each chunk is hashed on its way)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

__all__ = ["StreamDigest"]


class StreamDigest:
    def __init__(self) -> None:
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.complete = False
        """True once the whole body went through (False: the transfer stopped early)."""

    async def through(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            self.sha256.update(chunk)
            self.size += len(chunk)
            yield chunk
        self.complete = True

    def detail(self, path: str, **extra: object) -> dict[str, object]:
        return {"path": path, "size": self.size, "sha256": self.sha256.hexdigest(),
                "complete": self.complete, **extra}
