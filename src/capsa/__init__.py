"""capsa: self-hostable microVM sandboxes for AI agents.

``from capsa import Session`` gives the client SDK: every name :mod:`capsa.sdk` exports. The names are
loaded on first use because this package also holds the guest daemon, which runs inside the VM with the
standard library only (no httpx there).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capsa.sdk import *  # noqa: F403
    from capsa.sdk import __all__ as __all__


def __getattr__(name: str) -> Any:
    """The SDK's names (and ``__all__``, for ``from capsa import *``), imported on first use."""
    sdk = importlib.import_module("capsa.sdk")
    if name == "__all__" or name in sdk.__all__:
        value = getattr(sdk, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'capsa' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(importlib.import_module("capsa.sdk").__all__))
