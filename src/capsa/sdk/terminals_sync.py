"""Blocking twins of :mod:`capsa.sdk.terminals` (``Session.pty``), run through the SDK's portal."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from capsa.sdk.portal import Blocking, Closing
from capsa.sdk.terminals import AsyncPty, AsyncTerminal

__all__ = ["Pty", "Terminal"]


class Pty(Blocking[AsyncPty]):
    """See :class:`capsa.sdk.terminals.AsyncPty`."""

    def create(self, cols: int = 80, rows: int = 24, cmd: str | None = None, *,
               env: Mapping[str, str] | None = None, cwd: str | None = None,
               user: str | None = None) -> Terminal:
        return Terminal(self._portal.call(self._inner.create(cols, rows, cmd, env=env, cwd=cwd, user=user)),
                        self._portal)


class Terminal(Blocking[AsyncTerminal], Closing):
    """See :class:`capsa.sdk.terminals.AsyncTerminal`; ``for chunk in term`` reads its output."""

    @property
    def pid(self) -> int:
        return self._inner.pid

    @property
    def exit_code(self) -> int | None:
        return self._inner.exit_code

    @property
    def signal(self) -> int | None:
        return self._inner.signal

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def send(self, data: bytes | str) -> None:
        self._portal.call(self._inner.send(data))

    def resize(self, cols: int, rows: int) -> None:
        self._portal.call(self._inner.resize(cols, rows))

    def kill(self) -> None:
        self._portal.call(self._inner.kill())

    def recv(self) -> bytes | None:
        return self._portal.call(self._inner.recv())

    def __iter__(self) -> Iterator[bytes]:
        while (chunk := self.recv()) is not None:
            yield chunk

    def wait(self) -> int | None:
        return self._portal.call(self._inner.wait())

    def close(self) -> None:
        self._portal.call(self._inner.close())
