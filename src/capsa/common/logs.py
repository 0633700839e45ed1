"""One way every capsa process logs.

capsa's modules log through the standard library's :mod:`logging` (``log = logging.getLogger(__name__)``), the
API its dependencies (uvicorn, qemu.qmp, httpx, SQLAlchemy) log through too, so one configuration covers them
all. :func:`configure`, called once by each process's entry point, renders every record, capsa's and the
dependencies', through structlog's processor chain: one JSON object a line when stderr is not a terminal
(systemd's journal, Kubernetes, a CI log), aligned ``time level logger event key=value`` lines when it is.
Structured fields go in ``extra=``; they become the JSON object's keys. Credentials in URLs are blanked
(:func:`redact`) in the rendered event and every string field: uvicorn's request lines (``uvicorn.access`` for
HTTP, ``uvicorn.error`` for WebSocket handshakes such as ``"WebSocket /v1/…?token=…" [accepted]``) reach the
same handler, since capsa's servers pass ``log_config=None`` to ``uvicorn.Config``.

**Request context.** Fields bound with structlog's context variables (:func:`log_scope`, :func:`bind`) go on
every line logged meanwhile in that task (and the threads and tasks it starts), capsa's and the
dependencies': the control plane binds ``request_id`` per API request and ``session_id`` where it looks the
session up; the node binds the ``request_id`` and ``session_id`` the control plane sends with each call
(:data:`REQUEST_ID_HEADER`, :data:`SESSION_ID_HEADER`) and the ``sandbox_id`` of its sandbox routes.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, TextIO

import structlog
from structlog.typing import Processor

__all__ = ["REQUEST_ID_HEADER", "SESSION_ID_HEADER", "bind", "configure", "context_value", "header_id",
           "log_scope", "redact", "renders_json"]

REQUEST_ID_HEADER = "X-Request-Id"
"""The API request's id: on every control-plane answer, and on the node calls made for the request."""
SESSION_ID_HEADER = "X-Capsa-Session-Id"
"""The session a node call is made for (sent by the control plane once it looked the session up)."""

_HEADER_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_scoped: contextvars.ContextVar[bool] = contextvars.ContextVar("capsa_log_scope", default=False)

_QUIET = {  # dependencies whose INFO lines are chatter rather than events
    "asyncio": logging.WARNING,
    "httpx": logging.WARNING,
    "httpcore": logging.WARNING,
    "qemu": logging.CRITICAL,  # QMP's own notes about sockets closing under a VM that exits
    "sqlalchemy": logging.WARNING,
    "aiosqlite": logging.WARNING,
    "mcp": logging.WARNING,  # the MCP server's "Processing request of type ..." for every call
    "alembic": logging.WARNING,  # its plugin set-up and one line per migration step at every start
}

_CREDENTIAL = re.compile(
    r"((?:^|[?&;/\s\"']|%2[6fF]|%3[fF])(?:token|access_token)(?:=|%3[dD]))[^&#\s\"';]*"  # token=, token%3D
    r"|c(?:pt|sk)_[A-Za-z0-9_%-]{16,}",  # a port token or an API key anywhere (noVNC's path=, a Referer)
    re.IGNORECASE)


_SERVER_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
"""Configured by ``uvicorn.Config`` unless its ``log_config`` is None (capsa's servers pass None)."""


def redact(text: str) -> str:
    """``text`` with credentials carried in URLs blanked: ``token=`` / ``access_token=`` values, also
    URL-encoded inside another parameter (noVNC's ``path=…%3Ftoken%3D…``), and any port token (``cpt_…``)
    or API key (``csk_…``)."""
    return _CREDENTIAL.sub(lambda m: (m[1] or "") + "[redacted]", text)


def header_id(value: str | None) -> str | None:
    """``value`` (an id from a request header) when it is a plausible id (at most 64 characters of
    ``[A-Za-z0-9_.:-]``), else None: whatever a header carries must not forge log fields or lines."""
    return value if value is not None and _HEADER_ID.fullmatch(value) else None


@contextlib.contextmanager
def log_scope(**fields: object) -> Iterator[None]:
    """Bind ``fields`` to every line logged inside; on exit every binding made inside (also by deeper
    code with :func:`bind`) is undone, so a request's fields end with the request even when the caller's
    task goes on (an in-process node called through ``httpx.ASGITransport``). None values are left out."""
    before = structlog.contextvars.get_contextvars()
    scoped = _scoped.set(True)
    bind(**fields)
    try:
        yield
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**before)
        _scoped.reset(scoped)


def bind(**fields: object) -> None:
    """Bind ``fields`` (None values left out) until the enclosing :func:`log_scope` ends; outside one (a
    background loop going from session to session) nothing is bound, since nothing would unbind it."""
    present = {k: v for k, v in fields.items() if v is not None}
    if present and _scoped.get():
        structlog.contextvars.bind_contextvars(**present)


def context_value(name: str) -> object | None:
    """The value bound to ``name`` in this context (None: unbound)."""
    return structlog.contextvars.get_contextvars().get(name)


def _drop_color_message(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
    event.pop("color_message", None)  # uvicorn's copy of its message with terminal colour codes
    return event


def _redact_fields(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = redact(value)
    return event


def renders_json(stream: TextIO) -> bool:
    """Whether :func:`configure` renders JSON for ``stream``: when it is not a terminal."""
    isatty = getattr(stream, "isatty", None)
    return not (callable(isatty) and isatty())


def configure(*, level: int = logging.INFO, json: bool | None = None, stream: TextIO | None = None) -> None:
    """Send every log record of this process to ``stream`` (stderr: stdout carries results scripts parse),
    rendered as JSON when ``json`` (default: when the stream is not a terminal). Replaces the root logger's
    handlers, so calling it again reconfigures rather than doubles the output."""
    out = stream if stream is not None else sys.stderr
    as_json = renders_json(out) if json is None else json
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        _drop_color_message,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Processor = (structlog.processors.JSONRenderer() if as_json
                           else structlog.dev.ConsoleRenderer(colors=False))
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *([structlog.processors.format_exc_info] if as_json else []),
                    _redact_fields, renderer])
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name, floor in _QUIET.items():
        logging.getLogger(name).setLevel(max(floor, level))
    for name in _SERVER_LOGGERS:  # uvicorn.Config gave them handlers and levels of their own: ours instead
        server = logging.getLogger(name)
        for old in list(server.handlers):
            server.removeHandler(old)
        server.propagate = True
        server.setLevel(logging.NOTSET)
    logging.captureWarnings(True)  # a dependency's DeprecationWarning is a log line too, not a bare print
