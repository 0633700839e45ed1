"""The blocking API: thin wrappers that run the async implementation on the SDK's private loop thread.

Nothing here decides anything; each method forwards to its async twin, so both APIs behave identically.
Output callbacks given to :meth:`Commands.run` are called on the SDK's loop thread while the caller waits.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any, Literal, overload

import httpx

from capsa.common.wire.streams import FileEvent, OutputChunk, OutputEnd
from capsa.sdk.approvals_sync import Approvals
from capsa.sdk.audit_sync import Audit
from capsa.sdk.browser import BrowserInfo
from capsa.sdk.browser_sync import Computer
from capsa.sdk.client import AsyncClient, AsyncKeys
from capsa.sdk.commands import AsyncCommands, AsyncProcess, OutputCallback
from capsa.sdk.config import ClientConfig
from capsa.sdk.connections_sync import ConnectionProviders, Connections
from capsa.sdk.egress import AuditEvent, PolicyInfo
from capsa.sdk.egress_sync import Egress, Secrets
from capsa.sdk.files import AsyncFiles, AsyncWatch, UploadSource
from capsa.sdk.models import (
    ApiKey,
    CommandResult,
    FileInfo,
    ProcessInfo,
    ProcessOutput,
    SessionInfo,
    SnapshotInfo,
)
from capsa.sdk.nodes import Nodes
from capsa.sdk.portal import Blocking, Closing, get_portal
from capsa.sdk.ports_sync import Ports
from capsa.sdk.session import AsyncSession
from capsa.sdk.snapshots import AsyncSnapshots
from capsa.sdk.terminals_sync import Pty

__all__ = ["Client", "Commands", "Files", "Keys", "Process", "Session", "Snapshots", "Watch"]


class Keys(Blocking[AsyncKeys]):
    """API key management (admin keys only)."""

    def create(self, tenant: str, *, admin: bool = False, name: str | None = None) -> ApiKey:
        return self._portal.call(self._inner.create(tenant, admin=admin, name=name))

    def list(self) -> builtins.list[ApiKey]:
        return self._portal.call(self._inner.list())

    def revoke(self, key_id: str) -> ApiKey:
        return self._portal.call(self._inner.revoke(key_id))


class Client(Closing):
    """A blocking connection to a capsa API (``Session`` makes its own when none is given)."""

    def __init__(self, api_url: str | None = None, api_key: str | None = None, *,
                 timeout: float | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._portal = get_portal()
        self.aio = AsyncClient(api_url, api_key, timeout=timeout, transport=transport)
        self.keys = Keys(self.aio.keys, self._portal)
        self.nodes = Nodes(self.aio.nodes, self._portal)
        self.secrets = Secrets(self.aio.secrets, self._portal)
        self.approvals = Approvals(self.aio.approvals, self._portal)
        self.connections = Connections(self.aio.connections, self._portal)
        self.connection_providers = ConnectionProviders(self.aio.connection_providers, self._portal)
        self.audit = Audit(self.aio.audit, self._portal)

    @property
    def config(self) -> ClientConfig:
        return self.aio.config

    def health(self) -> dict[str, Any]:
        return self._portal.call(self.aio.health())

    def ready(self) -> bool:
        return self._portal.call(self.aio.ready())

    def close(self) -> None:
        self._portal.call(self.aio.aclose())


class Process(Blocking[AsyncProcess]):
    """A background process in a session."""

    @property
    def pid(self) -> int:
        return self._inner.pid

    @property
    def info(self) -> ProcessInfo:
        return self._inner.info

    def refresh(self) -> ProcessInfo:
        return self._portal.call(self._inner.refresh())

    def output(self) -> ProcessOutput:
        return self._portal.call(self._inner.output())

    def kill(self, signal: int = 15) -> ProcessInfo:
        return self._portal.call(self._inner.kill(signal))

    @property
    def stdout_offset(self) -> int:
        return self._inner.stdout_offset

    @property
    def stderr_offset(self) -> int:
        return self._inner.stderr_offset

    def send_stdin(self, data: str | bytes) -> ProcessInfo:
        return self._portal.call(self._inner.send_stdin(data))

    def close_stdin(self) -> ProcessInfo:
        return self._portal.call(self._inner.close_stdin())

    def stream(self) -> Iterator[OutputChunk | OutputEnd]:
        return self._portal.iterate(self._inner.stream())

    def wait(self, timeout: float | None = None, *, poll_interval: float = 0.25,
             on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
             reconnects: int = 3) -> ProcessOutput:
        """See :meth:`capsa.sdk.commands.AsyncProcess.wait`; callbacks run on the SDK's loop thread."""
        return self._portal.call(self._inner.wait(timeout, poll_interval=poll_interval, on_stdout=on_stdout,
                                                  on_stderr=on_stderr, reconnects=reconnects))

    def __repr__(self) -> str:
        return f"Process(pid={self.pid}, running={self.info.running})"


class Commands(Blocking[AsyncCommands]):
    @overload
    def run(self, cmd: str | Sequence[str], *, timeout: float | None = ...,
            env: Mapping[str, str] | None = ..., cwd: str | None = ..., user: str | None = ...,
            stdin: str | None = ..., on_stdout: OutputCallback | None = ...,
            on_stderr: OutputCallback | None = ..., background: Literal[False] = ...,
            open_stdin: Literal[False] = ...) -> CommandResult: ...

    @overload
    def run(self, cmd: str | Sequence[str], *, timeout: float | None = ...,
            env: Mapping[str, str] | None = ..., cwd: str | None = ..., user: str | None = ...,
            stdin: str | None = ..., on_stdout: OutputCallback | None = ...,
            on_stderr: OutputCallback | None = ..., background: Literal[True],
            open_stdin: bool = ...) -> Process: ...

    def run(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
            env: Mapping[str, str] | None = None, cwd: str | None = None, user: str | None = None,
            stdin: str | None = None, on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None, background: bool = False,
            open_stdin: bool = False) -> CommandResult | Process:
        """See :meth:`capsa.AsyncSession.commands.run <capsa.sdk.commands.AsyncCommands.run>`."""
        if background:
            proc = self._portal.call(self._inner.run(cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                                                     stdin=stdin, background=True, open_stdin=open_stdin))
            return Process(proc, self._portal)
        return self._portal.call(self._inner.run(cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                                                 stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr))

    def list(self) -> builtins.list[ProcessInfo]:
        return self._portal.call(self._inner.list())

    def process(self, pid: int) -> Process:
        return Process(self._portal.call(self._inner.process(pid)), self._portal)

    def connect(self, pid: int, *, stdout_from: int = 0, stderr_from: int = 0) -> Process:
        return Process(self._portal.call(self._inner.connect(pid, stdout_from=stdout_from,
                                                             stderr_from=stderr_from)), self._portal)


class Files(Blocking[AsyncFiles]):
    def read(self, path: str, *, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self._portal.call(self._inner.read(path, encoding=encoding, errors=errors))

    def read_bytes(self, path: str) -> bytes:
        return self._portal.call(self._inner.read_bytes(path))

    def write(self, path: str, data: str | bytes, *, mode: int | None = None) -> FileInfo:
        return self._portal.call(self._inner.write(path, data, mode=mode))

    def upload(self, path: str, source: UploadSource, *, mode: int | None = None) -> FileInfo:
        return self._portal.call(self._inner.upload(path, source, mode=mode))

    def download(self, path: str, dest: str | os.PathLike[str] | IO[bytes]) -> int:
        return self._portal.call(self._inner.download(path, dest))

    def watch(self, path: str, *, recursive: bool = False) -> Watch:
        return Watch(self._portal.call(self._inner.watch(path, recursive=recursive)), self._portal)

    def iter_bytes(self, path: str, *, chunk_size: int = 256 * 1024) -> Iterator[bytes]:
        return self._portal.iterate(self._inner.iter_bytes(path, chunk_size=chunk_size))

    def list(self, path: str) -> builtins.list[FileInfo]:
        return self._portal.call(self._inner.list(path))

    def stat(self, path: str) -> FileInfo:
        return self._portal.call(self._inner.stat(path))

    def exists(self, path: str) -> bool:
        return self._portal.call(self._inner.exists(path))

    def mkdir(self, path: str, *, parents: bool = True) -> FileInfo:
        return self._portal.call(self._inner.mkdir(path, parents=parents))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._portal.call(self._inner.remove(path, recursive=recursive))

    def upload_tar(self, path: str, source: UploadSource) -> None:
        self._portal.call(self._inner.upload_tar(path, source))

    def download_tar(self, path: str, dest: str | os.PathLike[str] | IO[bytes]) -> int:
        return self._portal.call(self._inner.download_tar(path, dest))


class Watch(Blocking[AsyncWatch], Closing):
    """See :class:`capsa.sdk.files.AsyncWatch`: ``for event in watch``; ``close()``."""

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def __iter__(self) -> Iterator[FileEvent]:
        while (event := self.next()) is not None:
            yield event

    def next(self) -> FileEvent | None:
        return self._portal.call(self._inner.next())

    def close(self) -> None:
        self._portal.call(self._inner.aclose())


class Snapshots(Blocking[AsyncSnapshots]):
    """See :class:`capsa.sdk.snapshots.AsyncSnapshots`."""

    def list(self) -> builtins.list[SnapshotInfo]:
        return self._portal.call(self._inner.list())

    def create(self) -> SnapshotInfo:
        return self._portal.call(self._inner.create())

    def restore(self, snapshot_id: str) -> None:
        self._portal.call(self._inner.restore(snapshot_id))


class _Resume:
    """``Session.resume(id, ...)`` (attach and resume) and ``s.resume()`` (resume in place)."""

    @overload
    def __get__(self, obj: None, owner: type[Session]) -> Callable[..., Session]: ...

    @overload
    def __get__(self, obj: Session, owner: type[Session]) -> Callable[[], SessionInfo]: ...

    def __get__(self, obj: Session | None, owner: type[Session]) -> Callable[..., Any]:
        if obj is None:
            return owner._resume_by_id
        return obj._resume


def _aio(client: Client | None) -> AsyncClient | None:
    return None if client is None else client.aio


class Session(Blocking[AsyncSession], Closing):
    """A capsa session, blocking API. ``with Session.create() as s:`` closes the session at the end."""

    def __init__(self, inner: AsyncSession) -> None:
        super().__init__(inner, get_portal())
        self.aio = inner
        """The async session this one wraps (as ``Client.aio``). It lives on the SDK's loop thread: await its
        coroutines there (``get_portal().acall(...)``), not on another event loop."""
        self.commands = Commands(inner.commands, self._portal)
        self.files = Files(inner.files, self._portal)
        self.snapshots = Snapshots(inner.snapshots, self._portal)
        self.egress = Egress(inner.egress, self._portal)
        self.ports = Ports(inner.ports, self._portal)
        self.pty = Pty(inner.pty, self._portal)
        self.computer = Computer(inner.computer, self._portal)

    @classmethod
    def create(cls, template: str = "base", *, timeout: int | None = None, idle_timeout: int | None = None,
               env: Mapping[str, str] | None = None, metadata: Mapping[str, str] | None = None,
               memory_mib: int | None = None, vcpus: int | None = None,
               on_timeout: Literal["pause", "close"] | None = None,
               rolling_snapshots: Mapping[str, Any] | None = None, keep_snapshots: bool | None = None,
               policy: Mapping[str, Any] | None = None, expose: Sequence[int] | None = None,
               api_url: str | None = None, api_key: str | None = None, client: Client | None = None,
               transport: httpx.AsyncBaseTransport | None = None) -> Session:
        """See :meth:`capsa.AsyncSession.create`."""
        inner = get_portal().call(AsyncSession.create(
            template, timeout=timeout, idle_timeout=idle_timeout, env=env, metadata=metadata,
            memory_mib=memory_mib, vcpus=vcpus, on_timeout=on_timeout, rolling_snapshots=rolling_snapshots,
            keep_snapshots=keep_snapshots, policy=policy, expose=expose, api_url=api_url, api_key=api_key,
            client=_aio(client), transport=transport))
        return cls(inner)

    @classmethod
    def connect(cls, session_id: str, *, api_url: str | None = None, api_key: str | None = None,
                client: Client | None = None, transport: httpx.AsyncBaseTransport | None = None) -> Session:
        inner = get_portal().call(AsyncSession.connect(session_id, api_url=api_url, api_key=api_key,
                                                       client=_aio(client), transport=transport))
        return cls(inner)

    @classmethod
    def list(cls, *, state: str | None = None, metadata: Mapping[str, str] | None = None,
             limit: int | None = None, api_url: str | None = None, api_key: str | None = None,
             client: Client | None = None,
             transport: httpx.AsyncBaseTransport | None = None) -> builtins.list[SessionInfo]:
        return get_portal().call(AsyncSession.list(state=state, metadata=metadata, limit=limit,
                                                   api_url=api_url, api_key=api_key, client=_aio(client),
                                                   transport=transport))

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def info(self) -> SessionInfo:
        return self._inner.info

    @property
    def state(self) -> str:
        return self._inner.state

    def get_host(self, port: int) -> str:
        return self._inner.get_host(port)

    def browser_info(self, *, interactive: bool = False) -> BrowserInfo:
        return self._portal.call(self._inner.browser_info(interactive=interactive))

    def browser(self, *, interactive: bool = False) -> BrowserInfo:
        return self._portal.call(self._inner.browser(interactive=interactive))

    def refresh(self) -> SessionInfo:
        return self._portal.call(self._inner.refresh())

    def audit(self, *, decision: str | None = None, limit: int | None = None) -> builtins.list[AuditEvent]:
        """The session's egress audit trail, oldest first."""
        return self._portal.call(self._inner.audit(decision=decision, limit=limit))

    def set_policy(self, policy: Mapping[str, Any]) -> PolicyInfo:
        """Replace the running session's egress policy (applies without a restart)."""
        return self._portal.call(self._inner.set_policy(policy))

    def set_timeout(self, timeout: int) -> SessionInfo:
        return self._portal.call(self._inner.set_timeout(timeout))

    def pause(self) -> SessionInfo:
        return self._portal.call(self._inner.pause())

    resume = _Resume()

    def _resume(self) -> SessionInfo:
        return self._portal.call(self._inner.resume())

    @classmethod
    def _resume_by_id(cls, session_id: str, *, api_url: str | None = None, api_key: str | None = None,
                      client: Client | None = None,
                      transport: httpx.AsyncBaseTransport | None = None) -> Session:
        inner = get_portal().call(AsyncSession.resume(session_id, api_url=api_url, api_key=api_key,
                                                      client=_aio(client), transport=transport))
        return cls(inner)

    def branch(self, n: int = 1) -> builtins.list[Session]:
        return [Session(inner) for inner in self._portal.call(self._inner.branch(n))]

    def close(self) -> SessionInfo:
        return self._portal.call(self._inner.close())

    def disconnect(self) -> None:
        self._portal.call(self._inner.disconnect())

    def __repr__(self) -> str:
        return f"Session(id={self.id!r}, state={self.state!r}, template={self.info.template!r})"
