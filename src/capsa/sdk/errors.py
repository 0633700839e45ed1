"""Exceptions raised by the SDK, one class per stable API error ``code``.

The server answers every failure with ``application/problem+json`` carrying a ``code``;
:func:`error_from_problem` turns that body back into the matching class so callers can ``except NotFound``
instead of parsing strings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BadRequest",
    "CapsaAPIError",
    "CapsaClientError",
    "CapsaConnectionError",
    "CapsaTimeoutError",
    "FieldError",
    "Forbidden",
    "InternalError",
    "InvalidState",
    "NoCapacity",
    "NodeUnreachable",
    "NotFound",
    "NotReady",
    "PayloadTooLarge",
    "RateLimited",
    "SessionFailed",
    "TemplateNotFound",
    "Unauthorized",
    "Unavailable",
    "UnexpectedResponse",
    "ValidationFailed",
    "error_from_problem",
]


class CapsaClientError(Exception):
    """Base of everything the SDK raises on purpose."""


class CapsaConnectionError(CapsaClientError):
    """The API could not be reached (refused, DNS, TLS, connection dropped mid-response)."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class CapsaTimeoutError(CapsaConnectionError):
    """The API did not answer within the client's timeout."""


class UnexpectedResponse(CapsaClientError):
    """A success answer whose body does not have the shape the API contract promises."""


class CapsaAPIError(CapsaClientError):
    """The API answered with a problem document. ``code`` is stable; ``detail`` is for humans."""

    code: str = "api_error"
    status: int = 0

    def __init__(self, detail: str, *, code: str | None = None, status: int | None = None,
                 title: str | None = None, body: Mapping[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.title = title
        self.body: dict[str, Any] = dict(body or {})

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}" if self.detail else self.code


class Unauthorized(CapsaAPIError):
    """The API key is missing, wrong or revoked."""

    code = "unauthorized"
    status = 401


class Forbidden(CapsaAPIError):
    """The key is valid but not allowed to do this (e.g. a non-admin key on an admin route)."""

    code = "forbidden"
    status = 403


class NotFound(CapsaAPIError):
    """No such resource for this tenant (another tenant's session looks exactly like a missing one)."""

    code = "not_found"
    status = 404


class TemplateNotFound(NotFound):
    code = "template_not_found"
    status = 404


class FieldError(dict[str, str]):
    """One entry of a validation error: ``{"field": "body.timeout", "message": "..."}``."""

    @property
    def field(self) -> str:
        return self.get("field", "")

    @property
    def message(self) -> str:
        return self.get("message", "")


class ValidationFailed(CapsaAPIError):
    """The request was rejected as invalid; ``errors`` names each offending field."""

    code = "validation_error"
    status = 422

    def __init__(self, detail: str, **kwargs: Any) -> None:
        super().__init__(detail, **kwargs)
        raw = self.body.get("errors")
        if not isinstance(raw, list):
            raw = []
        self.errors: list[FieldError] = [
            FieldError(field=str(e.get("field", "")), message=str(e.get("message", "")))
            for e in raw if isinstance(e, Mapping)
        ]

    def __str__(self) -> str:
        base = super().__str__()
        if not self.errors:
            return base
        fields = "; ".join(f"{e.field}: {e.message}" for e in self.errors)
        return f"{base} ({fields})"


class RateLimited(CapsaAPIError):
    """Too many requests for this key; retry after ``retry_after`` seconds (None when not given)."""

    code = "rate_limited"
    status = 429

    def __init__(self, detail: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(detail, **kwargs)
        self.retry_after = retry_after


class InvalidState(CapsaAPIError):
    """The session is not in a state that allows this (e.g. running a command in a closed session)."""

    code = "invalid_state"
    status = 409


class SessionFailed(InvalidState):
    """The session's sandbox died; the session cannot be used any more."""

    code = "session_failed"
    status = 409


class PayloadTooLarge(CapsaAPIError):
    code = "payload_too_large"
    status = 413


class BadRequest(CapsaAPIError):
    code = "bad_request"
    status = 400


class Unavailable(CapsaAPIError):
    """The server cannot do this right now; retrying later may succeed."""

    code = "unavailable"
    status = 503


class NoCapacity(Unavailable):
    """No node has room for a new sandbox right now."""

    code = "no_capacity"
    status = 503


class NotReady(Unavailable):
    """The server is up but cannot serve yet (database or node missing)."""

    code = "not_ready"
    status = 503


class NodeUnreachable(Unavailable):
    """The control plane lost contact with the node running the session's sandbox."""

    code = "node_unreachable"
    status = 503


class InternalError(CapsaAPIError):
    code = "internal_error"
    status = 500


_BY_CODE: dict[str, type[CapsaAPIError]] = {
    cls.code: cls
    for cls in (BadRequest, Unauthorized, Forbidden, NotFound, TemplateNotFound, ValidationFailed,
                RateLimited, InvalidState, SessionFailed, PayloadTooLarge, Unavailable, NoCapacity, NotReady,
                NodeUnreachable, InternalError)
}
# Used when the body carries no code we know (an older/newer server, or a proxy in between).
_BY_STATUS: dict[int, type[CapsaAPIError]] = {
    400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: InvalidState,
    413: PayloadTooLarge, 422: ValidationFailed, 429: RateLimited, 500: InternalError, 503: Unavailable,
}


def _parse_retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # the HTTP-date form is not used by capsa; ignore rather than guess
    return max(seconds, 0.0) if math.isfinite(seconds) else None


def error_from_problem(status: int, body: Mapping[str, Any] | None, *,
                       retry_after: str | None = None, fallback_detail: str = "") -> CapsaAPIError:
    """Build the exception for an error response (``body`` is the parsed problem document, if any)."""
    body = body or {}
    code = body.get("code")
    cls = _BY_CODE.get(code) if isinstance(code, str) else None
    if cls is None:
        cls = _BY_STATUS.get(status, CapsaAPIError)
        if status >= 500 and cls is CapsaAPIError:
            cls = InternalError
    detail = body.get("detail") or body.get("title") or fallback_detail or f"HTTP {status}"
    title = body.get("title")
    kwargs: dict[str, Any] = {
        "code": code if isinstance(code, str) else None,
        # Errors reported inside a stream (status 0) take the status their class normally has.
        "status": status or None,
        "title": title if isinstance(title, str) else None,
        "body": body,
    }
    if cls is RateLimited:
        return RateLimited(str(detail), retry_after=_parse_retry_after(retry_after), **kwargs)
    return cls(str(detail), **kwargs)
