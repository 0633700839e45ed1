"""Errors shared by the control plane and the node agent.

Every failure a user can see carries a stable ``code`` (snake_case) that the API puts in its
``application/problem+json`` body and the SDK maps back to an exception class.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CapsaError"]


class CapsaError(Exception):
    """A failure with a stable machine-readable code and an HTTP status."""

    code: str = "internal_error"
    status: int = 500

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.extra = extra
