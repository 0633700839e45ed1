"""Access log lines of capsa's servers never carry a port token given in a URL."""

from __future__ import annotations

import logging

import uvicorn

from capsa.common.service import QuietServer, RedactTokens


def _line(path: str) -> str:
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", path, "1.1", 200), None)
    assert RedactTokens().filter(record)
    return record.getMessage()


def test_token_query_values_are_redacted_and_the_rest_kept() -> None:
    line = _line("/v1/sessions/ses_1/ports/8000/index.html?x=1&token=cpt_secretvalue&y=2")
    assert "cpt_secretvalue" not in line
    assert "token=[redacted]" in line and "x=1" in line and "y=2" in line
    assert "cpt_other" not in _line("/p?Access_Token=cpt_other")
    assert _line("/plain/path?tokens=keep").endswith('?tokens=keep HTTP/1.1" 200')


def test_a_placeholder_after_token_keeps_its_argument() -> None:
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '"GET /p?token=%s HTTP/1.1" %d',
                               ("cpt_" + "s" * 20, 200), None)
    assert RedactTokens().filter(record)
    assert record.getMessage() == '"GET /p?token=[redacted] HTTP/1.1" 200'


def test_quiet_servers_install_the_filter_once() -> None:
    app = lambda scope, receive, send: None  # noqa: E731 - never called
    QuietServer(uvicorn.Config(app))
    QuietServer(uvicorn.Config(app))
    filters = [f for f in logging.getLogger("uvicorn.access").filters if isinstance(f, RedactTokens)]
    assert len(filters) == 1
