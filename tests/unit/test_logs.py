"""One logging configuration for every process (:mod:`capsa.common.logs`): capsa's records and its
dependencies' render the same way, JSON off a terminal, with credentials blanked."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterator

import pytest
import uvicorn

from capsa.common import logs
from capsa.common.service import QuietServer
from tests.support import logs as support_logs
from tests.support.logs import json_lines


@pytest.fixture
def restored() -> Iterator[None]:
    """The logging state :func:`logs.configure` changes, put back after the test."""
    with support_logs.restored():
        yield


def test_capsa_and_dependency_records_are_one_json_object_a_line(restored: None) -> None:
    out = io.StringIO()
    logs.configure(stream=out)  # a StringIO is no terminal: JSON
    logging.getLogger("capsa.node.storage.pool").info("storage.loop_mounted", extra={"size_mib": 64})
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 42)
    first, second = json_lines(out)
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
    warned, failed = json_lines(out)
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


# --- Credentials in uvicorn's request lines (capsa's servers pass log_config=None: these reach configure) ---


def _access_line(path: str) -> str:
    out = io.StringIO()
    logs.configure(stream=out)
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", path, "1.1",
                                             200)
    (line,) = json_lines(out)
    return str(line["event"])


def test_token_query_values_are_redacted_and_the_rest_kept(restored: None) -> None:
    line = _access_line("/v1/sessions/ses_1/ports/8000/index.html?x=1&token=cpt_secretvalue&y=2")
    assert "cpt_secretvalue" not in line
    assert "token=[redacted]" in line and "x=1" in line and "y=2" in line
    assert "cpt_other" not in _access_line("/p?Access_Token=cpt_other")
    assert _access_line("/plain/path?tokens=keep").endswith('?tokens=keep HTTP/1.1" 200')


def test_url_encoded_tokens_and_keys_anywhere_are_redacted(restored: None) -> None:
    port_token, key = "cpt_" + "s" * 20, "csk_" + "k" * 12 + "_" + "K" * 32
    novnc = _access_line(f"/vnc.html?autoconnect=true&path=v1%2Fws%3Ftoken%3D{port_token}")
    assert port_token not in novnc and "path=v1%2Fws%3Ftoken%3D[redacted]" in novnc
    anywhere = _access_line(f"/x/{key}/y")
    assert key not in anywhere and "/x/[redacted]" in anywhere


def test_a_placeholder_after_token_keeps_its_argument(restored: None) -> None:
    out = io.StringIO()
    logs.configure(stream=out)
    logging.getLogger("uvicorn.access").info('"GET /p?token=%s HTTP/1.1" %d', "cpt_" + "s" * 20, 200)
    (line,) = json_lines(out)
    assert line["event"] == '"GET /p?token=[redacted] HTTP/1.1" 200'


def test_a_server_config_made_after_configure_keeps_one_redacting_handler(restored: None) -> None:
    out = io.StringIO()
    logs.configure(stream=out)
    app = lambda scope, receive, send: None  # noqa: E731 - never called
    QuietServer(uvicorn.Config(app, log_level="info", log_config=None))
    QuietServer(uvicorn.Config(app, log_level="info", log_config=None))
    logging.getLogger("uvicorn.error").info('"WebSocket /ws?token=%s" [accepted]', "cpt_" + "w" * 20)
    (line,) = json_lines(out)
    assert line["event"] == '"WebSocket /ws?token=[redacted]" [accepted]'


def test_uvicorn_colour_copy_of_a_line_is_dropped(restored: None) -> None:
    out = io.StringIO()
    logs.configure(stream=out)
    coloured = "Started server process [\x1b[36m%d\x1b[0m]"
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 7,
                                            extra={"color_message": coloured})
    (line,) = json_lines(out)
    assert line["event"] == "Started server process [7]" and "color_message" not in line
