"""Every error, including FastAPI's own (validation, unknown route, wrong method), as problem+json."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capsa.common.errors import CapsaError
from capsa.control.audit import trail as audit_trail

__all__ = ["install_problem_handlers", "problem_response", "refuse_websocket"]

log = logging.getLogger(__name__)

_STATUS_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 406: "not_acceptable", 413: "payload_too_large",
                 415: "unsupported_media_type", 422: "validation_error", 429: "rate_limited",
                 500: "internal_error", 503: "not_ready"}


def problem_response(status: int, code: str, detail: str, *, title: str | None = None,
                     headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    if title is None:
        try:
            title = HTTPStatus(status).phrase
        except ValueError:
            title = "Error"
    audit_trail.note_error(code)
    body = {"type": f"https://capsa.dev/errors/{code}", "title": title, "status": status, "detail": detail,
            "code": code, **extra}
    return JSONResponse(body, status_code=status, headers=headers, media_type="application/problem+json")


def _field(loc: tuple[int | str, ...] | list[int | str]) -> str:
    return ".".join(str(part) for part in loc)


def install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(CapsaError)
    async def _capsa_error(_request: Request, exc: CapsaError) -> JSONResponse:
        headers = getattr(exc, "headers", None)
        extra = {k: v for k, v in exc.extra.items() if isinstance(v, str | int | float | bool | list | dict)}
        if exc.status >= 500 and exc.code == "internal_error":
            log.error("internal error: %s", exc.message)
        return problem_response(exc.status, exc.code, exc.message, title=getattr(exc, "title", None),
                                headers=headers, **extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"field": _field(err.get("loc", ())), "message": str(err.get("msg", "invalid"))}
                  for err in exc.errors()]
        fields = ", ".join(e["field"] for e in errors[:5])
        return problem_response(422, "validation_error", f"invalid request: {fields}",
                                title="Validation error", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, "http_error")
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return problem_response(exc.status_code, code, detail,
                                headers=dict(exc.headers) if exc.headers else None)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        # The detail is deliberately generic: internals (paths, SQL, tracebacks) never reach the client.
        log.exception("unhandled error")
        return problem_response(500, "internal_error", "internal error")


async def refuse_websocket(websocket: WebSocket, exc: CapsaError) -> None:
    """Answer a WebSocket upgrade with the problem+json error and its HTTP status (or, on a server without
    denial responses, a close whose reason names it)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(problem_response(
            exc.status, exc.code, exc.message, title=getattr(exc, "title", None),
            headers=getattr(exc, "headers", None)))
        return
    code = 1011 if exc.status >= 500 else 1008
    await websocket.close(code=code, reason=f"{exc.status} {exc.code}: {exc.message}"[:120])
