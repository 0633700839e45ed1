"""capsa: self-hostable microVM sandboxes for AI agents.

``from capsa import Session`` gives the client SDK. The names are loaded on first use because this package
also holds the guest daemon, which runs inside the VM with the standard library only (no httpx there).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capsa.sdk import (
        AsyncClient,
        AsyncSecrets,
        AsyncSession,
        AuditEvent,
        BadRequest,
        CapsaAPIError,
        CapsaClientError,
        CapsaConnectionError,
        CapsaTimeoutError,
        Client,
        CommandResult,
        FileInfo,
        Forbidden,
        InternalError,
        InvalidState,
        NoCapacity,
        NodeUnreachable,
        NotFound,
        NotReady,
        PayloadTooLarge,
        Process,
        ProcessInfo,
        RateLimited,
        Secrets,
        Session,
        SessionFailed,
        SessionInfo,
        TemplateNotFound,
        Unauthorized,
        Unavailable,
        ValidationFailed,
    )

__all__ = [
    "AsyncClient",
    "AsyncSecrets",
    "AsyncSession",
    "AuditEvent",
    "BadRequest",
    "CapsaAPIError",
    "CapsaClientError",
    "CapsaConnectionError",
    "CapsaTimeoutError",
    "Client",
    "CommandResult",
    "FileInfo",
    "Forbidden",
    "InternalError",
    "InvalidState",
    "NoCapacity",
    "NodeUnreachable",
    "NotFound",
    "NotReady",
    "PayloadTooLarge",
    "Process",
    "ProcessInfo",
    "RateLimited",
    "Secrets",
    "Session",
    "SessionFailed",
    "SessionInfo",
    "TemplateNotFound",
    "Unauthorized",
    "Unavailable",
    "ValidationFailed",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("capsa.sdk"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'capsa' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
