"""Commands and processes in a sandbox: ``/exec`` (one JSON result, or the NDJSON event stream with
``Accept: application/x-ndjson``) and ``/processes``."""

from __future__ import annotations

import codecs
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from capsa.common.errors import CapsaError
from capsa.common.node_api import (
    EXEC_EVENT,
    NDJSON,
    ExecFinished,
    ExecRequest,
    ExecResult,
    ExecStatus,
    KillRequest,
    ProcessInfo,
    ProcessList,
    ProcessOutput,
    ProcessStart,
)
from capsa.common.wire.streams import OUTPUT_EVENT, ExecError, ExecOutput, OutputChunk, OutputEnd, StreamError
from capsa.guest.results import ProcessInfo as GuestProcess
from capsa.node.agent.guest import ExecChunk
from capsa.node.api.deps import Agent
from capsa.node.guestlink.client import ExecResult as GuestExec
from capsa.node.guestlink.handles.output import OutputStream, StreamEnd
from capsa.node.statuses import status_of

__all__ = ["exec_status", "output_lines", "process_info", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/sandboxes/{sandbox_id}", tags=["commands"])


def _text(value: bytes) -> str:
    return value.decode("utf-8", errors="replace")


def exec_status(res: GuestExec) -> ExecStatus:
    return ExecStatus(exit_code=res.exit_code, signal=res.signal, stdout_truncated=res.stdout_truncated,
                      stderr_truncated=res.stderr_truncated, timed_out=res.timed_out,
                      duration_ms=round(res.duration * 1000, 3), oom_killed=res.oom_killed)


def process_info(info: GuestProcess) -> ProcessInfo:
    cmd = info.cmd
    return ProcessInfo(pid=info.pid, cmd=[cmd] if isinstance(cmd, str) else list(cmd), running=info.running,
                       exit_code=info.exit_code, signal=info.signal,
                       started_at=datetime.fromtimestamp(info.started_at, UTC).isoformat(),
                       stdin_open=info.stdin_open)


@router.post("/exec", response_model=ExecResult,
             responses={200: {"content": {NDJSON: {"schema": {"$ref": "#/components/schemas/ExecEvent"}}},
                              "description": "ExecResult, or one ExecEvent per line with "
                                             "Accept: application/x-ndjson"}})
async def exec_command(agent: Agent, sandbox_id: str, body: ExecRequest,
                       accept: Annotated[str | None, Header()] = None) -> ExecResult | StreamingResponse:
    stdin = body.stdin.encode() if body.stdin is not None else None
    guest = agent.guest(sandbox_id)
    if accept and NDJSON in accept:
        events = guest.exec_stream(body.cmd, env=body.env, cwd=body.cwd, user=body.user, stdin=stdin,
                                   timeout=body.timeout, max_output=body.max_output)
        return StreamingResponse(_lines(events), media_type=NDJSON)
    res = await guest.exec(body.cmd, env=body.env, cwd=body.cwd, user=body.user, stdin=stdin,
                           timeout=body.timeout, max_output=body.max_output)
    return ExecResult(**exec_status(res).model_dump(), stdout=_text(res.stdout), stderr=_text(res.stderr))


async def _lines(events: AsyncGenerator[ExecChunk | GuestExec, None]) -> AsyncIterator[bytes]:
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
                if isinstance(event, GuestExec):
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
    guest = agent.guest(sandbox_id)
    return process_info(await guest.start_process(body.cmd, env=body.env, cwd=body.cwd, user=body.user,
                                                  stdin=body.open_stdin))


@router.get("/processes", response_model=ProcessList)
async def list_processes(agent: Agent, sandbox_id: str) -> ProcessList:
    return ProcessList(items=[process_info(p) for p in await agent.guest(sandbox_id).list_processes()])


@router.get("/processes/{pid}", response_model=ProcessInfo)
async def get_process(agent: Agent, sandbox_id: str, pid: int) -> ProcessInfo:
    return process_info(await agent.guest(sandbox_id).get_process(pid))


@router.get("/processes/{pid}/output", response_model=ProcessOutput)
async def process_output(agent: Agent, sandbox_id: str, pid: int) -> ProcessOutput:
    out = await agent.guest(sandbox_id).process_output(pid)
    return ProcessOutput(stdout=_text(out.stdout), stderr=_text(out.stderr), running=out.running,
                         exit_code=out.exit_code, signal=out.signal, stdout_truncated=out.stdout_truncated,
                         stderr_truncated=out.stderr_truncated)


MAX_STDIN_WRITE = 16 << 20
"""Bytes one ``/stdin`` request may carry."""


@router.post("/processes/{pid}/stdin", response_model=ProcessInfo,
             openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}})
async def send_stdin(agent: Agent, sandbox_id: str, pid: int, request: Request) -> ProcessInfo:
    """Write the request body (raw bytes) to the process's stdin (409 ``stdin_closed``/``process_exited``)."""
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_STDIN_WRITE:
            raise CapsaError(f"at most {MAX_STDIN_WRITE} bytes per stdin write", code="too_large", status=413)
    return process_info(await agent.guest(sandbox_id).send_stdin(pid, bytes(data)))


@router.post("/processes/{pid}/stdin/close", response_model=ProcessInfo)
async def close_stdin(agent: Agent, sandbox_id: str, pid: int) -> ProcessInfo:
    return process_info(await agent.guest(sandbox_id).close_stdin(pid))


@router.get("/processes/{pid}/stream", response_class=StreamingResponse,
            responses={200: {"content": {NDJSON: {}}, "description": "OutputEvent lines"}})
async def stream_process(agent: Agent, sandbox_id: str, pid: int,
                         stdout_from: Annotated[int, Query(ge=0)] = 0,
                         stderr_from: Annotated[int, Query(ge=0)] = 0) -> StreamingResponse:
    """The process's output from the offsets until it exits (see :class:`capsa.common.node_api.OutputChunk`).
    """
    output = await agent.guest(sandbox_id).stream_process(pid, stdout_from=stdout_from,
                                                          stderr_from=stderr_from)
    return StreamingResponse(output_lines(output, {"stdout": stdout_from, "stderr": stderr_from}),
                             media_type=NDJSON)


async def output_lines(output: OutputStream, start: dict[str, int]) -> AsyncIterator[bytes]:
    """NDJSON :data:`OutputEvent` lines. Text is cut only at whole UTF-8 characters, so every line's
    ``offset`` is a byte offset a client may resume from. Closing this (the client left) ends the stream."""
    decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace")
                for name in ("stdout", "stderr")}
    fed = dict(start)

    def line(event: OutputChunk | OutputEnd | StreamError) -> bytes:
        return OUTPUT_EVENT.dump_json(event) + b"\n"

    chunks = output.chunks()
    try:
        async for item in chunks:
            if isinstance(item, StreamEnd):
                info = item.info
                yield line(OutputEnd(exit_code=info.exit_code, signal=info.signal, stdout_end=item.stdout_end,
                                     stderr_end=item.stderr_end))
                return
            name: Literal["stdout", "stderr"] = "stdout" if item.ch == "stdout" else "stderr"
            decoder = decoders[name]
            lost = max(0, item.offset - fed[name])
            if lost:
                decoder.reset()  # bytes are missing: a character cut there cannot be completed
            fed[name] = item.offset + len(item.data)
            text = decoder.decode(item.data)
            held = len(decoder.getstate()[0])
            if text or lost:
                yield line(OutputChunk(ch=name, data=text, offset=fed[name] - held, lost=lost))
    except CapsaError as exc:
        yield line(StreamError(code=exc.code, detail=exc.message))
    except Exception:
        log.exception("process stream failed")
        yield line(StreamError(code="internal_error", detail="internal error"))
    finally:
        await chunks.aclose()
        await output.close()


@router.post("/processes/{pid}/kill", response_model=ProcessInfo)
async def kill_process(agent: Agent, sandbox_id: str, pid: int, body: KillRequest) -> ProcessInfo:
    return process_info(await agent.guest(sandbox_id).kill_process(pid, body.signal))
