"""``/v1/sessions/{id}/commands`` and ``/processes``: run commands (JSON or NDJSON stream), background
processes: their stdin (``/stdin``: the request body, raw bytes; ``/stdin/close``) and their output as an
NDJSON stream from byte offsets (``/stream``). The logic is in :mod:`capsa.control.process_io`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from capsa.common import node_api
from capsa.control import audit_trail, process_io
from capsa.control.deps import PROBLEMS, Caller, Plane, problems
from capsa.control.errors import PayloadTooLarge
from capsa.control.nodeclient import NodeError
from capsa.control.plane import ControlPlane
from capsa.control.rolling import command_finished
from capsa.control.schemas import (
    CommandRequest,
    CommandResult,
    KillRequest,
    ProcessInfo,
    ProcessList,
    ProcessOutput,
)
from capsa.control.sessions import SANDBOX_GONE_CODES, lose_sandbox, node_call_failed, running_session
from capsa.control.store.models import SessionRow
from capsa.sdk.models import (
    EXEC_EVENT,
    OUTPUT_EVENT,
    ExecError,
    ExecFinished,
    ExecOutput,
    OutputChunk,
    OutputEnd,
    StreamError,
)

__all__ = ["AUDIT_ARGV_BYTES", "argv_detail", "router"]

router = APIRouter(prefix="/sessions/{session_id}", tags=["commands"], responses=PROBLEMS)

_NDJSON = "application/x-ndjson"
_Pid = Annotated[int, Path(ge=1, le=1 << 22)]


def _node_request(plane: ControlPlane, body: CommandRequest) -> node_api.ExecRequest:
    timeout = body.timeout if body.timeout is not None else plane.settings.default_command_timeout
    return node_api.ExecRequest(cmd=body.cmd, env=body.env, cwd=body.cwd, user=body.user, stdin=body.stdin,
                                timeout=timeout)


AUDIT_ARGV_BYTES = 64 * 1024
"""A command line longer than this (JSON-encoded) is recorded cut, with the SHA-256 of the whole."""


def argv_detail(cmd: str | list[str]) -> dict[str, object]:
    """The command as its audit event records it: the argv (or shell line), cut past
    :data:`AUDIT_ARGV_BYTES` with ``argv_truncated`` and the whole one's ``argv_sha256``."""
    encoded = json.dumps(cmd)
    if len(encoded) <= AUDIT_ARGV_BYTES:
        return {"argv": cmd, "shell": isinstance(cmd, str)}
    digest = hashlib.sha256(encoded.encode()).hexdigest()
    if isinstance(cmd, str):
        cut: str | list[str] = cmd[:AUDIT_ARGV_BYTES // 2]
    else:
        kept, size = [], 0
        for arg in cmd:
            piece = arg[:max(0, AUDIT_ARGV_BYTES // 2 - size)]
            kept.append(piece)
            size += len(piece) + 4
            if size >= AUDIT_ARGV_BYTES // 2:
                break
        cut = kept
    return {"argv": cut, "shell": isinstance(cmd, str), "argv_truncated": True, "argv_sha256": digest}


def _note_command(row: SessionRow, body: CommandRequest, outcome: dict[str, object]) -> None:
    """The ``command`` audit event: what ran, where, as whom, and how it ended."""
    audit_trail.note("command", "run", session_id=row.id, detail={
        **argv_detail(body.cmd if isinstance(body.cmd, str) else list(body.cmd)),
        "cwd": body.cwd, "user": body.user, "env_keys": sorted(body.env), **outcome})


def _finished(status: ExecFinished | CommandResult) -> dict[str, object]:
    return {"exit_code": status.exit_code, "signal": status.signal, "timed_out": status.timed_out,
            "duration_ms": status.duration_ms}


def _line(event: ExecOutput | ExecFinished | ExecError) -> str:
    return EXEC_EVENT.dump_json(event).decode() + "\n"


async def _stream(plane: ControlPlane, row: SessionRow, node_events: AsyncIterator[node_api.ExecEvent],
                  stack: AsyncExitStack, body: CommandRequest) -> AsyncIterator[str]:
    failed = False
    outcome: dict[str, object] = {"error": "stream_closed"}
    try:
        async for node_event in node_events:
            try:
                event = EXEC_EVENT.validate_python(node_event.model_dump())
            except ValidationError:
                yield _line(ExecError(code="internal_error", detail="the node sent a malformed stream event"))
                failed = True
                break
            if isinstance(event, ExecError) and event.code in SANDBOX_GONE_CODES:
                # The node reports a vanished sandbox in-band once streaming has begun.
                state = await lose_sandbox(plane, row.id, event.detail or event.code, row.sandbox_id)
                event = ExecError(code="session_failed" if state == "failed" else "invalid_state",
                                  detail=f"session {row.id} lost its sandbox ({state}): {event.detail}")
                failed = True
            if isinstance(event, ExecFinished):
                outcome = _finished(event)
            elif isinstance(event, ExecError):
                outcome = {"error": event.code}
            yield _line(event)
        _note_command(row, body, outcome)
        if not failed:
            await command_finished(plane, row)
    except (NodeError, httpx.HTTPError) as exc:
        _note_command(row, body, {"error": "node_unreachable"})
        yield _line(ExecError(code="node_unreachable",
                              detail=f"lost the node while streaming: {type(exc).__name__}"))
    finally:
        await stack.aclose()


@router.post("/commands", response_model=CommandResult,
             responses={200: {"content": {_NDJSON: {}},
                              "description": "CommandResult, or NDJSON events with "
                                             "Accept: application/x-ndjson"},
                        201: {"model": ProcessInfo, "description": "background process started"}})
async def run_command(session_id: str, body: CommandRequest, plane: Plane, caller: Caller,
                      accept: Annotated[str | None, Header()] = None) -> Any:
    await plane.rates.hit(plane.db, caller.key_id, "commands", plane.settings.command_limit,
                          plane.settings.rate_window_seconds)
    if body.background:
        process = await process_io.start_background(
            plane, caller.tenant, session_id, body.cmd if isinstance(body.cmd, str) else list(body.cmd),
            env=dict(body.env), cwd=body.cwd, user=body.user, open_stdin=body.open_stdin)
        audit_trail.note("command", "start", session_id=session_id, detail={
            **argv_detail(body.cmd if isinstance(body.cmd, str) else list(body.cmd)),
            "cwd": body.cwd, "user": body.user,
            "env_keys": sorted(body.env), "pid": process.pid, "background": True})
        return JSONResponse(process.model_dump(mode="json"), status_code=201)
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    node_request = _node_request(plane, body)
    if accept and _NDJSON in accept:
        stack = AsyncExitStack()
        try:
            events = await stack.enter_async_context(client.exec_stream(row.sandbox_id, node_request))
        except NodeError as exc:
            await stack.aclose()
            raise await node_call_failed(plane, row, exc) from exc
        except BaseException:
            await stack.aclose()
            raise
        return StreamingResponse(_stream(plane, row, events, stack, body), media_type=_NDJSON,
                                 background=BackgroundTask(stack.aclose))
    try:
        result = await client.exec(row.sandbox_id, node_request)
    except NodeError as exc:
        _note_command(row, body, {"error": exc.code})
        raise await node_call_failed(plane, row, exc) from exc
    await command_finished(plane, row)
    answer = CommandResult.model_validate(result.model_dump())
    _note_command(row, body, _finished(answer))
    return answer


@router.get("/processes", response_model=ProcessList)
async def list_processes(session_id: str, plane: Plane, caller: Caller) -> ProcessList:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        items = await client.list_processes(row.sandbox_id)
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc
    return ProcessList(items=[ProcessInfo.model_validate(p.model_dump()) for p in items])


@router.get("/processes/{pid}", response_model=ProcessInfo)
async def get_process(session_id: str, pid: _Pid, plane: Plane, caller: Caller) -> ProcessInfo:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        return ProcessInfo.model_validate((await client.get_process(row.sandbox_id, pid)).model_dump())
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc


@router.get("/processes/{pid}/output", response_model=ProcessOutput)
async def process_output(session_id: str, pid: _Pid, plane: Plane, caller: Caller) -> ProcessOutput:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        output = await client.process_output(row.sandbox_id, pid)
        return ProcessOutput.model_validate(output.model_dump())
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc


@router.post("/processes/{pid}/kill", response_model=ProcessInfo)
async def kill_process(session_id: str, pid: _Pid, plane: Plane, caller: Caller,
                       body: KillRequest | None = None) -> ProcessInfo:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        signal = (body or KillRequest()).signal
        killed = await client.kill_process(row.sandbox_id, pid, signal)
        audit_trail.note("command", "kill", session_id=session_id, detail={"pid": pid, "signal": signal})
        return ProcessInfo.model_validate(killed.model_dump())
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc




MAX_STDIN_BODY = 16 * 1024 * 1024
"""Bytes one ``/stdin`` request may carry."""


@router.post("/processes/{pid}/stdin", response_model=ProcessInfo, responses=problems(409, 413),
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def write_stdin(session_id: str, pid: _Pid, request: Request, plane: Plane,
                      caller: Caller) -> ProcessInfo:
    """Write the request body (raw bytes, any content type) to the process's stdin. The process must have
    been started with ``background`` and ``open_stdin``; 409 ``stdin_closed`` or ``process_exited``
    otherwise."""
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_STDIN_BODY:
            raise PayloadTooLarge(f"body larger than {MAX_STDIN_BODY} bytes")
    return await process_io.send_stdin(plane, caller.tenant, session_id, pid, bytes(data))


@router.post("/processes/{pid}/stdin/close", response_model=ProcessInfo, responses=problems(409))
async def close_stdin(session_id: str, pid: _Pid, plane: Plane, caller: Caller) -> ProcessInfo:
    """Close the process's stdin: it reads EOF. Closing it again is not an error."""
    return await process_io.close_stdin(plane, caller.tenant, session_id, pid)


@router.get("/processes/{pid}/stream", response_class=StreamingResponse,
            responses={200: {"content": {_NDJSON: {}},
                             "description": "One OutputEvent per line: output chunks, then exit (or error)"}})
async def stream_process(session_id: str, pid: _Pid, plane: Plane, caller: Caller,
                         stdout_from: Annotated[int, Query(ge=0)] = 0,
                         stderr_from: Annotated[int, Query(ge=0)] = 0) -> StreamingResponse:
    """The process's output from the byte offsets until it exits. Each line's ``offset`` is where that
    channel continues: reconnect with ``stdout_from``/``stderr_from`` set to the last ones seen to get the
    rest, nothing lost or repeated while the guest still keeps it (the last 1 MiB per channel; ``lost``
    counts what it no longer had)."""
    events = await process_io.stream_output(plane, caller.tenant, session_id, pid, stdout_from=stdout_from,
                                            stderr_from=stderr_from)
    return StreamingResponse(_ndjson(events), media_type=_NDJSON, background=BackgroundTask(events.aclose))


async def _ndjson(events: process_io.EventStream[OutputChunk | OutputEnd | StreamError]
                  ) -> AsyncIterator[str]:
    async for event in events:
        yield OUTPUT_EVENT.dump_json(event).decode() + "\n"
