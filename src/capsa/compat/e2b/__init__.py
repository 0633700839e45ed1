"""E2B wire compatibility: the stock ``e2b`` SDK, configured only by environment, runs against capsa.

The control plane mounts :func:`create_e2b_app` at :data:`MOUNT_PATH` (``/e2b``; setting ``e2b_compat``):

- ``E2B_API_URL=<capsa>/e2b``: E2B's REST API (:mod:`capsa.compat.e2b.rest`), ``X-API-KEY`` = a capsa key.
- ``E2B_SANDBOX_URL=<capsa>/e2b/envd``: the envd protocol (:mod:`capsa.compat.e2b.envd`), routed by the
  ``E2b-Sandbox-Id`` header the SDK sends with every sandbox call.

It is a sub-application with its own error format (E2B's, not problem+json) and its own OpenAPI document,
so capsa's ``/v1`` contract (spec/api.openapi.json) does not change with it. docs/e2b.md says which SDK
versions and calls work.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capsa.compat.e2b import envd, rest
from capsa.compat.e2b.access import PlaneGetter
from capsa.compat.e2b.versions import ENVD_VERSION
from capsa.control.errors import ApiError
from capsa.sdk.e2b import E2B_ENVD_PATH, E2B_MOUNT_PATH

__all__ = ["ENVD_PATH", "ENVD_VERSION", "MOUNT_PATH", "create_e2b_app"]

MOUNT_PATH = E2B_MOUNT_PATH
ENVD_PATH = E2B_ENVD_PATH


def create_e2b_app(plane_getter: PlaneGetter) -> FastAPI:
    """The E2B sub-application; ``plane_getter`` returns the running control plane."""
    app = FastAPI(title="capsa E2B compatibility", docs_url=None, redoc_url=None)
    app.state.plane_getter = plane_getter
    app.state.e2b_live = envd.Live()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return rest.e2b_error(exc.status, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request"}
        return rest.e2b_error(400, f"invalid request: {first.get('msg')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return rest.e2b_error(exc.status_code, str(exc.detail))

    app.include_router(envd.router, prefix=ENVD_PATH)
    app.include_router(rest.router)  # last: it ends with the catch-all for what is not served
    return app
