"""Where the API is and which key to use: explicit arguments win over ``CAPSA_API_URL``/``CAPSA_API_KEY``."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["DEFAULT_API_URL", "ClientConfig"]

DEFAULT_API_URL = "http://127.0.0.1:8700"


@dataclass(frozen=True)
class ClientConfig:
    api_url: str = DEFAULT_API_URL
    api_key: str | None = None
    timeout: float = 30.0
    """Seconds to wait for connect and for each read on ordinary requests (commands get their own)."""

    @classmethod
    def resolve(cls, api_url: str | None = None, api_key: str | None = None,
                timeout: float | None = None) -> ClientConfig:
        url = api_url or os.environ.get("CAPSA_API_URL") or DEFAULT_API_URL
        key = api_key if api_key is not None else (os.environ.get("CAPSA_API_KEY") or None)
        return cls(api_url=url.rstrip("/"), api_key=key, timeout=30.0 if timeout is None else timeout)

    def __repr__(self) -> str:
        # Never print the secret part of the key, e.g. in a traceback or a log line.
        shown = None if self.api_key is None else self.api_key.rsplit("_", 1)[0] + "_…"
        return f"ClientConfig(api_url={self.api_url!r}, api_key={shown!r}, timeout={self.timeout!r})"
