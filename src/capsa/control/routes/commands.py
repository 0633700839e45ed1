"""``/v1/sessions/{id}/commands`` and ``/processes``: run commands (JSON or NDJSON stream), background
processes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Header, Path
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from capsa.control import ratelimit
from capsa.control.deps import PROBLEMS, Caller, Plane
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

__all__ = ["router"]

router = APIRouter(prefix="/sessions/{session_id}", tags=["commands"], responses=PROBLEMS)

_NDJSON = "application/x-ndjson"
_Pid = Annotated[int, Path(ge=1, le=1 << 22)]


def _node_body(plane: ControlPlane, body: CommandRequest) -> dict[str, Any]:
    return {"cmd": body.cmd, "env": body.env, "cwd": body.cwd, "user": body.user, "stdin": body.stdin,
            "timeout": body.timeout if body.timeout is not None else plane.settings.default_command_timeout}


def _error_line(code: str, detail: str) -> str:
    return json.dumps({"type": "error", "code": code, "detail": detail}) + "\n"


async def _stream(plane: ControlPlane, row: SessionRow, lines: AsyncIterator[str],
                  stack: AsyncExitStack) -> AsyncIterator[str]:
    failed = False
    try:
        async for line in lines:
            if not line:
                continue
            if '"error"' in line:
                # The node reports a vanished sandbox in-band once streaming has begun.
                try:
                    event = json.loads(line)
                except ValueError:
                    event = {}
                if event.get("type") == "error" and event.get("code") in SANDBOX_GONE_CODES:
                    state = await lose_sandbox(plane, row.id, str(event.get("detail") or event["code"]),
                                               row.sandbox_id)
                    line = _error_line("session_failed" if state == "failed" else "invalid_state",
                                       f"session {row.id} lost its sandbox ({state}): {event.get('detail')}")
                    failed = True
            yield line if line.endswith("\n") else line + "\n"
        if not failed:
            await command_finished(plane, row.id)
    except (NodeError, httpx.HTTPError) as exc:
        yield _error_line("node_unreachable", f"lost the node while streaming: {type(exc).__name__}")
    finally:
        await stack.aclose()


@router.post("/commands", response_model=CommandResult,
             responses={200: {"content": {_NDJSON: {}},
                              "description": "CommandResult, or NDJSON events with "
                                             "Accept: application/x-ndjson"},
                        201: {"model": ProcessInfo, "description": "background process started"}})
async def run_command(session_id: str, body: CommandRequest, plane: Plane, caller: Caller,
                      accept: Annotated[str | None, Header()] = None) -> Any:
    async with plane.db() as db:
        await ratelimit.hit(db, caller.key_id, "commands", plane.settings.command_limit,
                            plane.settings.rate_window_seconds)
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    node_body = _node_body(plane, body)
    if body.background:
        node_body.pop("stdin")
        node_body.pop("timeout")
        try:
            process = await client.start_process(row.sandbox_id, node_body)
        except NodeError as exc:
            raise await node_call_failed(plane, row, exc) from exc
        return JSONResponse(ProcessInfo.model_validate(process).model_dump(mode="json"), status_code=201)
    if accept and _NDJSON in accept:
        stack = AsyncExitStack()
        try:
            lines = await stack.enter_async_context(client.exec_stream(row.sandbox_id, node_body))
        except NodeError as exc:
            await stack.aclose()
            raise await node_call_failed(plane, row, exc) from exc
        except BaseException:
            await stack.aclose()
            raise
        return StreamingResponse(_stream(plane, row, lines, stack), media_type=_NDJSON,
                                 background=BackgroundTask(stack.aclose))
    try:
        result = await client.exec(row.sandbox_id, node_body)
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc
    await command_finished(plane, row.id)
    return CommandResult.model_validate(result)


@router.get("/processes", response_model=ProcessList)
async def list_processes(session_id: str, plane: Plane, caller: Caller) -> ProcessList:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        items = await client.list_processes(row.sandbox_id)
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc
    return ProcessList(items=[ProcessInfo.model_validate(p) for p in items])


@router.get("/processes/{pid}", response_model=ProcessInfo)
async def get_process(session_id: str, pid: _Pid, plane: Plane, caller: Caller) -> ProcessInfo:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        return ProcessInfo.model_validate(await client.get_process(row.sandbox_id, pid))
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc


@router.get("/processes/{pid}/output", response_model=ProcessOutput)
async def process_output(session_id: str, pid: _Pid, plane: Plane, caller: Caller) -> ProcessOutput:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        return ProcessOutput.model_validate(await client.process_output(row.sandbox_id, pid))
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc


@router.post("/processes/{pid}/kill", response_model=ProcessInfo)
async def kill_process(session_id: str, pid: _Pid, plane: Plane, caller: Caller,
                       body: KillRequest | None = None) -> ProcessInfo:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        return ProcessInfo.model_validate(
            await client.kill_process(row.sandbox_id, pid, (body or KillRequest()).signal))
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc


