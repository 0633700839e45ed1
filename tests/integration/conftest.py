"""Fixtures of the integration suite: the storage pool for snapshotting runtimes, one booted sandbox per
module, the node API of a module's ``agent``, and a ``capsa serve`` process per test module. (VM state
directories and the plain QEMU runtime are in tests/conftest.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from capsa.common.image import GuestImage
from capsa.node.agent.agent import NodeAgent
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import QemuRuntime, QemuSandbox
from capsa.node.storage import StoragePool
from tests.support.leftovers import wait_no_vm_leftovers
from tests.support.node_http import node_api
from tests.support.postgres import PgCluster, temporary_postgres
from tests.support.served import Served, serve_workdir, start_serve
from tests.support.vm import snapshot_pool


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(agent: NodeAgent) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the module's ``agent`` fixture's node API, in process (tests.support.node_http)."""
    async with node_api(agent) as client:
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(runtime: QemuRuntime, guest_image: GuestImage) -> AsyncIterator[QemuSandbox]:
    """One cold-booted 256 MiB sandbox of the plain runtime, shared by the module's tests (which run on the
    module's event loop: ``pytest.mark.asyncio(loop_scope="module")``)."""
    sb = await runtime.boot(VMSpec(image=guest_image, memory_mib=256))
    yield sb
    await runtime.destroy(sb)


@pytest.fixture(scope="module")
def pool(state_dir: Path) -> Iterator[StoragePool]:
    """The storage pool on ``state_dir``: a loop-mounted btrfs image (needs root), destroyed afterwards."""
    with snapshot_pool(state_dir) as p:
        yield p


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """A searchable directory (0755) for a served process's state and logs, removed afterwards."""
    with serve_workdir() as path:
        yield path


@pytest.fixture(scope="module")
def server(workdir: Path) -> Iterator[tuple[Served, str]]:
    """The module's ``capsa serve`` (first start, no warm pool) and its printed bootstrap admin key. Stopped
    with SIGINT afterwards: exits 0 and leaves no VM."""
    served = start_serve(workdir / "state", workdir, env={"CAPSA_BOOTSTRAP_KEY": ""})
    try:
        yield served, served.bootstrap_key()
    finally:
        assert served.stop() == 0, served.errors()
        assert wait_no_vm_leftovers(served.state_dir) == []


@pytest.fixture(scope="module")
def pg() -> Iterator[PgCluster]:
    """A throwaway PostgreSQL cluster for the module's ``capsa control`` processes (multi-host tests)."""
    with temporary_postgres() as cluster:
        yield cluster
