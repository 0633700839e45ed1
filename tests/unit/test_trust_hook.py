"""The trust hook: after a CA install (fast path and slow path alike) the guest's hook runs with the CA
file as its argument, when the guest has one; without one nothing runs and the install still works."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from capsa.node.egress.trust_store import TrustStore
from tests.support.local_guest import local_guest_client

pytestmark = pytest.mark.timeout(120)


async def test_hook_runs_after_each_install_with_the_ca_file() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trust = TrustStore(bundle=str(root / "certs/ca.crt"), ca_file=str(root / "capsa.crt"),
                           hook=str(root / "hook"))
        async with local_guest_client() as (_guest, client):
            assert not await trust.install(client, b"FIRST\n")  # no kept bundle copy yet: the slow path
            assert not (root / "seen").exists()
            (root / "hook").write_text(f'#!/bin/sh\ncat "$1" >> {root}/seen\n')
            (root / "hook").chmod(0o755)
            await trust.install(client, b"SECOND\n")
            assert (root / "seen").read_text() == "SECOND\n"
            assert await trust.install(client, b"THIRD\n")  # the fast path runs it too
            assert (root / "seen").read_text() == "SECOND\nTHIRD\n"
            (root / "hook").write_text("#!/bin/sh\necho broken >&2; exit 3\n")
            with pytest.raises(Exception, match="trust hook failed"):
                await trust.install(client, b"FOURTH\n")
