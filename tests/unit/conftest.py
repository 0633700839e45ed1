"""Fixtures of the unit suite: the control plane and node stack with a fake runtime, on every database
(``db_url`` and ``pg_cluster`` are in tests/conftest.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grimp
import pytest

from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.api.app import create_node_app
from tests.support.api_stack import ApiStack, serve_app
from tests.support.fake_runtime import FakeRuntime, fake_image
from tests.support.import_graph import build_graph


@pytest.fixture
async def make_stack(db_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[ApiStack]]]:
    """Factory: ``await make_stack(settings={...}, capacity=...)``; every stack is stopped afterwards."""
    stacks: list[ApiStack] = []

    async def factory(**kwargs: Any) -> ApiStack:
        runtime = FakeRuntime()
        stack = ApiStack(db_url, runtime, fake_image(tmp_path / "image"), **kwargs)
        stacks.append(stack)
        return await stack.start()

    try:
        yield factory
    finally:
        for s in stacks:
            await s.stop()


@pytest.fixture(scope="session")
def capsa_imports() -> grimp.ImportGraph:
    """capsa's import graph, read once for the layout tests (:mod:`tests.support.import_graph`)."""
    return build_graph()


NODE_TOKEN = "node-token-0123456789"


@pytest.fixture
async def node_url(tmp_path: Path) -> AsyncIterator[str]:
    """A node agent (fake runtime) whose API uvicorn serves on a Unix socket, as in ``capsa serve``
    (WebSocket routes need a real server); its token is ``NODE_TOKEN``."""
    agent = NodeAgent(FakeRuntime(), fake_image(tmp_path / "img"), node_id="n-served",
                      capacity=NodeCapacity(memory_mib=2048, vcpus=8, max_sandboxes=4))
    await agent.start()
    sock_dir = Path(tempfile.mkdtemp(prefix="capsa-node-served-"))
    replica = await serve_app(create_node_app(agent, NODE_TOKEN), uds=str(sock_dir / "node.sock"),
                              lifespan="off")
    try:
        yield replica.url
    finally:
        await replica.stop()
        await agent.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture
async def stack(db_url: str, tmp_path: Path) -> AsyncIterator[ApiStack]:
    """A started stack with a fake runtime on ``db_url``."""
    runtime = FakeRuntime()
    async with ApiStack(db_url, runtime, fake_image(tmp_path / "image")) as s:
        yield s

