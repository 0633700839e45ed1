"""The node agent: owns the runtime on one host and the sandboxes the control plane asked for.

It knows nothing about sessions or tenants; it creates and destroys sandboxes by id, reports capacity, and
relays guest operations. The HTTP surface is in :mod:`capsa.node.api`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from capsa.common.egress_policy import EgressPolicy
from capsa.common.errors import CapsaError
from capsa.common.ids import is_id
from capsa.node.egress.node_egress import CA_PATH, NodeEgress, install_ca_script
from capsa.node.guest_client import DEFAULT_MAX_OUTPUT, ExecResult, FileInfo, ProcessInfo, ProcessOutput
from capsa.node.runtime.base import GuestImage, Runtime, Sandbox, SandboxState, VMSpec

__all__ = ["NodeAgent", "NodeCapacity", "SandboxRecord", "default_capacity"]

log = logging.getLogger(__name__)

ExecChunk = tuple[Literal["stdout", "stderr"], bytes]
"""A piece of a running command's output (:meth:`NodeAgent.exec_stream`)."""
# Guest failures that mean the channel, not the request, failed.
_GUEST_GONE = frozenset({"channel_closed", "internal_error", "guest_unavailable"})


@dataclass(frozen=True)
class NodeCapacity:
    memory_mib: int
    vcpus: int
    max_sandboxes: int

    def as_dict(self) -> dict[str, int]:
        return {"memory_mib": self.memory_mib, "vcpus": self.vcpus, "max_sandboxes": self.max_sandboxes}


def default_capacity() -> NodeCapacity:
    """Three quarters of host RAM, 4 vCPUs per host CPU (guests mostly idle), at most 64 sandboxes."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return NodeCapacity(memory_mib=int(pages * 3 / 4) >> 20, vcpus=4 * (os.cpu_count() or 1),
                        max_sandboxes=64)


@dataclass
class SandboxRecord:
    id: str
    template: str
    memory_mib: int
    vcpus: int
    env: dict[str, str]
    sandbox: Sandbox
    created_at: float = field(default_factory=time.time)
    networked: bool = False
    """True when the sandbox was started with an egress policy (it has a NIC behind the broker)."""
    egress_env: dict[str, str] = field(default_factory=dict)
    """The part of ``env`` that egress put there (proxy settings, secret placeholders)."""

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "template": self.template, "memory_mib": self.memory_mib, "vcpus": self.vcpus,
                "state": str(self.sandbox.state), "failure": self.sandbox.failure,
                "accelerator": str(self.sandbox.accelerator), "created_at": self.created_at}


class NodeAgent:
    def __init__(self, runtime: Runtime, image: GuestImage, *, node_id: str = "local",
                 capacity: NodeCapacity | None = None,
                 templates: Mapping[str, GuestImage] | None = None,
                 egress: NodeEgress | None = None) -> None:
        self.runtime = runtime
        self.egress = egress
        self.node_id = node_id
        self.capacity = capacity or default_capacity()
        self.templates: dict[str, GuestImage] = {"base": image, **(templates or {})}
        self._sandboxes: dict[str, SandboxRecord] = {}
        self._booting: dict[str, tuple[int, int]] = {}  # id -> (memory, vcpus) reserved while it boots
        self._doomed: set[str] = set()  # destroy asked for while still booting
        self._failed: set[str] = set()

    # -- lifecycle of the agent ------------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Remove VMs and workdirs a previous agent process left behind; returns what was removed."""
        removed = await self.runtime.cleanup_orphans()
        if self.egress is not None:
            removed += await self.egress.cleanup_stale()
        if removed:
            log.warning("removed %d orphaned sandbox(es): %s", len(removed), removed)
        return removed

    async def close(self) -> None:
        ids = list(self._sandboxes)
        for sandbox_id in ids:
            await self.destroy(sandbox_id)
        await self.runtime.close()
        if self.egress is not None:
            await self.egress.close()

    # -- capacity ----------------------------------------------------------------------------------------
    def used(self) -> dict[str, int]:
        records = list(self._sandboxes.values())
        return {
            "memory_mib": sum(r.memory_mib for r in records) + sum(m for m, _ in self._booting.values()),
            "vcpus": sum(r.vcpus for r in records) + sum(c for _, c in self._booting.values()),
            "sandboxes": len(records) + len(self._booting),
        }

    def failed_sandboxes(self) -> list[str]:
        return sorted(self._failed)

    def info(self) -> dict[str, object]:
        return {"node_id": self.node_id, "runtime": self.runtime.name, "templates": sorted(self.templates),
                "capacity": self.capacity.as_dict(), "used": self.used(),
                "failed_sandboxes": self.failed_sandboxes()}

    # -- sandboxes -----------------------------------------------------------------------------------------
    async def create(self, sandbox_id: str, template: str, memory_mib: int, vcpus: int,
                     env: Mapping[str, str], *, policy: EgressPolicy | None = None,
                     secrets: Mapping[str, str] | None = None,
                     session_id: str | None = None) -> SandboxRecord:
        """Boot a sandbox. Without ``policy`` it has no NIC at all; with one it gets its own namespace
        behind the egress broker, the broker's CA in its trust store and the placeholders in ``env``."""
        if not is_id(sandbox_id, "sbx"):
            raise CapsaError(f"bad sandbox id {sandbox_id!r}", code="bad_request", status=400)
        image = self.templates.get(template)
        if image is None:
            raise CapsaError(f"template {template!r} not on this node", code="template_not_found", status=404)
        if sandbox_id in self._sandboxes or sandbox_id in self._booting:
            raise CapsaError(f"sandbox {sandbox_id} exists", code="already_exists", status=409)
        used = self.used()
        if (used["sandboxes"] >= self.capacity.max_sandboxes
                or used["memory_mib"] + memory_mib > self.capacity.memory_mib
                or used["vcpus"] + vcpus > self.capacity.vcpus):
            raise CapsaError("node is full", code="no_capacity", status=503)
        if policy is not None and self.egress is None:
            raise CapsaError("this node has no egress service: sessions with a policy cannot run here",
                             code="egress_unavailable", status=503)
        self._booting[sandbox_id] = (memory_mib, vcpus)
        egress_env: dict[str, str] = {}
        try:
            network = None
            if policy is not None and self.egress is not None:
                attached = await self.egress.attach(sandbox_id, policy, secrets or {}, session_id=session_id)
                network, egress_env = attached.net, dict(attached.env)
            try:
                spec = VMSpec(image=image, memory_mib=memory_mib, vcpus=vcpus, network=network,
                              labels={"sandbox": sandbox_id, "template": template})
                sandbox = await self.runtime.boot(spec, sandbox_id=sandbox_id)
                if network is not None:
                    try:
                        await self._install_ca(sandbox, attached.ca_pem)
                    except BaseException:
                        await asyncio.shield(self.runtime.destroy(sandbox))
                        raise
            except BaseException:
                if network is not None and self.egress is not None:
                    await asyncio.shield(self.egress.detach(sandbox_id))
                raise
        finally:
            del self._booting[sandbox_id]
        record = SandboxRecord(sandbox_id, template, memory_mib, vcpus, {**env, **egress_env}, sandbox,
                               networked=network is not None, egress_env=egress_env)
        self._sandboxes[sandbox_id] = record
        if sandbox_id in self._doomed:
            await self.destroy(sandbox_id)
            raise CapsaError(f"sandbox {sandbox_id} was destroyed while it booted", code="sandbox_not_found",
                             status=404)

        def _died(reason: str) -> None:
            log.warning("sandbox %s died: %s", sandbox_id, reason)
            if sandbox_id in self._sandboxes:
                self._failed.add(sandbox_id)

        sandbox.on_failure(_died)
        return record

    @staticmethod
    async def _install_ca(sandbox: Sandbox, ca_pem: bytes) -> None:
        await sandbox.guest.write_file(CA_PATH, ca_pem, mode=0o644)
        result = await sandbox.guest.exec(install_ca_script(), timeout=60)
        if result.exit_code != 0:
            raise CapsaError(f"could not install the egress CA in the guest: {result.stderr[-300:]!r}",
                             code="egress_setup_failed", status=500)

    async def update_policy(self, sandbox_id: str, policy: EgressPolicy,
                            secrets: Mapping[str, str] | None = None) -> bool:
        """Replace a running sandbox's policy; returns whether its CA was re-issued (and re-installed).

        Placeholders of bindings that stay keep their value; the session env changes for new commands."""
        record = self.get(sandbox_id)
        if not record.networked or self.egress is None:
            raise CapsaError(f"sandbox {sandbox_id} was started without a policy and has no network; "
                             "a policy can only be given when the session is created", code="no_network",
                             status=409)
        update = self.egress.update_policy(sandbox_id, policy, secrets or {})
        if update.ca_reissued:
            await self._install_ca(record.sandbox, update.ca_pem)
        placeholders = self.egress.placeholder_env(sandbox_id)
        proxy = {k: v for k, v in record.egress_env.items() if k.lower() in ("http_proxy", "https_proxy")}
        for key in record.egress_env:
            record.env.pop(key, None)
        record.egress_env = {**proxy, **placeholders}
        record.env.update(record.egress_env)
        return update.ca_reissued

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The live sandbox; a dead one raises ``sandbox_failed``, an unknown one ``sandbox_not_found``."""
        record = self._sandboxes.get(sandbox_id)
        if record is None:
            raise CapsaError(f"sandbox {sandbox_id} not found", code="sandbox_not_found", status=404)
        if record.sandbox.state == SandboxState.FAILED or sandbox_id in self._failed:
            self._failed.add(sandbox_id)
            raise CapsaError(f"sandbox {sandbox_id} failed: {record.sandbox.failure or 'VM died'}",
                             code="sandbox_failed", status=409)
        return record

    def list(self) -> list[SandboxRecord]:
        return list(self._sandboxes.values())

    async def destroy(self, sandbox_id: str) -> bool:
        """Destroy a sandbox (idempotent). Returns whether there was something to destroy."""
        if sandbox_id in self._booting:
            self._doomed.add(sandbox_id)
            return True
        record = self._sandboxes.pop(sandbox_id, None)
        self._failed.discard(sandbox_id)
        self._doomed.discard(sandbox_id)
        if record is None:
            return False
        try:
            await asyncio.shield(self.runtime.destroy(record.sandbox))
        finally:
            if record.networked and self.egress is not None:
                await asyncio.shield(self.egress.detach(sandbox_id))
        return True

    # -- guest operations ----------------------------------------------------------------------------------
    # What the node API calls for a sandbox's guest. Each runs with the sandbox's env under the command's
    # own, and fails with a stable code: ``sandbox_failed`` when the VM died, ``guest_unavailable`` when the
    # guest channel broke, else the guest's own code (capsa.node.api.errors maps codes to HTTP statuses).

    @contextlib.contextmanager
    def _guest_call(self, record: SandboxRecord) -> Iterator[None]:
        try:
            yield
        except (CapsaError, OSError, EOFError, asyncio.IncompleteReadError) as exc:
            raise self._guest_failure(record, exc) from exc

    @staticmethod
    def _guest_failure(record: SandboxRecord, exc: BaseException) -> CapsaError:
        if record.sandbox.state == SandboxState.FAILED:
            return CapsaError(f"sandbox {record.id} failed: {record.sandbox.failure or 'VM died'}",
                              code="sandbox_failed", status=409)
        if isinstance(exc, CapsaError) and exc.code == "sandbox_failed":
            return exc
        if isinstance(exc, CapsaError) and exc.code not in _GUEST_GONE:
            # The guest refused the request: its code stands; a code the node does not know is a 400.
            status = exc.status if 400 <= exc.status < 500 else 400
            return CapsaError(exc.message, code=exc.code, status=status)
        return CapsaError(f"guest channel failed: {getattr(exc, 'message', None) or type(exc).__name__}",
                          code="guest_unavailable", status=503)

    async def exec(self, sandbox_id: str, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                   cwd: str | None = None, user: str | None = None, stdin: bytes | None = None,
                   timeout: float | None = None,  # noqa: ASYNC109 - the guest enforces it
                   max_output: int = DEFAULT_MAX_OUTPUT) -> ExecResult:
        """Run a command to its end and return its output."""
        record = self.get(sandbox_id)
        with self._guest_call(record):
            return await record.sandbox.guest.exec(cmd, env={**record.env, **(env or {})}, cwd=cwd, user=user,
                                                   stdin=stdin, timeout=timeout, max_output=max_output)

    def exec_stream(self, sandbox_id: str, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                    cwd: str | None = None, user: str | None = None, stdin: bytes | None = None,
                    timeout: float | None = None,
                    max_output: int = DEFAULT_MAX_OUTPUT) -> AsyncGenerator[ExecChunk | ExecResult, None]:
        """Run a command, yielding its output as it comes and then its :class:`ExecResult`.

        The sandbox is looked up now (an unknown one raises here, not at the first event); a failure
        later is raised by the iterator. Closing the iterator early kills the command in the guest."""
        record = self.get(sandbox_id)
        return self._exec_events(record, cmd, env={**record.env, **(env or {})}, cwd=cwd, user=user,
                                 stdin=stdin, timeout=timeout, max_output=max_output)

    async def _exec_events(self, record: SandboxRecord, cmd: str | Sequence[str], *, env: dict[str, str],
                           cwd: str | None, user: str | None, stdin: bytes | None,
                           timeout: float | None,  # noqa: ASYNC109
                           max_output: int) -> AsyncGenerator[ExecChunk | ExecResult, None]:
        # Bounded: a caller that reads slowly holds up the guest (through the channel's credit window).
        queue: asyncio.Queue[ExecChunk] = asyncio.Queue(maxsize=64)
        run = asyncio.create_task(record.sandbox.guest.exec(
            cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout=timeout, max_output=max_output,
            on_stdout=lambda b: queue.put(("stdout", b)), on_stderr=lambda b: queue.put(("stderr", b))))
        getter: asyncio.Future[ExecChunk] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait((getter, run), return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                with self._guest_call(record):
                    result = run.result()
                yield result
                return
        finally:
            if getter is not None:
                getter.cancel()
            if not run.done():
                run.cancel()  # the caller went away: cancelling kills the guest process
            with contextlib.suppress(asyncio.CancelledError, CapsaError, OSError, EOFError):
                await run

    async def start_process(self, sandbox_id: str, cmd: str | Sequence[str], *,
                            env: Mapping[str, str] | None = None, cwd: str | None = None,
                            user: str | None = None) -> ProcessInfo:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            return await record.sandbox.guest.start_process(cmd, env={**record.env, **(env or {})}, cwd=cwd,
                                                            user=user)

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            return await record.sandbox.guest.list_processes()

    async def get_process(self, sandbox_id: str, pid: int) -> ProcessInfo:
        for info in await self.list_processes(sandbox_id):
            if info.pid == pid:
                return info
        raise CapsaError(f"no process {pid}", code="not_found", status=404)

    async def kill_process(self, sandbox_id: str, pid: int, signal: int) -> ProcessInfo:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            return await record.sandbox.guest.kill_process(pid, signal)

    async def process_output(self, sandbox_id: str, pid: int) -> ProcessOutput:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            return await record.sandbox.guest.process_output(pid)

    async def read_file(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        """The file's bytes; the first chunk is read before this returns, so a missing file raises here."""
        record = self.get(sandbox_id)
        return await self._first_then_rest(record, record.sandbox.guest.iter_file(path))

    async def write_file(self, sandbox_id: str, path: str, data: AsyncIterable[bytes],
                         mode: int | None = None) -> FileInfo:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            return await record.sandbox.guest.write_file(path, data, mode=mode)

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileInfo]:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            return await record.sandbox.guest.list_dir(path)

    async def stat(self, sandbox_id: str, path: str) -> FileInfo:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            return await record.sandbox.guest.stat(path)

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True) -> FileInfo:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            return await record.sandbox.guest.mkdir(path, parents=parents)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            await record.sandbox.guest.remove(path, recursive=recursive)

    async def export_archive(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        """A tar stream of ``path``; like :meth:`read_file`, a failure to start raises here."""
        record = self.get(sandbox_id)
        return await self._first_then_rest(record, record.sandbox.guest.tar_export(path))

    async def import_archive(self, sandbox_id: str, path: str, data: AsyncIterable[bytes]) -> None:
        record = self.get(sandbox_id)
        with self._guest_call(record):
            await record.sandbox.guest.tar_import(path, data)

    async def _first_then_rest(self, record: SandboxRecord,
                               chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        with self._guest_call(record):
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                first = b""

        async def rest() -> AsyncGenerator[bytes, None]:
            try:
                if first:
                    yield first
                with self._guest_call(record):
                    async for chunk in chunks:
                        yield chunk
            finally:
                await chunks.aclose()

        return rest()
