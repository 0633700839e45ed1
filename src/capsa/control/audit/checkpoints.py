"""Checkpointing the tenant audit chains: periodically (``CAPSA_AUDIT_CHECKPOINT_INTERVAL``), on demand
(``POST /v1/audit/checkpoints``) and when a replica stops, each tenant's head is signed and appended to the
anchor outside the database (:mod:`capsa.control.audit.anchor`).

A head is checkpointed only if the chain still holds the last checkpointed event and every event after
it links and hashes correctly up to the head: a checkpoint never vouches for a chain that was cut or
rewritten since the previous one.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import select

from capsa.common.audit_chain import event_hash
from capsa.common.audit_checkpoint import Checkpoint
from capsa.control.audit.anchor import Checkpointer
from capsa.control.audit.trail import row_fields
from capsa.control.plane import ControlPlane
from capsa.control.store.audit_models import AuditHeadRow, AuditTrailRow
from capsa.control.store.db import DbSession

__all__ = ["ChainNotExtended", "checkpoint_all", "checkpoint_tenant", "extends", "run_checkpoints"]

log = logging.getLogger(__name__)


class ChainNotExtended(Exception):
    """The chain no longer continues the tenant's last checkpoint (cut or rewritten): not signed."""


async def extends(db: DbSession, tenant: str, since: Checkpoint | None, seq: int, digest: str) -> None:
    """Check that the stored chain runs from ``since`` (or its first stored event) to event ``seq`` with
    hash ``digest``: each event present, linked and hashed as stored. Raises :class:`ChainNotExtended`."""
    after = since.seq if since is not None else 0
    if seq < after:
        raise ChainNotExtended(f"the chain's head is event {seq}, before checkpoint {since.n if since else 0}"
                               f"'s event {after}")
    prev = since.hash if since is not None else None
    expected = after + 1
    if since is not None and seq == after:
        if digest != since.hash:
            raise ChainNotExtended(f"event {seq} differs from the one checkpoint {since.n} vouches for")
        return
    rows = (await db.execute(select(AuditTrailRow).where(AuditTrailRow.tenant == tenant,
                                                         AuditTrailRow.seq > after,
                                                         AuditTrailRow.seq <= seq)
                             .order_by(AuditTrailRow.seq))).scalars()
    last = after
    for row in rows:
        if prev is None:  # no checkpoint yet: start at the first stored event
            expected, prev = row.seq, row.prev_hash
        if row.seq != expected or row.prev_hash != prev or event_hash(row_fields(row)) != row.hash:
            raise ChainNotExtended(f"event {expected} is missing or does not check out")
        expected, prev, last = row.seq + 1, row.hash, row.seq
    if last != seq or prev != digest:
        raise ChainNotExtended(f"the chain does not reach its head (event {seq})")


async def checkpoint_tenant(plane: ControlPlane, checkpointer: Checkpointer, tenant: str,
                            force: bool = False) -> Checkpoint | None:
    """Sign the tenant's head if it moved since its last checkpoint (``force``: even if not; a tenant
    with no events yet gets a checkpoint of the empty chain). None when nothing was written."""
    async with plane.db() as db:
        head = (await db.execute(select(AuditHeadRow.seq, AuditHeadRow.hash)
                                 .where(AuditHeadRow.tenant == tenant))).one_or_none()
        last = await checkpointer.highest(tenant)
        if head is None:
            if last is not None:
                raise ChainNotExtended(f"the tenant's chain and head are gone, checkpoint {last.n} "
                                       f"vouches for event {last.seq}")
            if not force:
                return None
            seq, digest = 0, "0" * 64
        else:
            seq, digest = int(head[0]), str(head[1])
            if last is not None and last.seq == seq and last.hash == digest and not force:
                return None
            await extends(db, tenant, last, seq, digest)
    return await checkpointer.write(tenant, seq, digest)


async def checkpoint_all(plane: ControlPlane, checkpointer: Checkpointer) -> int:
    """Checkpoint every tenant whose chain moved; returns how many checkpoints were written. A tenant
    whose chain no longer continues its checkpoint is logged (verification names it) and skipped."""
    await plane.audit.flush()
    async with plane.db() as db:
        tenants = set((await db.execute(select(AuditHeadRow.tenant))).scalars())
    written = 0
    for tenant in sorted(tenants | set(await checkpointer.tenants())):
        try:
            written += await checkpoint_tenant(plane, checkpointer, tenant) is not None
        except ChainNotExtended as exc:
            log.error("audit chain of tenant %s not checkpointed: %s", tenant, exc)
    return written


async def run_checkpoints(plane: ControlPlane, checkpointer: Checkpointer, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await checkpoint_all(plane, checkpointer)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("audit checkpoint pass failed; retrying next interval")
