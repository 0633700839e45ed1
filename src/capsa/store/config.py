"""Which store a deployment uses: ``CAPSA_STORE_URL`` (``file:///path`` or ``s3://bucket/prefix``) and, for
S3 anywhere but AWS, ``CAPSA_STORE_S3_ENDPOINT``. No URL: no store, and capsa keeps everything node-local."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from capsa.common.settings import Settings
from capsa.store.objects import ObjectStore, StoreError

__all__ = ["open_store", "store_from_settings"]


def open_store(url: str, *, s3_endpoint: str | None = None) -> ObjectStore:
    """The store ``url`` names (``CAPSA_STORE_URL``); ``s3_endpoint`` empty or None: AWS's own endpoint."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise StoreError(f"CAPSA_STORE_URL: a file store is file:///absolute/path, not {url!r}")
        from capsa.store.directory import DirectoryStore

        return DirectoryStore(Path(unquote(parts.path)))
    if parts.scheme == "s3":
        if not parts.netloc or parts.query or parts.fragment:
            raise StoreError(f"CAPSA_STORE_URL: an S3 store is s3://bucket[/prefix], not {url!r}")
        from capsa.store.s3 import S3Store

        return S3Store(parts.netloc, unquote(parts.path), endpoint=s3_endpoint or None)
    raise StoreError(f"CAPSA_STORE_URL must start with file:// or s3://, not {url!r}")


def store_from_settings(settings: Settings) -> ObjectStore | None:
    if not settings.store_url:
        return None
    return open_store(settings.store_url, s3_endpoint=settings.store_s3_endpoint)
