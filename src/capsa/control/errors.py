"""API errors: each has a stable ``code`` and an HTTP status, rendered as ``application/problem+json``."""

from __future__ import annotations

from typing import Any

from capsa.common.errors import CapsaError

__all__ = [
    "ApiError",
    "ApprovalDecided",
    "ApprovalNotFound",
    "EnrolTokenInvalid",
    "Forbidden",
    "InvalidState",
    "NoCapacity",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "SessionFailed",
    "TemplateNotFound",
    "Unauthorized",
    "ValidationFailed",
]


class ApiError(CapsaError):
    """A failure shown to an API client."""

    title: str = "Internal error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.headers = headers or {}


class Unauthorized(ApiError):
    code, status, title = "unauthorized", 401, "Unauthorized"

    def __init__(self, message: str = "missing, malformed, unknown or revoked API key") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class EnrolTokenInvalid(ApiError):
    code, status, title = "enrol_token_invalid", 401, "Enrolment token invalid"

    def __init__(self, message: str = "unknown, expired or already used node enrolment token") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ApiError):
    code, status, title = "forbidden", 403, "Forbidden"


class NotFound(ApiError):
    code, status, title = "not_found", 404, "Not found"


class ApprovalNotFound(ApiError):
    code, status, title = "approval_not_found", 404, "Approval not found"


class ApprovalDecided(ApiError):
    code, status, title = "approval_decided", 409, "Approval already decided"


class TemplateNotFound(ApiError):
    code, status, title = "template_not_found", 404, "Template not found"


class ValidationFailed(ApiError):
    code, status, title = "validation_error", 422, "Validation error"

    def __init__(self, message: str, errors: list[dict[str, str]]) -> None:
        super().__init__(message, errors=errors)


class RateLimited(ApiError):
    code, status, title = "rate_limited", 429, "Too many requests"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)}, retry_after=retry_after)


class InvalidState(ApiError):
    code, status, title = "invalid_state", 409, "Invalid state"


class SessionFailed(ApiError):
    code, status, title = "session_failed", 409, "Session failed"


class NoCapacity(ApiError):
    code, status, title = "no_capacity", 503, "No capacity"


class PayloadTooLarge(ApiError):
    code, status, title = "payload_too_large", 413, "Payload too large"
