"""``session.pty``: terminals in the sandbox (the API's ``/v1/sessions/{id}/pty`` WebSocket).

    term = await s.pty.create(cols=80, rows=24)        # the login shell; or cmd="htop"
    await term.send(b"ls\\n")
    async for chunk in term:                           # terminal output until the command exits
        ...
    await term.resize(120, 40)
    code = await term.wait()                           # its exit code (output read meanwhile is dropped)

Like port tunnels, a terminal connects to the API's own address with a socket of its own (a client built
with a custom ``transport`` cannot open one). Closing the terminal hangs it up in the sandbox.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping

from capsa.common.errors import CapsaError
from capsa.common.terminal_wire import TerminalClient, TerminalOptions
from capsa.sdk.api_socket import api_error, upgrade
from capsa.sdk.errors import CapsaConnectionError
from capsa.sdk.resource import AsyncClosing, SessionResource

__all__ = ["AsyncPty", "AsyncTerminal"]


def _api_error(exc: CapsaError) -> Exception:
    if exc.code == "validation_error":
        return ValueError(exc.message)
    return api_error(exc)


class AsyncTerminal(AsyncClosing):
    """An open terminal: bytes in (``send``), bytes out (``recv`` / ``async for``), ``resize``, ``kill``,
    ``wait``; ``exit_code``/``signal`` once it ended."""

    def __init__(self, client: TerminalClient, api_url: str) -> None:
        self._term = client
        self._api_url = api_url

    @property
    def pid(self) -> int:
        """The terminal's command in the guest."""
        return self._term.pid

    @property
    def exit_code(self) -> int | None:
        return self._term.exit.exit_code if self._term.exit else None

    @property
    def signal(self) -> int | None:
        """The signal that ended the command, if one did."""
        return self._term.exit.signal if self._term.exit else None

    @property
    def closed(self) -> bool:
        return self._term.closed

    async def send(self, data: bytes | str) -> None:
        """Keyboard input (a str is sent as UTF-8)."""
        await self._call(self._term.send(data.encode() if isinstance(data, str) else bytes(data)))

    async def resize(self, cols: int, rows: int) -> None:
        TerminalOptions(cols=cols, rows=rows).check()
        await self._call(self._term.resize(cols, rows))

    async def kill(self) -> None:
        """Kill the terminal's processes (SIGKILL); the output ends and ``exit_code``/``signal`` are set."""
        await self._call(self._term.kill())

    async def recv(self) -> bytes | None:
        """The next piece of output; None once the terminal has ended."""
        try:
            return await self._term.recv()
        except CapsaError as exc:
            raise _api_error(exc) from None
        except (OSError, ConnectionError) as exc:
            raise CapsaConnectionError(f"the terminal connection failed: {exc}", url=self._api_url) from None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.recv()) is not None:
            yield chunk

    async def wait(self) -> int | None:
        """Read (and drop) output until the command exits; its exit code (None if a signal ended it)."""
        while await self.recv() is not None:
            pass
        return self.exit_code

    async def close(self) -> None:
        """Hang the terminal up (if it still runs) and drop the connection."""
        await self._term.close()

    async def _call(self, op: Awaitable[None]) -> None:
        try:
            await op
        except (OSError, ConnectionError) as exc:
            raise CapsaConnectionError(f"the terminal connection failed: {exc}", url=self._api_url) from None


class AsyncPty(SessionResource):
    """The terminals of one session."""

    async def create(self, cols: int = 80, rows: int = 24, cmd: str | None = None, *,
                     env: Mapping[str, str] | None = None, cwd: str | None = None,
                     user: str | None = None) -> AsyncTerminal:
        """Open a terminal of ``cols`` x ``rows`` running ``cmd`` (a shell command line; default: the
        login shell, interactive)."""
        try:
            options = TerminalOptions(cols=cols, rows=rows, cmd=cmd, env=dict(env) if env else None, cwd=cwd,
                                      user=user).check()
        except CapsaError as exc:
            raise ValueError(exc.message) from None
        config = self._client.config
        path = f"{self._base}/pty?{options.query()}"
        client = await upgrade(config, path, "terminal", TerminalClient.connect, refused=_api_error)
        return AsyncTerminal(client, config.api_url)
