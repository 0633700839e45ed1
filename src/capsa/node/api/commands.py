"""Commands and processes in a sandbox: ``/exec`` (one JSON result, or the NDJSON event stream with
``Accept: application/x-ndjson``) and ``/processes``."""

from __future__ import annotations

import codecs
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Header
from fastapi.responses import StreamingResponse

from capsa.common.errors import CapsaError
from capsa.common.node_api import (
    EXEC_EVENT,
    NDJSON,
    ExecError,
    ExecFinished,
    ExecOutput,
    ExecRequest,
    ExecResult,
    ExecStatus,
    KillRequest,
    ProcessInfo,
    ProcessList,
    ProcessOutput,
    ProcessStart,
)
from capsa.node import guest_client as guest
from capsa.node.agent import ExecChunk
from capsa.node.api.deps import Agent
from capsa.node.api.errors import status_of

__all__ = ["exec_status", "process_info", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/sandboxes/{sandbox_id}", tags=["commands"])


def _text(value: bytes) -> str:
    return value.decode("utf-8", errors="replace")


def exec_status(res: guest.ExecResult) -> ExecStatus:
    return ExecStatus(exit_code=res.exit_code, signal=res.signal, stdout_truncated=res.stdout_truncated,
                      stderr_truncated=res.stderr_truncated, timed_out=res.timed_out,
                      duration_ms=round(res.duration * 1000, 3), oom_killed=res.oom_killed)


def process_info(info: guest.ProcessInfo) -> ProcessInfo:
    cmd = info.cmd
    return ProcessInfo(pid=info.pid, cmd=[cmd] if isinstance(cmd, str) else list(cmd), running=info.running,
                       exit_code=info.exit_code, signal=info.signal,
                       started_at=datetime.fromtimestamp(info.started_at, UTC).isoformat())


@router.post("/exec", response_model=ExecResult,
             responses={200: {"content": {NDJSON: {"schema": {"$ref": "#/components/schemas/ExecEvent"}}},
                              "description": "ExecResult, or one ExecEvent per line with "
                                             "Accept: application/x-ndjson"}})
async def exec_command(agent: Agent, sandbox_id: str, body: ExecRequest,
                       accept: Annotated[str | None, Header()] = None) -> ExecResult | StreamingResponse:
    stdin = body.stdin.encode() if body.stdin is not None else None
    if accept and NDJSON in accept:
        events = agent.exec_stream(sandbox_id, body.cmd, env=body.env, cwd=body.cwd, user=body.user,
                                   stdin=stdin, timeout=body.timeout, max_output=body.max_output)
        return StreamingResponse(_lines(events), media_type=NDJSON)
    res = await agent.exec(sandbox_id, body.cmd, env=body.env, cwd=body.cwd, user=body.user, stdin=stdin,
                           timeout=body.timeout, max_output=body.max_output)
    return ExecResult(**exec_status(res).model_dump(), stdout=_text(res.stdout), stderr=_text(res.stderr))


async def _lines(events: AsyncGenerator[ExecChunk | guest.ExecResult, None]) -> AsyncIterator[bytes]:
    """The agent's events as NDJSON; closing this (the client went away) kills the command."""
    decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace")
                for name in ("stdout", "stderr")}

    def line(event: ExecOutput | ExecFinished | ExecError) -> bytes:
        return EXEC_EVENT.dump_json(event) + b"\n"

    def flush(name: Literal["stdout", "stderr"]) -> bytes:
        text = decoders[name].decode(b"", True)
        return line(ExecOutput(type=name, data=text)) if text else b""

    async with contextlib.aclosing(events):
        try:
            async for event in events:
                if isinstance(event, guest.ExecResult):
                    yield flush("stdout") + flush("stderr")
                    yield line(ExecFinished(**exec_status(event).model_dump()))
                    return
                name, data = event
                text = decoders[name].decode(data)
                if text:
                    yield line(ExecOutput(type=name, data=text))
        except CapsaError as exc:
            log.debug("exec stream failed (%d %s): %s", status_of(exc), exc.code, exc.message)
            yield line(ExecError(code=exc.code, detail=exc.message))
        except Exception:
            log.exception("exec stream failed")
            yield line(ExecError(code="internal_error", detail="internal error"))


@router.post("/processes", response_model=ProcessInfo)
async def start_process(agent: Agent, sandbox_id: str, body: ProcessStart) -> ProcessInfo:
    return process_info(await agent.start_process(sandbox_id, body.cmd, env=body.env, cwd=body.cwd,
                                                  user=body.user))


@router.get("/processes", response_model=ProcessList)
async def list_processes(agent: Agent, sandbox_id: str) -> ProcessList:
    return ProcessList(items=[process_info(p) for p in await agent.list_processes(sandbox_id)])


@router.get("/processes/{pid}", response_model=ProcessInfo)
async def get_process(agent: Agent, sandbox_id: str, pid: int) -> ProcessInfo:
    return process_info(await agent.get_process(sandbox_id, pid))


@router.get("/processes/{pid}/output", response_model=ProcessOutput)
async def process_output(agent: Agent, sandbox_id: str, pid: int) -> ProcessOutput:
    out = await agent.process_output(sandbox_id, pid)
    return ProcessOutput(stdout=_text(out.stdout), stderr=_text(out.stderr), running=out.running,
                         exit_code=out.exit_code, signal=out.signal, stdout_truncated=out.stdout_truncated,
                         stderr_truncated=out.stderr_truncated)


@router.post("/processes/{pid}/kill", response_model=ProcessInfo)
async def kill_process(agent: Agent, sandbox_id: str, pid: int, body: KillRequest) -> ProcessInfo:
    return process_info(await agent.kill_process(sandbox_id, pid, body.signal))
