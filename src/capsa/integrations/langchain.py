"""A LangChain deepagents sandbox backend on a capsa session (``pip install 'capsa[langchain]'``).

:class:`CapsaSandbox` is a ``deepagents.backends.sandbox.BaseSandbox``: it supplies the four operations
that class leaves to providers (``execute``, ``upload_files``, ``download_files``, ``id``) and inherits
the file tools built on them (``ls``, ``read``, ``write``, ``edit``, ``grep``, ``glob``, ``delete``, which
run small ``python3`` scripts in the guest through ``execute``).

The async twins (``aexecute``, ``aupload_files``, ``adownload_files``) are the implementation; the
blocking methods run them on the SDK's loop thread, where the wrapped :class:`capsa.sdk.Session` lives.

Conventions of the protocol that this backend keeps:

- ``execute`` returns the command's stdout and stderr as one interleaved text (the command's stderr is
  redirected to its stdout in the guest), its exit code, and ``truncated`` when capsa cut the output at
  the server's output limit. A command past its timeout answers exit code 124 with a note saying so; one
  killed by a signal answers 128 + the signal. A failure to run the command at all (session closed,
  server unreachable) is not raised: it answers ``exit_code=None`` and an ``Error: <code>: <detail>`` line.
- ``upload_files``/``download_files`` never raise for one file: each answer carries its own error
  (``file_not_found``, ``permission_denied``, ``is_directory``, ``invalid_path``, or capsa's error code).
"""

# deepagents names the parameter `timeout`; it is the command's remote deadline, not an asyncio timeout.
# ruff: noqa: ASYNC109

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

try:
    from deepagents.backends.protocol import (
        ExecuteResponse,
        FileDownloadResponse,
        FileOperationError,
        FileUploadResponse,
    )
    from deepagents.backends.sandbox import BaseSandbox
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("capsa.integrations.langchain needs deepagents: "
                      "pip install 'capsa[langchain]'") from exc

from capsa.sdk import AsyncSession, CapsaAPIError, CapsaClientError, Session
from capsa.sdk.portal import Portal, get_portal

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_EXIT_CODE", "CapsaSandbox"]

T = TypeVar("T")

DEFAULT_TIMEOUT = 30 * 60
"""Seconds a command may run when ``execute`` is given no timeout."""
TIMEOUT_EXIT_CODE = 124
"""The exit code ``execute`` answers for a command stopped at its timeout (as ``timeout(1)`` does)."""
_MAX_TIMEOUT = 86400  # the API's upper bound; ``timeout=0`` ("no timeout" in the protocol) asks for it

# capsa error codes (guest and API) -> the protocol's standard per-file errors.
_FILE_ERRORS: dict[str, FileOperationError] = {
    "not_found": "file_not_found",
    "not_a_directory": "file_not_found",
    "permission_denied": "permission_denied",
    "is_a_directory": "is_directory",
    "validation_error": "invalid_path",
    "bad_request": "invalid_path",
}


def _file_error(exc: CapsaClientError) -> FileOperationError | str:
    if isinstance(exc, CapsaAPIError):
        return _FILE_ERRORS.get(exc.code, exc.code)
    return str(exc)


def _valid_path(path: str) -> bool:
    return path.startswith("/") and "\x00" not in path


class CapsaSandbox(BaseSandbox):
    """A deepagents sandbox backend running everything in one capsa session.

    ``CapsaSandbox(session)`` wraps a :class:`capsa.sdk.Session` the caller keeps (and closes);
    :meth:`create` (:meth:`acreate` in async code) starts a session that :meth:`close` (:meth:`aclose`, or
    ``with`` / ``async with``) closes.
    """

    def __init__(self, session: Session, *, default_timeout: int = DEFAULT_TIMEOUT,
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 owns_session: bool = False) -> None:
        if default_timeout <= 0:
            raise ValueError("default_timeout must be positive")
        self._session = session
        self._portal: Portal = get_portal()
        self._default_timeout = default_timeout
        self._env = dict(env or {})
        self._cwd = cwd
        self._owns_session = owns_session

    @classmethod
    def create(cls, template: str = "base", *, api_url: str | None = None, api_key: str | None = None,
               default_timeout: int = DEFAULT_TIMEOUT, cwd: str | None = None,
               **session_options: Any) -> CapsaSandbox:
        """Start a new session (``session_options`` as for :meth:`capsa.sdk.Session.create`) owned by the
        backend."""
        session = Session.create(template, api_url=api_url, api_key=api_key, **session_options)
        return cls(session, default_timeout=default_timeout, cwd=cwd, owns_session=True)

    @classmethod
    async def acreate(cls, template: str = "base", *, api_url: str | None = None, api_key: str | None = None,
                      default_timeout: int = DEFAULT_TIMEOUT, cwd: str | None = None,
                      **session_options: Any) -> CapsaSandbox:
        """:meth:`create` for async code: the session is made on the SDK's loop thread while the caller's
        event loop keeps running."""
        inner = await get_portal().acall(AsyncSession.create(template, api_url=api_url, api_key=api_key,
                                                             **session_options))
        return cls(Session(inner), default_timeout=default_timeout, cwd=cwd, owns_session=True)

    @property
    def id(self) -> str:
        """The capsa session id (``ses_…``)."""
        return self._session.id

    @property
    def session(self) -> Session:
        return self._session

    def close(self) -> None:
        """Close the session if this backend started it (:meth:`create`); otherwise do nothing."""
        if self._owns_session:
            self._owns_session = False
            self._session.close()

    async def aclose(self) -> None:
        """:meth:`close` for async code."""
        if self._owns_session:
            self._owns_session = False
            await self._portal.acall(self._session.aio.close())

    def __enter__(self) -> CapsaSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> CapsaSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._portal.call(coro)

    # -- execute ---------------------------------------------------------------------------------------

    def execute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        return self._call(self._execute(command, timeout))

    async def aexecute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        return await self._portal.acall(self._execute(command, timeout))

    async def _execute(self, command: str, timeout: int | None) -> ExecuteResponse:
        if not command or not isinstance(command, str):
            return ExecuteResponse(output="Error: the command must be a non-empty string", exit_code=1)
        if timeout is not None and timeout < 0:
            return ExecuteResponse(output=f"Error: timeout must not be negative, got {timeout}", exit_code=1)
        limit = self._default_timeout if timeout is None else (timeout or _MAX_TIMEOUT)
        limit = min(limit, _MAX_TIMEOUT)
        try:
            # `exec 2>&1` first: stderr joins stdout in the guest, so the output keeps the real order.
            result = await self._session.aio.commands.run(f"exec 2>&1\n{command}", timeout=limit,
                                                          env=self._env or None, cwd=self._cwd)
        except CapsaClientError as exc:
            return ExecuteResponse(output=f"Error: {exc}", exit_code=None)
        output = result.stdout + result.stderr
        truncated = result.stdout_truncated or result.stderr_truncated
        if result.timed_out:
            note = f"Error: the command timed out after {limit} seconds"
            return ExecuteResponse(output=f"{output.rstrip()}\n\n{note}" if output else note,
                                   exit_code=TIMEOUT_EXIT_CODE, truncated=truncated)
        exit_code = result.exit_code
        if exit_code is None and result.signal is not None:
            exit_code = 128 + result.signal
        return ExecuteResponse(output=output, exit_code=exit_code, truncated=truncated)

    # -- files -----------------------------------------------------------------------------------------

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        return self._call(self._upload(files))

    async def aupload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        return await self._portal.acall(self._upload(files))

    async def _upload(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        answers: list[FileUploadResponse] = []
        for path, content in files:
            answers.append(await self._upload_one(path, content))
        return answers

    async def _upload_one(self, path: str, content: bytes) -> FileUploadResponse:
        if not _valid_path(path):
            return FileUploadResponse(path=path, error="invalid_path")
        try:
            await self._session.aio.files.write(path, bytes(content))  # parent directories are created
        except CapsaClientError as exc:
            return FileUploadResponse(path=path, error=_file_error(exc))
        return FileUploadResponse(path=path)

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        return self._call(self._download(paths))

    async def adownload_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        return await self._portal.acall(self._download(paths))

    async def _download(self, paths: list[str]) -> list[FileDownloadResponse]:
        answers: list[FileDownloadResponse] = []
        for path in paths:
            answers.append(await self._download_one(path))
        return answers

    async def _download_one(self, path: str) -> FileDownloadResponse:
        if not _valid_path(path):
            return FileDownloadResponse(path=path, error="invalid_path")
        try:
            content = await self._session.aio.files.read_bytes(path)
        except CapsaClientError as exc:
            return FileDownloadResponse(path=path, error=_file_error(exc))
        return FileDownloadResponse(path=path, content=content)

    def __repr__(self) -> str:
        return f"CapsaSandbox(id={self.id!r})"

