"""The process's logging as :func:`capsa.common.logs.configure` sets it, for one test: rendered into a
``StringIO`` (no terminal: one JSON object a line), and put back as it was afterwards."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator
from typing import TextIO

from capsa.common import logs

__all__ = ["configured", "json_lines", "restored"]


@contextlib.contextmanager
def restored() -> Iterator[None]:
    """The logging state :func:`logs.configure` changes, put back on exit."""
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


@contextlib.contextmanager
def configured(stream: TextIO | None = None) -> Iterator[TextIO]:
    """:func:`logs.configure` rendering to ``stream`` (a new ``StringIO`` by default), undone on exit."""
    out = stream if stream is not None else io.StringIO()
    with restored():
        logs.configure(stream=out)
        yield out


def json_lines(stream: io.StringIO) -> list[dict[str, object]]:
    """The JSON objects rendered into ``stream``, one a line."""
    return [json.loads(line) for line in stream.getvalue().splitlines()]
