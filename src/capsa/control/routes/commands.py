"""``/v1/sessions/{id}/commands`` and ``/processes``: run commands (JSON or NDJSON stream), background
processes: their stdin (``/stdin``: the request body, raw bytes; ``/stdin/close``) and their output as an
NDJSON stream from byte offsets (``/stream``). The logic is in :mod:`capsa.control.sessions.process_io`."""

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
from capsa.common.wire.streams import OUTPUT_EVENT, ExecError, ExecOutput, OutputChunk, OutputEnd, StreamError
from capsa.control.audit import trail as audit_trail
from capsa.control.deps import PROBLEMS, Caller, Plane, problems
from capsa.control.errors import PayloadTooLarge
from capsa.control.nodes.calls import NodeLost, until_lost
from capsa.control.plane import ControlPlane
from capsa.control.schemas import (
    CommandRequest,
    CommandResult,
    KillRequest,
    ProcessInfo,
    ProcessList,
    ProcessOutput,
)
from capsa.control.sessions import process_io, relay
from capsa.control.sessions.rolling import command_finished
from capsa.sdk.models import EXEC_EVENT, ExecFinished

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


def _command_detail(body: CommandRequest, outcome: dict[str, object]) -> dict[str, object]:
    """The ``command`` audit event's detail: what ran, as whom, and how it ended."""
    return {**argv_detail(body.cmd if isinstance(body.cmd, str) else list(body.cmd)),
            "cwd": body.cwd, "user": body.user, "env_keys": sorted(body.env), **outcome}


def _note_command(session_id: str, body: CommandRequest, outcome: dict[str, object]) -> None:
    """The ``command`` audit event of a streamed command."""
    audit_trail.note("command", "run", session_id=session_id, detail=_command_detail(body, outcome))


def _finished(status: ExecFinished | node_api.ExecStatus) -> dict[str, object]:
    return {"exit_code": status.exit_code, "signal": status.signal, "timed_out": status.timed_out,
            "duration_ms": status.duration_ms}


def _line(event: ExecOutput | ExecFinished | ExecError) -> str:
    return EXEC_EVENT.dump_json(event).decode() + "\n"


async def _stream(target: relay.SessionTarget, node_events: AsyncIterator[node_api.ExecEvent],
                  stack: AsyncExitStack, body: CommandRequest) -> AsyncIterator[str]:
    failed = False
    outcome: dict[str, object] = {"error": "stream_closed"}
    try:
        async for node_event in until_lost(node_events, also=(httpx.HTTPError,)):
            if isinstance(node_event, NodeLost):
                _note_command(target.id, body, {"error": "node_unreachable"})
                yield _line(ExecError(code="node_unreachable",
                                      detail=f"lost the node while streaming: {node_event.kind}"))
                return
            try:
                event = EXEC_EVENT.validate_python(node_event.model_dump())
            except ValidationError:
                yield _line(ExecError(code="internal_error", detail="the node sent a malformed stream event"))
                failed = True
                break
            if isinstance(event, ExecError) and event.code in relay.SANDBOX_GONE_CODES:
                # The node reports a vanished sandbox in-band once streaming has begun.
                code, detail = await relay.sandbox_lost(target, event.code, event.detail)
                event = ExecError(code=code, detail=detail)
                failed = True
            if isinstance(event, ExecFinished):
                outcome = _finished(event)
            elif isinstance(event, ExecError):
                outcome = {"error": event.code}
            yield _line(event)
        _note_command(target.id, body, outcome)
        if not failed:
            await command_finished(target.plane, target.row)
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
    target = await relay.running(plane, caller.tenant, session_id)
    node_request = _node_request(plane, body)
    if accept and _NDJSON in accept:
        events, stack = await relay.open_stream(target, lambda node, sandbox: node.exec_stream(sandbox,
                                                                                              node_request))
        return StreamingResponse(_stream(target, events, stack, body), media_type=_NDJSON,
                                 background=BackgroundTask(stack.aclose))
    ran = relay.Audit[node_api.ExecResult]("command", "run",
                                           lambda done: _command_detail(body, _finished(done)),
                                           lambda code: _command_detail(body, {"error": code}))
    result = await relay.call(target, lambda node, sandbox: node.exec(sandbox, node_request), audit=ran)
    await command_finished(plane, target.row)
    return CommandResult.model_validate(result.model_dump())


@router.get("/processes", response_model=ProcessList)
async def list_processes(session_id: str, plane: Plane, caller: Caller) -> ProcessList:
    target = await relay.running(plane, caller.tenant, session_id)
    items = await relay.call(target, lambda node, sandbox: node.list_processes(sandbox))
    return ProcessList(items=[ProcessInfo.model_validate(p.model_dump()) for p in items])


@router.get("/processes/{pid}", response_model=ProcessInfo)
async def get_process(session_id: str, pid: _Pid, plane: Plane, caller: Caller) -> ProcessInfo:
    target = await relay.running(plane, caller.tenant, session_id)
    found = await relay.call(target, lambda node, sandbox: node.get_process(sandbox, pid))
    return ProcessInfo.model_validate(found.model_dump())


@router.get("/processes/{pid}/output", response_model=ProcessOutput)
async def process_output(session_id: str, pid: _Pid, plane: Plane, caller: Caller) -> ProcessOutput:
    target = await relay.running(plane, caller.tenant, session_id)
    output = await relay.call(target, lambda node, sandbox: node.process_output(sandbox, pid))
    return ProcessOutput.model_validate(output.model_dump())


@router.post("/processes/{pid}/kill", response_model=ProcessInfo)
async def kill_process(session_id: str, pid: _Pid, plane: Plane, caller: Caller,
                       body: KillRequest | None = None) -> ProcessInfo:
    target = await relay.running(plane, caller.tenant, session_id)
    signal = (body or KillRequest()).signal
    killed = await relay.call(target, lambda node, sandbox: node.kill_process(sandbox, pid, signal),
                              audit=relay.Audit("command", "kill", lambda _: {"pid": pid, "signal": signal}))
    return ProcessInfo.model_validate(killed.model_dump())


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
