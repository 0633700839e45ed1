"""API key authentication, tenant scoping and the bootstrap admin key."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

from capsa.control.audit import trail as audit_trail
from capsa.control.errors import Forbidden, Unauthorized
from capsa.control.keys import generate_key, hash_key, parse_key, verify_key
from capsa.control.store.db import DbSession
from capsa.control.store.models import ApiKeyRow, utcnow
from capsa.control.ttl_cache import TtlCache

__all__ = ["KeyCache", "Principal", "authenticate", "authenticate_cached", "bearer_token",
           "ensure_bootstrap_key", "key_principal", "require_admin"]


@dataclass(frozen=True)
class Principal:
    key_id: str
    tenant: str
    admin: bool


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def authenticate(db: DbSession, token: str | None) -> Principal:
    parsed = parse_key(token) if token else None
    if parsed is None:
        raise Unauthorized()
    row = await db.get(ApiKeyRow, parsed.key_id)
    # The hash is compared even for unknown ids' absent rows would leak timing only about the id, which is
    # public anyway (it is shown in key lists).
    if row is None or row.revoked_at is not None or not verify_key(parsed.full, row.secret_hash):
        raise Unauthorized()
    audit_trail.identify(row.tenant, row.id)
    return Principal(row.id, row.tenant, row.admin)


@dataclass(frozen=True)
class _KnownKey:
    secret_hash: str
    tenant: str
    admin: bool
    revoked: bool


class KeyCache(TtlCache[str, _KnownKey]):
    """API key records as this replica last read them, trusted for at most ``ttl`` seconds (at most
    ``capacity`` keys, least recently used dropped first), so a call does not read the database to learn
    who is calling. A key revoked through this replica is forgotten at once (:meth:`forget`); one revoked
    through another replica keeps working here for up to ``ttl``. Unknown key ids are never cached (a
    key created elsewhere works at once). ``ttl`` 0 disables it."""

    def store(self, row: ApiKeyRow) -> _KnownKey:
        known = _KnownKey(row.secret_hash, row.tenant, row.admin, row.revoked_at is not None)
        self.put(row.id, known)
        return known


async def _known(db: async_sessionmaker[DbSession], cache: KeyCache, key_id: str) -> _KnownKey:
    """The key's record through ``cache`` (the database is read only for keys not seen within its ttl);
    ``Unauthorized`` for an unknown or revoked key."""
    known = cache.lookup(key_id)
    if known is None:
        async with db() as session:
            row = await session.get(ApiKeyRow, key_id)
        if row is None:
            raise Unauthorized()
        known = cache.store(row)
    if known.revoked:
        raise Unauthorized()
    return known


async def authenticate_cached(db: async_sessionmaker[DbSession], cache: KeyCache,
                              token: str | None) -> Principal:
    """:func:`authenticate` through ``cache``: the database is read only for keys not seen within its
    ttl. The secret is checked against the stored hash on every call."""
    parsed = parse_key(token) if token else None
    if parsed is None:
        raise Unauthorized()
    known = await _known(db, cache, parsed.key_id)
    if not verify_key(parsed.full, known.secret_hash):
        raise Unauthorized()
    audit_trail.identify(known.tenant, parsed.key_id)
    return Principal(parsed.key_id, known.tenant, known.admin)


async def key_principal(db: async_sessionmaker[DbSession], cache: KeyCache, key_id: str) -> Principal:
    """Who the key ``key_id`` speaks for, its secret already proven another way (a credential derived
    from it): through ``cache``; ``Unauthorized`` for an unknown or revoked key."""
    known = await _known(db, cache, key_id)
    audit_trail.identify(known.tenant, key_id)
    return Principal(key_id, known.tenant, known.admin)


def require_admin(principal: Principal) -> Principal:
    if not principal.admin:
        raise Forbidden("this route needs an admin API key")
    return principal


async def ensure_bootstrap_key(db: DbSession, configured: str | None, tenant: str) -> str | None:
    """Install the configured admin key, or generate one if no key exists yet.

    Returns the full key only when it was generated now (the one time it can be shown), else None.
    """
    if configured:
        parsed = parse_key(configured)
        if parsed is None:
            raise ValueError("CAPSA_BOOTSTRAP_KEY must look like csk_<12 chars>_<32 chars>")
        existing = await db.get(ApiKeyRow, parsed.key_id)
        if existing is not None:
            if not verify_key(parsed.full, existing.secret_hash):
                raise ValueError("CAPSA_BOOTSTRAP_KEY's id exists with a different secret")
            return None
        db.add(ApiKeyRow(id=parsed.key_id, secret_hash=hash_key(parsed.full), tenant=tenant, admin=True,
                         name="bootstrap", created_at=utcnow()))
        try:
            await db.commit()
        except IntegrityError:  # another replica installed it at the same moment
            await db.rollback()
        return None
    count = (await db.execute(select(func.count()).select_from(ApiKeyRow))).scalar_one()
    if count:
        return None
    key = generate_key()
    db.add(ApiKeyRow(id=key.key_id, secret_hash=hash_key(key.full), tenant=tenant, admin=True,
                     name="bootstrap", created_at=utcnow()))
    await db.commit()
    return key.full
