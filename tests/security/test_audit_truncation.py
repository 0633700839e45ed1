"""Issue 27, M3: someone with write access to the control plane's database (but not to its audit signing
key or its checkpoint log) cuts the tail of a tenant's audit chain and moves ``audit_heads`` back, or
deletes a tenant's chain and head, with raw SQL; ``/v1/audit/verify`` and ``capsa audit verify`` must say
so (``audit_chain_truncated``), a checkpoint forged without the key must be rejected, an untouched chain
must verify, and retention may drop old events only behind a signed checkpoint. The real app on a real
database (SQLite and PostgreSQL) over real HTTP; then ``capsa control`` as a process on its own SQLite
database."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from capsa.cli.main import cli
from capsa.common.audit_checkpoint import Checkpoint, ensure_signing_key, key_id, line_digest, sign_checkpoint
from capsa.control.audit.chain_retention import purge_chain
from capsa.control.keys import generate_key
from capsa.control.plane import ControlPlane
from capsa.control.settings import ControlSettings
from capsa.frontends import build_app
from tests.support.api_stack import Replica, serve_app

pytestmark = [pytest.mark.timeout(180), pytest.mark.postgresql]


@dataclass
class Plane:
    replica: Replica
    admin: str
    key: str
    state: Path
    db_url: str

    @property
    def url(self) -> str:
        return self.replica.url

    @property
    def log(self) -> Path:
        return self.state / "audit-checkpoints.jsonl"

    @property
    def plane(self) -> ControlPlane:
        plane = self.replica.app.state.plane
        assert isinstance(plane, ControlPlane)
        return plane

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"},
                                 timeout=60)

    async def sql(self, *statements: str, **params: Any) -> None:
        engine = create_async_engine(self.db_url)
        try:
            async with engine.begin() as conn:
                for statement in statements:
                    await conn.execute(text(statement), params)
        finally:
            await engine.dispose()

    async def verify(self) -> dict[str, Any]:
        async with self.client() as client:
            answer = await client.get("/v1/audit/verify")
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body

    async def cli(self, *args: str) -> Result:
        env = {"CAPSA_API_URL": self.url, "CAPSA_API_KEY": self.key}
        return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)


@pytest.fixture
async def control(db_url: str, tmp_path: Path) -> AsyncIterator[Plane]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    admin = generate_key().full
    settings = ControlSettings(database_url=db_url, bootstrap_key=admin, reaper_interval=0,
                               audit_ack="durable", audit_checkpoint_interval=0,
                               audit_signing_key_file=ensure_signing_key(state / "audit-signing.key"))
    replica = await serve_app(build_app(settings))
    try:
        async with httpx.AsyncClient(base_url=replica.url, headers={"Authorization": f"Bearer {admin}"}) as c:
            made = await c.post("/v1/keys", json={"tenant": "acme"})
            assert made.status_code == 201, made.text
        yield Plane(replica, admin, str(made.json()["key"]), state, db_url)
    finally:
        await replica.stop()


async def _calls(control: Plane, n: int) -> None:
    async with control.client() as client:
        for _ in range(n):
            assert (await client.get("/v1/sessions")).status_code == 200


async def _checkpoint(control: Plane) -> int:
    async with control.client() as client:
        made = await client.post("/v1/audit/checkpoints")
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["tenant"] == "acme" and body["purpose"] == "head"
    return int(body["seq"])


async def _cut_tail(control: Plane, keep: int) -> None:
    """The attack: two statements, no key needed."""
    await control.sql("DELETE FROM audit_trail WHERE tenant = 'acme' AND seq > :keep",
                      "UPDATE audit_heads SET seq = :keep, hash = (SELECT hash FROM audit_trail WHERE "
                      "tenant = 'acme' AND seq = :keep) WHERE tenant = 'acme'", keep=keep)


async def test_an_untouched_chain_verifies_against_its_checkpoint(control: Plane) -> None:
    await _calls(control, 5)
    seq = await _checkpoint(control)
    await _calls(control, 3)
    result = await control.verify()
    assert result["ok"] and result["code"] is None and result["anchor"] == seq, result
    assert result["head"] > seq
    shown = await control.cli("audit", "verify")
    assert shown.exit_code == 0 and f"anchored by a signed checkpoint at event {seq}" in shown.output


async def test_cutting_the_tail_and_moving_the_head_back_is_detected(control: Plane) -> None:
    await _calls(control, 8)
    seq = await _checkpoint(control)
    assert seq == 8
    await _cut_tail(control, keep=4)
    result = await control.verify()
    assert not result["ok"], result
    assert result["code"] == "audit_chain_truncated" and result["broken_id"] == 5, result
    assert f"vouches for event {seq}" in result["reason"]
    shown = await control.cli("audit", "verify")
    assert shown.exit_code == 1, shown.output
    lines = shown.output.strip().splitlines()
    # (the verify call above is itself event 5 of the cut chain)
    assert len(lines) == 1 and lines[0].startswith("error: audit chain truncated at event 6: "), shown.output
    assert f"vouches for event {seq}" in lines[0]
    # Appending more on top of the cut chain does not hide it: the event the checkpoint names differs.
    await _calls(control, seq)
    again = await control.verify()
    assert not again["ok"] and again["broken_id"] is not None and again["broken_id"] <= seq, again
    # And the checkpointer refuses to sign the rewritten head.
    async with control.client() as client:
        refused = await client.post("/v1/audit/checkpoints")
    assert refused.status_code == 409 and refused.json()["code"] == "audit_chain_broken", refused.text


async def test_deleting_a_tenants_whole_chain_and_head_is_detected(control: Plane) -> None:
    await _calls(control, 3)
    await _checkpoint(control)
    await control.sql("DELETE FROM audit_trail WHERE tenant = 'acme'",
                      "DELETE FROM audit_heads WHERE tenant = 'acme'")
    result = await control.verify()
    assert not result["ok"] and result["code"] == "audit_chain_truncated", result
    assert result["broken_id"] == 1 and "chain is gone" in result["reason"], result


def _forge(control: Plane, key: Ed25519PrivateKey, *, seq: int, digest: str, claimed_key: str | None = None
           ) -> None:
    """Append a checkpoint signed by ``key``, numbered and linked correctly (anyone can compute that)."""
    lines = [json.loads(x) for x in control.log.read_text().splitlines() if x.strip()]
    last = lines[-1]
    previous = Checkpoint(**{k: last[k] for k in ("n", "prev", "tenant", "seq", "hash", "time_us", "purpose",
                                                   "key")})
    forged = Checkpoint(n=previous.n + 1, prev=line_digest(previous), tenant="acme", seq=seq, hash=digest,
                        time_us=previous.time_us + 1, purpose="head",
                        key=claimed_key or key_id(key.public_key()))
    with control.log.open("ab") as f:
        f.write(sign_checkpoint(key, forged))


@pytest.mark.parametrize("claim", ["own-key-id", "our-key-id"])
async def test_a_checkpoint_forged_without_the_key_is_rejected(control: Plane, claim: str) -> None:
    await _calls(control, 8)
    await _checkpoint(control)
    await _cut_tail(control, keep=3)
    engine = create_async_engine(control.db_url)
    try:
        async with engine.connect() as conn:
            head = await conn.execute(text("SELECT hash FROM audit_heads WHERE tenant = 'acme'"))
            head_hash = head.scalar()
    finally:
        await engine.dispose()
    ours = control.plane.checkpoints
    assert ours is not None
    # The forger vouches for the shortened chain, signing with a key of its own.
    _forge(control, Ed25519PrivateKey.generate(), seq=3, digest=str(head_hash),
           claimed_key=ours.key_id if claim == "our-key-id" else None)
    result = await control.verify()
    assert not result["ok"] and result["code"] == "audit_checkpoint_invalid", result
    assert "line 2" in result["reason"], result
    shown = await control.cli("audit", "verify")
    assert shown.exit_code == 1 and shown.output.startswith("error: audit checkpoints do not check out"), \
        shown.output


async def test_removing_the_newest_checkpoint_line_is_detected_by_the_older_one(control: Plane) -> None:
    await _calls(control, 4)
    first = await _checkpoint(control)
    await _calls(control, 4)
    await _checkpoint(control)
    lines = control.log.read_bytes().splitlines(keepends=True)
    control.log.write_bytes(b"".join(lines[:-1]))  # the log's own tail cut too
    await _cut_tail(control, keep=first - 1)
    result = await control.verify()
    assert not result["ok"] and result["code"] == "audit_chain_truncated", result


async def test_retention_drops_old_events_only_behind_a_signed_checkpoint(control: Plane) -> None:
    await _calls(control, 12)
    plane = control.plane
    plane.settings = plane.settings.model_copy(update={"audit_chain_retention_days": 1e-12})
    dropped = await purge_chain(plane, batch=5)
    assert dropped == 5
    assert await purge_chain(plane, batch=5) == 5
    result = await control.verify()
    assert result["ok"] and result["checked"] == result["head"] - 10, result
    retention = [json.loads(x) for x in control.log.read_text().splitlines()]
    assert [(c["purpose"], c["seq"]) for c in retention] == [("retention", 5), ("retention", 10)]
    # Dropping more than a checkpoint vouches for (no key needed to DELETE) is still detected.
    await control.sql("DELETE FROM audit_trail WHERE tenant = 'acme' AND seq = 11")
    broken = await control.verify()
    assert not broken["ok"] and broken["broken_id"] == 11 and broken["code"] == "audit_chain_broken", broken


# --- ``capsa control`` as a process, on its own SQLite database ------------------------------------

_CLI = "from capsa.cli.main import main; main()"
_READY = re.compile(r"capsa: control plane on (http://\S+)")


async def _start_control(state: Path, admin: str) -> tuple[asyncio.subprocess.Process, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSA_")}
    env.update({"CAPSA_BOOTSTRAP_KEY": admin, "CAPSA_AUDIT_ACK": "durable"})
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLI, "control", "--host", "127.0.0.1", "--port", "0", "--state-dir",
        str(state), env=env, stdout=pipe, stderr=pipe)
    assert proc.stdout is not None
    async with asyncio.timeout(60):
        while line := (await proc.stdout.readline()).decode():
            if match := _READY.search(line):
                return proc, match.group(1)
    raise AssertionError("capsa control exited before it was ready")


async def test_capsa_control_sqlite_database_cut_with_two_statements_fails_verify(tmp_path: Path) -> None:
    state, admin = tmp_path / "control", generate_key().full
    proc, url = await _start_control(state, admin)
    try:
        key_file = state / "audit-signing.key"
        assert key_file.exists() and key_file.stat().st_mode & 0o077 == 0
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {admin}"}) as c:
            key = str((await c.post("/v1/keys", json={"tenant": "acme"})).json()["key"])
        env = {"CAPSA_API_URL": url, "CAPSA_API_KEY": key}

        async def run(*args: str) -> Result:
            return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)

        for _ in range(6):
            assert (await run("ls")).exit_code == 0
        made = await run("audit", "checkpoint")
        assert made.exit_code == 0 and "signed by key" in made.output, made.output
        assert (await run("audit", "verify")).exit_code == 0
        with sqlite3.connect(state / "capsa.db") as db:  # the finding's two statements
            db.execute("DELETE FROM audit_trail WHERE tenant = 'acme' AND seq > 3")
            db.execute("UPDATE audit_heads SET seq = 3, hash = (SELECT hash FROM audit_trail WHERE "
                       "tenant = 'acme' AND seq = 3) WHERE tenant = 'acme'")
        shown = await run("audit", "verify")
        assert shown.exit_code == 1, shown.output
        assert shown.output.startswith("error: audit chain truncated at event 4"), shown.output
        assert len(shown.output.strip().splitlines()) == 1
    finally:
        proc.terminate()
        async with asyncio.timeout(30):
            await proc.wait()
