"""Shared CLI plumbing: connection options, ``--json`` output, rich tables and one-line errors."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import click
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from capsa.sdk import CapsaClientError, Client

__all__ = [
    "ApiOptions",
    "api_options",
    "emit_items",
    "emit_json",
    "emit_made",
    "emit_result",
    "fail",
    "human_time",
    "json_api_options",
    "json_option",
    "listing_command",
    "print_table",
    "reports_errors",
    "stderr_console",
    "stdout_console",
]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

stdout_console = Console(soft_wrap=True)
stderr_console = Console(stderr=True, soft_wrap=True)


class ApiOptions:
    """Where to reach the API, collected from ``--api-url``/``--api-key`` or the environment."""

    def __init__(self, api_url: str | None, api_key: str | None) -> None:
        self.api_url = api_url
        self.api_key = api_key

    def client(self) -> Client:
        return Client(self.api_url, self.api_key)

    def call(self, call: Callable[[Client], T]) -> T:
        """``call(client)`` with a client that is closed again after it; an SDK failure ends the command
        as :func:`reports_errors` says."""
        with reports_errors(), self.client() as client:
            return call(client)


def api_options(func: F) -> F:
    """Add ``--api-url`` and ``--api-key`` (also read from CAPSA_API_URL / CAPSA_API_KEY) as ``api``."""

    @click.option("--api-key", envvar="CAPSA_API_KEY", default=None, show_envvar=True,
                  help="API key (csk_…).")
    @click.option("--api-url", envvar="CAPSA_API_URL", default=None, show_envvar=True, metavar="URL",
                  help="capsa API base URL [default: http://127.0.0.1:8700].")
    @functools.wraps(func)
    def wrapper(*args: Any, api_url: str | None, api_key: str | None, **kwargs: Any) -> Any:
        return func(*args, api=ApiOptions(api_url, api_key), **kwargs)

    return wrapper  # type: ignore[return-value]


def json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")(func)


def json_api_options(func: F) -> F:
    """``--json`` (as ``as_json``) and then the API options (as ``api``): a command that calls the API and
    can answer in JSON."""
    return json_option(api_options(func))


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def emit_json(value: Any) -> None:
    click.echo(json.dumps(_jsonable(value), indent=2, sort_keys=False))


def emit_items(items: Sequence[T], as_json: bool, columns: Sequence[str],
               row: Callable[[T], Sequence[str]]) -> None:
    """A listing: ``{"items": [...]}`` with ``--json``, else a table of one ``row(item)`` per item."""
    if as_json:
        emit_json({"items": items})
    else:
        print_table(columns, [row(item) for item in items])


def listing_command(group: click.Group, doc: str, fetch: Callable[[Client], Sequence[T]],
                    columns: Sequence[str], row: Callable[[T], Sequence[str]], *, name: str = "ls"
                    ) -> click.Command:
    """Add to ``group`` the command ``name`` (``--json`` and the API options; ``doc`` its help) that lists
    what ``fetch(client)`` answers as :func:`emit_items` does."""

    @json_api_options
    def command(as_json: bool, api: ApiOptions) -> None:
        emit_items(api.call(fetch), as_json, columns, row)

    command.__doc__ = doc
    return group.command(name)(command)


def emit_made(made: Any, as_json: bool, value: str | None, note: str) -> None:
    """What a command made: ``made`` as JSON with ``--json``; else ``value`` alone on stdout (so
    ``X=$(capsa ...)`` works) and ``note``, for people, on stderr."""
    if as_json:
        emit_json(made)
    else:
        click.echo(value)
        click.echo(note, err=True)


def emit_result(result: Any, as_json: bool, line: str) -> None:
    """What a command did: ``result`` as JSON with ``--json``, else ``line`` (for people) on stdout."""
    if as_json:
        emit_json(result)
    else:
        click.echo(line)


def human_time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone().strftime("%Y-%m-%d %H:%M")


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None) -> None:
    table = Table(title=title, header_style="bold", box=None, pad_edge=False)
    for i, name in enumerate(columns):
        # The first column is an id people copy and paste: never fold it.
        table.add_column(name, no_wrap=i == 0, overflow="fold")
    for row in rows:
        table.add_row(*row)
    # Piped output is not limited to 80 columns; rows must stay one line each for grep/awk.
    console = stdout_console if sys.stdout.isatty() else Console(file=sys.stdout, width=400)
    console.print(table)


def fail(message: str, code: int = 1) -> None:
    """Print ``error: message`` on one line to stderr and exit with ``code``."""
    # Plain text (no rich markup) so a detail containing brackets is printed as it is.
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@contextmanager
def reports_errors(exit_code: int = 1) -> Iterator[None]:
    """Turn SDK failures into one-line messages and a non-zero exit instead of tracebacks."""
    try:
        yield
    except CapsaClientError as exc:  # API errors print as "<code>: <detail>", connection errors as a sentence
        fail(str(exc), exit_code)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        fail(str(exc), exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (`capsa run -- seq 1 1000000 | head -1`): stop quietly, like other tools
        # killed by SIGPIPE, and keep Python from complaining when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)
