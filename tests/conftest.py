"""Fixtures shared by every test suite. Others may append fixtures here; keep each one small."""

from __future__ import annotations

import pytest

from capsa.common.image import GuestImage
from capsa.common.settings import Settings


@pytest.fixture(scope="session")
def guest_image() -> GuestImage:
    """The real guest image for the current sources, from the cache (CAPSA_CACHE_DIR or
    /var/cache/capsa); built first if missing (about a minute with a warm package cache)."""
    from capsa.images import ensure_image

    return ensure_image(Settings())
