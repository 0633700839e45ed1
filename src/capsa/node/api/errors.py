"""Errors at the node API's edge: every error answered as problem+json with the status of the node's one
table (:func:`capsa.node.statuses.status_of`)."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capsa.common.errors import CapsaError
from capsa.node.statuses import status_of

__all__ = ["install_error_handlers", "problem"]

log = logging.getLogger(__name__)


def problem(status: int, code: str, detail: str) -> JSONResponse:
    body = {"type": f"https://capsa.dev/errors/{code}", "title": _phrase(status), "status": status,
            "detail": detail, "code": code}
    return JSONResponse(body, status_code=status, media_type="application/problem+json")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(CapsaError)
    async def _capsa_error(_request: Request, exc: CapsaError) -> JSONResponse:
        return problem(status_of(exc), exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = ", ".join(".".join(str(p) for p in e.get("loc", ())) for e in exc.errors()[:5])
        return problem(422, "validation_error", f"invalid request: {fields}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "http_error"
        return problem(exc.status_code, code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("node agent error")
        return problem(500, "internal_error", "internal error")
