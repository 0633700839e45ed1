"""The node agent's HTTP API (``/node/v1``), called only by the control plane with the node token."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from http import HTTPStatus
from importlib.metadata import version
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from capsa.common.egress_policy import EgressPolicy
from capsa.common.errors import CapsaError
from capsa.node.agent import NodeAgent, SandboxRecord
from capsa.node.api_models import (
    AuditPageOut,
    ExecRequest,
    FileInfoOut,
    FileListOut,
    KillBody,
    NodeInfo,
    PolicyUpdateIn,
    PolicyUpdateOut,
    ProcessListOut,
    ProcessOut,
    ProcessOutputOut,
    ProcessStart,
    SandboxCreate,
    SandboxList,
    SandboxOut,
)
from capsa.node.runtime.base import SandboxState

__all__ = ["create_node_app"]

log = logging.getLogger(__name__)

_NDJSON = "application/x-ndjson"
# HTTP status for the guest daemon's stable error codes; anything else the guest reports is a 400.
_GUEST_STATUS = {"not_found": 404, "no_such_process": 404, "permission_denied": 403, "already_exists": 409,
                 "directory_not_empty": 409, "no_space": 507, "io_error": 500, "internal": 500,
                 "internal_error": 500}
_GuestPath = Annotated[str, Query(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$")]
_bearer = HTTPBearer(auto_error=False)


def _problem(status: int, code: str, detail: str) -> JSONResponse:
    body = {"type": f"https://capsa.dev/errors/{code}", "title": _phrase(status), "status": status,
            "detail": detail, "code": code}
    return JSONResponse(body, status_code=status, media_type="application/problem+json")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _translate(record: SandboxRecord, exc: BaseException) -> CapsaError:
    """A failed guest call as an error with a stable code; a dead VM always reads ``sandbox_failed``."""
    if record.sandbox.state == SandboxState.FAILED:
        return CapsaError(f"sandbox {record.id} failed: {record.sandbox.failure or 'VM died'}",
                          code="sandbox_failed", status=409)
    if isinstance(exc, CapsaError) and exc.code in ("sandbox_failed",):
        return CapsaError(exc.message, code="sandbox_failed", status=409)
    if isinstance(exc, CapsaError) and exc.code not in ("internal_error", "channel_closed"):
        status = exc.status if 400 <= exc.status < 500 else _GUEST_STATUS.get(exc.code, 400)
        return CapsaError(exc.message, code=exc.code, status=status)
    return CapsaError(f"guest channel failed: {type(exc).__name__}", code="guest_unavailable", status=502)


@contextlib.contextmanager
def _guest_call(record: SandboxRecord) -> Iterator[None]:
    try:
        yield
    except (CapsaError, OSError, EOFError, asyncio.IncompleteReadError) as exc:
        raise _translate(record, exc) from exc


def _iso(value: Any) -> str:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC).isoformat()
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    return str(value)


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return value.decode("utf-8", errors="replace")
    return str(value or "")


def _process(info: Any) -> ProcessOut:
    cmd = info.cmd
    return ProcessOut(pid=info.pid, cmd=[cmd] if isinstance(cmd, str) else list(cmd), running=info.running,
                      exit_code=info.exit_code, signal=info.signal, started_at=_iso(info.started_at))


def _file(info: Any) -> FileInfoOut:
    return FileInfoOut(path=info.path, name=info.name, type=info.type, size=info.size, mode=info.mode,
                       mtime=info.mtime)


def _result(res: Any, with_output: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"exit_code": res.exit_code, "signal": res.signal,
                           "stdout_truncated": res.stdout_truncated, "stderr_truncated": res.stderr_truncated,
                           "timed_out": res.timed_out, "duration_ms": round(res.duration * 1000, 3)}
    if with_output:
        out["stdout"] = _text(res.stdout)
        out["stderr"] = _text(res.stderr)
    return out


async def _first_then_rest(chunks: AsyncIterator[bytes], record: SandboxRecord) -> AsyncIterator[bytes]:
    """Pull the first chunk now so errors (missing file…) become a status code, not a truncated 200."""
    with _guest_call(record):
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            first = b""

    async def rest() -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except (CapsaError, OSError) as exc:
            # The status line is gone already: aborting the response is the only way to say "incomplete".
            log.warning("stream from sandbox %s failed midway: %s", record.id, exc)
            raise
        finally:
            closer = getattr(chunks, "aclose", None)
            if closer is not None:
                await closer()

    return rest()


def _record(request: Request, sandbox_id: str) -> SandboxRecord:
    agent = request.app.state.agent
    assert isinstance(agent, NodeAgent)
    return agent.get(sandbox_id)


Record = Annotated[SandboxRecord, Depends(_record)]


def create_node_app(agent: NodeAgent, token: str) -> FastAPI:
    """The node API for ``agent``; every route but ``/node/v1/health`` needs the Bearer ``token``."""
    if len(token) < 16:
        raise ValueError("node token must be at least 16 characters")

    async def _auth(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        given = credentials.credentials if credentials else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise CapsaError("missing or wrong node token", code="unauthorized", status=401)

    app = FastAPI(title="capsa node agent", version=version("capsa"))
    app.state.agent = agent
    router = APIRouter(prefix="/node/v1", dependencies=[Depends(_auth)])

    @app.exception_handler(CapsaError)
    async def _capsa_error(_request: Request, exc: CapsaError) -> JSONResponse:
        return _problem(exc.status, exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = ", ".join(".".join(str(p) for p in e.get("loc", ())) for e in exc.errors()[:5])
        return _problem(422, "validation_error", f"invalid request: {fields}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "http_error"
        return _problem(exc.status_code, code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("node agent error")
        return _problem(500, "internal_error", "internal error")

    @app.get("/node/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "node_id": agent.node_id}

    @router.get("/info", response_model=NodeInfo)
    async def info() -> Any:
        return agent.info()

    @router.post("/sandboxes", status_code=201, response_model=SandboxOut)
    async def create_sandbox(body: SandboxCreate) -> Any:
        policy = EgressPolicy.from_data(body.policy) if body.policy is not None else None
        record = await agent.create(body.id, body.template, body.memory_mib, body.vcpus, body.env,
                                    policy=policy, session_id=body.session_id,
                                    secrets={k: v.get_secret_value() for k, v in body.secrets.items()})
        return record.as_dict()

    @router.put("/sandboxes/{sandbox_id}/policy", response_model=PolicyUpdateOut)
    async def update_policy(sandbox_id: str, body: PolicyUpdateIn) -> Any:
        reissued = await agent.update_policy(sandbox_id, EgressPolicy.from_data(body.policy),
                                             {k: v.get_secret_value() for k, v in body.secrets.items()})
        return PolicyUpdateOut(ca_reissued=reissued)

    @router.get("/audit", response_model=AuditPageOut)
    async def audit(after: Annotated[int, Query(ge=0)] = 0,
                    epoch: Annotated[str | None, Query(max_length=64)] = None,
                    limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> Any:
        if agent.egress is None:
            return AuditPageOut(epoch="none", items=[], last_seq=0, lost=0)
        page = agent.egress.audit.read(after, epoch, limit)
        return {"epoch": page.epoch, "last_seq": page.last_seq, "lost": page.lost,
                "items": [{"seq": seq, **ev.model_dump()} for seq, ev in page.events]}

    @router.get("/sandboxes", response_model=SandboxList)
    async def list_sandboxes() -> Any:
        return {"items": [r.as_dict() for r in agent.list()]}

    @router.get("/sandboxes/{sandbox_id}", response_model=SandboxOut)
    async def get_sandbox(sandbox_id: str) -> Any:
        return agent.get(sandbox_id).as_dict()

    @router.delete("/sandboxes/{sandbox_id}", status_code=204, response_class=Response)
    async def destroy_sandbox(sandbox_id: str) -> Response:
        await agent.destroy(sandbox_id)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/exec",
                 responses={200: {"content": {_NDJSON: {}, "application/json": {}}}})
    async def exec_command(record: Record, body: ExecRequest,
                           accept: Annotated[str | None, Header()] = None) -> Any:
        env = {**record.env, **body.env}
        stdin = body.stdin.encode() if body.stdin is not None else None
        guest = record.sandbox.guest
        if not (accept and _NDJSON in accept):
            with _guest_call(record):
                res = await guest.exec(body.cmd, env=env, cwd=body.cwd, user=body.user, stdin=stdin,
                                       timeout=body.timeout, max_output=body.max_output)
            return _result(res, with_output=True)

        queue: asyncio.Queue[str | None] = asyncio.Queue()
        decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace")
                    for name in ("stdout", "stderr")}

        def _emit(kind: str, data: bytes, final: bool = False) -> None:
            text = decoders[kind].decode(data, final)
            if text:
                queue.put_nowait(json.dumps({"type": kind, "data": text}) + "\n")

        async def _run() -> None:
            try:
                with _guest_call(record):
                    res = await guest.exec(body.cmd, env=env, cwd=body.cwd, user=body.user, stdin=stdin,
                                           timeout=body.timeout, max_output=body.max_output,
                                           on_stdout=lambda b: _emit("stdout", b),
                                           on_stderr=lambda b: _emit("stderr", b))
                _emit("stdout", b"", True)
                _emit("stderr", b"", True)
                queue.put_nowait(json.dumps({"type": "result", **_result(res, with_output=False)}) + "\n")
            except CapsaError as exc:
                queue.put_nowait(json.dumps({"type": "error", "code": exc.code,
                                             "detail": exc.message}) + "\n")
            except Exception:
                log.exception("exec stream failed")
                queue.put_nowait(json.dumps({"type": "error", "code": "internal_error",
                                             "detail": "internal error"}) + "\n")
            finally:
                queue.put_nowait(None)

        task = asyncio.create_task(_run())

        async def _lines() -> AsyncIterator[str]:
            try:
                while (line := await queue.get()) is not None:
                    yield line
            finally:
                # The client went away (or we are done): cancelling kills the guest process.
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        return StreamingResponse(_lines(), media_type=_NDJSON)

    @router.post("/sandboxes/{sandbox_id}/processes", response_model=ProcessOut)
    async def start_process(record: Record, body: ProcessStart) -> Any:
        with _guest_call(record):
            info = await record.sandbox.guest.start_process(body.cmd, env={**record.env, **body.env},
                                                            cwd=body.cwd, user=body.user)
        return _process(info)

    @router.get("/sandboxes/{sandbox_id}/processes", response_model=ProcessListOut)
    async def list_processes(record: Record) -> Any:
        with _guest_call(record):
            items = await record.sandbox.guest.list_processes()
        return {"items": [_process(i) for i in items]}

    @router.get("/sandboxes/{sandbox_id}/processes/{pid}", response_model=ProcessOut)
    async def get_process(record: Record, pid: int) -> Any:
        with _guest_call(record):
            items = await record.sandbox.guest.list_processes()
        for item in items:
            if item.pid == pid:
                return _process(item)
        raise CapsaError(f"no process {pid}", code="not_found", status=404)

    @router.get("/sandboxes/{sandbox_id}/processes/{pid}/output", response_model=ProcessOutputOut)
    async def process_output(record: Record, pid: int) -> Any:
        with _guest_call(record):
            out = await record.sandbox.guest.process_output(pid)
        return ProcessOutputOut(stdout=_text(out.stdout), stderr=_text(out.stderr), running=out.running,
                                exit_code=out.exit_code, signal=out.signal,
                                stdout_truncated=out.stdout_truncated, stderr_truncated=out.stderr_truncated)

    @router.post("/sandboxes/{sandbox_id}/processes/{pid}/kill", response_model=ProcessOut)
    async def kill_process(record: Record, pid: int, body: KillBody) -> Any:
        with _guest_call(record):
            info = await record.sandbox.guest.kill_process(pid, body.signal)
        return _process(info)

    @router.get("/sandboxes/{sandbox_id}/files/content")
    async def read_file(record: Record, path: _GuestPath) -> StreamingResponse:
        chunks = await _first_then_rest(record.sandbox.guest.iter_file(path), record)
        return StreamingResponse(chunks, media_type="application/octet-stream")

    @router.put("/sandboxes/{sandbox_id}/files/content", response_model=FileInfoOut)
    async def write_file(record: Record, path: _GuestPath, request: Request,
                         mode: Annotated[str | None, Query(pattern=r"^[0-7]{3,4}$")] = None) -> Any:
        with _guest_call(record):
            info = await record.sandbox.guest.write_file(path, request.stream(),
                                                         mode=int(mode, 8) if mode else None)
        return _file(info)

    @router.get("/sandboxes/{sandbox_id}/files/list", response_model=FileListOut)
    async def list_dir(record: Record, path: _GuestPath) -> Any:
        with _guest_call(record):
            items = await record.sandbox.guest.list_dir(path)
        return {"items": [_file(i) for i in items]}

    @router.get("/sandboxes/{sandbox_id}/files/stat", response_model=FileInfoOut)
    async def stat(record: Record, path: _GuestPath) -> Any:
        with _guest_call(record):
            return _file(await record.sandbox.guest.stat(path))

    @router.post("/sandboxes/{sandbox_id}/files/mkdir", response_model=FileInfoOut)
    async def mkdir(record: Record, path: _GuestPath, parents: bool = True) -> Any:
        with _guest_call(record):
            return _file(await record.sandbox.guest.mkdir(path, parents=parents))

    @router.delete("/sandboxes/{sandbox_id}/files", status_code=204, response_class=Response)
    async def remove(record: Record, path: _GuestPath, recursive: bool = False) -> Response:
        with _guest_call(record):
            await record.sandbox.guest.remove(path, recursive=recursive)
        return Response(status_code=204)

    @router.get("/sandboxes/{sandbox_id}/files/archive")
    async def export_archive(record: Record, path: _GuestPath) -> StreamingResponse:
        chunks = await _first_then_rest(record.sandbox.guest.tar_export(path), record)
        return StreamingResponse(chunks, media_type="application/x-tar")

    @router.put("/sandboxes/{sandbox_id}/files/archive", status_code=204, response_class=Response)
    async def import_archive(record: Record, path: _GuestPath, request: Request) -> Response:
        with _guest_call(record):
            await record.sandbox.guest.tar_import(path, request.stream())
        return Response(status_code=204)

    app.include_router(router)
    return app
