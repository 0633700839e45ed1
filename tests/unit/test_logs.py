"""One logging configuration for every process (:mod:`capsa.common.logs`): capsa's records and its
dependencies' render the same way, JSON off a terminal, with credentials blanked."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator

import pytest

from capsa.common import logs


@pytest.fixture
def restored() -> Iterator[None]:
    """The logging state :func:`logs.configure` changes, put back after the test."""
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access", *logs._QUIET]
    kept = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).level,
                   logging.getLogger(name).propagate) for name in names}
    try:
        yield
    finally:
        for name, (handlers, level, propagate) in kept.items():
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            for handler in handlers:
                logger.addHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        logging.captureWarnings(False)


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_capsa_and_dependency_records_are_one_json_object_a_line(restored: None) -> None:
    out = io.StringIO()
    logs.configure(stream=out)  # a StringIO is no terminal: JSON
    logging.getLogger("capsa.node.storage.pool").info("storage.loop_mounted", extra={"size_mib": 64})
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 42)
    first, second = _lines(out)
    assert first["event"] == "storage.loop_mounted" and first["size_mib"] == 64
    assert first["level"] == "info" and first["logger"] == "capsa.node.storage.pool"
    assert str(first["timestamp"]).endswith("Z")
    assert second["event"] == "Started server process [42]" and second["logger"] == "uvicorn.error"


def test_credentials_are_blanked_in_events_and_fields(restored: None) -> None:
    out = io.StringIO()
    logs.configure(stream=out)
    key = "csk_" + "a" * 12 + "_" + "B" * 32
    port_token = "cpt_" + "s" * 20
    logging.getLogger("uvicorn.access").info('"GET /v1/ports/x?token=%s HTTP/1.1" 200', port_token)
    logging.getLogger("capsa.x").warning("refused", extra={"url": f"http://h/?access_token={key}"})
    text = out.getvalue()
    assert port_token not in text and key not in text and text.count("[redacted]") == 2


def test_warnings_and_exceptions_are_log_lines(restored: None) -> None:
    out = io.StringIO()
    logs.configure(stream=out)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old API", DeprecationWarning, stacklevel=1)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("capsa.y").exception("failed")
    warned, failed = _lines(out)
    assert warned["logger"] == "py.warnings" and "old API" in str(warned["event"])
    assert failed["level"] == "error" and "ValueError: boom" in str(failed["exception"])


def test_a_terminal_gets_console_lines_and_reconfiguring_does_not_double(restored: None) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    logs.configure(stream=out)
    logs.configure(stream=out)
    logging.getLogger("capsa.z").info("hello", extra={"n": 1})
    (line,) = out.getvalue().splitlines()
    assert "[info" in line and "hello" in line and "n=1" in line and not line.startswith("{")
