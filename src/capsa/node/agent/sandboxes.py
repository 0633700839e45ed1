"""The node's sandbox records and its capacity bookkeeping, in one place for every way a sandbox is made.

:class:`SandboxTable` holds the live :class:`SandboxRecord` s, the capacity reserved for sandboxes still
being made (cold boot, template restore, snapshot restore, branch), the ids whose destroy was asked for
while they were being made, and the ids whose VM died. The agent is its only user; no other part of the
node touches these.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from capsa.common.errors import CapsaError
from capsa.common.ids import is_id
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.agent.host_memory import MemoryGuard
from capsa.node.runtime.base import Sandbox, SandboxState

__all__ = ["SandboxRecord", "SandboxTable"]

log = logging.getLogger(__name__)


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
    source: str = "boot"
    """How it was made: ``boot`` (cold boot), ``pool`` (bound from the warm pool) or ``restore``."""
    snapshot: str | None = None
    """The snapshot (template's or session's) it was restored from; None for a cold boot."""
    create_ms: float | None = None
    nic_mac: str | None = None
    """The MAC of its NIC (networked sandboxes): recorded in its snapshots."""

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "template": self.template, "memory_mib": self.memory_mib, "vcpus": self.vcpus,
                "state": str(self.sandbox.state), "failure": self.sandbox.failure,
                "accelerator": str(self.sandbox.accelerator), "created_at": self.created_at,
                "source": self.source, "snapshot": self.snapshot, "create_ms": self.create_ms}


class SandboxTable:
    """Live records, reservations of sandboxes being made, pending destroys and failures."""

    def __init__(self, capacity: NodeCapacity, guard: MemoryGuard | None = None) -> None:
        self.capacity = capacity
        self.guard = guard
        """Admits by the memory the host has left (None: by the declared budget alone)."""
        self._records: dict[str, SandboxRecord] = {}
        self._making: dict[str, tuple[int, int]] = {}  # id -> (memory, vcpus) held while it is made
        self._doomed: set[str] = set()  # destroy asked for while it was being made
        self._failed: set[str] = set()

    def used(self) -> dict[str, int]:
        records = list(self._records.values())
        return {
            "memory_mib": sum(r.memory_mib for r in records) + sum(m for m, _ in self._making.values()),
            "vcpus": sum(r.vcpus for r in records) + sum(c for _, c in self._making.values()),
            "sandboxes": len(records) + len(self._making),
        }

    @contextlib.contextmanager
    def reserve(self, ids: Sequence[str], memory_mib: int, vcpus: int) -> Iterator[None]:
        """Check new sandbox ids and hold capacity for each of them while the block makes them."""
        for sid in ids:
            if not is_id(sid, "sbx"):
                raise CapsaError(f"bad sandbox id {sid!r}", code="bad_request", status=400)
            if sid in self._records or sid in self._making:
                raise CapsaError(f"sandbox {sid} exists", code="already_exists", status=409)
        if len(set(ids)) != len(ids):
            raise CapsaError("sandbox ids must be distinct", code="bad_request", status=400)
        used, n = self.used(), len(ids)
        if (used["sandboxes"] + n > self.capacity.max_sandboxes
                or used["memory_mib"] + n * memory_mib > self.capacity.memory_mib
                or used["vcpus"] + n * vcpus > self.capacity.vcpus):
            raise CapsaError("node is full", code="no_capacity", status=503)
        refusal = self.guard.refusal(n, memory_mib, len(self._making)) if self.guard is not None else None
        if refusal is not None:
            raise CapsaError(refusal, code="no_capacity", status=503)
        for sid in ids:
            self._making[sid] = (memory_mib, vcpus)
        try:
            yield
        finally:
            for sid in ids:
                self._making.pop(sid, None)

    def pids(self) -> list[int]:
        """The processes of the live sandboxes."""
        return [pid for r in self._records.values() if (pid := r.sandbox.pid) is not None]

    def adopt(self, record: SandboxRecord) -> bool:
        """Register a made sandbox and watch its VM; False if its destroy was asked for meanwhile (the
        caller destroys it)."""
        sid = record.id
        self._records[sid] = record

        def _died(reason: str) -> None:
            log.warning("sandbox %s died: %s", sid, reason)
            if self._records.get(sid) is record:
                self._failed.add(sid)

        record.sandbox.on_failure(_died)
        return sid not in self._doomed

    def is_making(self, sandbox_id: str) -> bool:
        return sandbox_id in self._making

    def doom(self, sandbox_id: str) -> None:
        """Destroy ``sandbox_id`` as soon as it is made."""
        self._doomed.add(sandbox_id)

    def pop(self, sandbox_id: str) -> SandboxRecord | None:
        self._failed.discard(sandbox_id)
        self._doomed.discard(sandbox_id)
        return self._records.pop(sandbox_id, None)

    def find(self, sandbox_id: str) -> SandboxRecord | None:
        return self._records.get(sandbox_id)

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The live sandbox; a dead one raises ``sandbox_failed``, an unknown one ``sandbox_not_found``."""
        record = self._records.get(sandbox_id)
        if record is None:
            raise CapsaError(f"sandbox {sandbox_id} not found", code="sandbox_not_found", status=404)
        if record.sandbox.state == SandboxState.FAILED or sandbox_id in self._failed:
            self._failed.add(sandbox_id)
            raise CapsaError(f"sandbox {sandbox_id} failed: {record.sandbox.failure or 'VM died'}",
                             code="sandbox_failed", status=409)
        return record

    def records(self) -> list[SandboxRecord]:
        return list(self._records.values())

    def ids(self) -> list[str]:
        return list(self._records)

    def failed(self) -> list[str]:
        return sorted(self._failed)
