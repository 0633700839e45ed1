"""Template RAM shared within a tenant (issue 31, ``CAPSA_TEMPLATE_SHARING=tenant``), with real VMs: sessions
of one tenant restored from a template map one sealed copy of its RAM, another tenant's map their own, a
guest's writes stay its own through a pause and resume, and no QEMU can write what it shares. Pages are
measured from /proc, not assumed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from capsa.common.ids import new_id
from capsa.common.image import GuestImage
from capsa.node.agent.agent import NodeAgent
from capsa.node.runtime.qemu import QemuRuntime, QemuSandbox
from capsa.node.runtime.snapshot.mechanics import LABEL_RAM_DELTA
from capsa.node.storage import StoragePool
from capsa.node.templates.source import TemplateSource
from tests.support.memfd_attack import assert_qemu_cannot_write, ram_memfd_mapping
from tests.support.node_http import ok, sh
from tests.support.vm import template_node

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.asyncio(loop_scope="module"),
]



@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(state_dir: Path, pool: StoragePool, guest_image: GuestImage) -> AsyncIterator[NodeAgent]:
    async with template_node(state_dir, pool, guest_image, pool_size=0, sharing="tenant") as node:
        yield node


def _memfd(pid: int) -> tuple[int, int]:
    """(inode, KiB of its pages other processes map too) of QEMU ``pid``'s template memfd."""
    inode, fields = ram_memfd_mapping(pid)
    return inode, fields["Shared_Clean"] + fields["Shared_Dirty"]


async def test_one_tenants_sessions_share_the_templates_pages_and_another_tenants_do_not(
        agent: NodeAgent, api: httpx.AsyncClient) -> None:
    ids = {"a1": new_id("sbx"), "a2": new_id("sbx"), "b1": new_id("sbx")}
    for name, sid in ids.items():
        tenant = "acme" if name.startswith("a") else "zeta"
        made = await ok(await api.post("/sandboxes", json={"id": sid, "tenant": tenant}), 201)
        assert made["source"] == "restore"
    vms = {name: agent.get(sid).sandbox for name, sid in ids.items()}
    assert all(isinstance(vm, QemuSandbox) and vm.pid for vm in vms.values())
    maps = {name: _memfd(vm.pid) for name, vm in vms.items() if vm.pid}
    assert maps["a1"][0] == maps["a2"][0] != maps["b1"][0]  # one copy per tenant
    assert maps["a1"][1] >= 8 * 1024 and maps["a2"][1] >= 8 * 1024, maps  # measured: shared pages
    assert maps["b1"][1] == 0, maps  # zeta's only session shares no page with anyone

    # A write in one of acme's sessions is invisible to the other, and survives its pause and resume.
    await sh(api, ids["a1"], "head -c 4M /dev/urandom > /dev/shm/mine; md5sum /dev/shm/mine > /root/sum")
    assert "mine" not in await sh(api, ids["a2"], "ls /dev/shm")
    snap = await ok(await api.post(f"/sandboxes/{ids['a1']}/pause", json={}))
    runtime = agent.runtime
    assert isinstance(runtime, QemuRuntime)
    paused = runtime.open_snapshot(snap["id"])  # only the pages that differ from the template
    assert paused.manifest.labels[LABEL_RAM_DELTA] and paused.manifest.ram is not None
    assert (paused.path / "state.bin").stat().st_size < 32 << 20
    resumed = new_id("sbx")
    await ok(await api.post(f"/snapshots/{snap['id']}/restore", json={"id": resumed}), 201)
    assert await sh(api, resumed, "md5sum -c /root/sum") == "/dev/shm/mine: OK\n"

    # No QEMU can write the template's RAM file or the copy it maps, even through its own descriptor.
    a2 = vms["a2"]
    assert isinstance(a2, QemuSandbox) and a2.vm_uid is not None
    source = agent.source
    assert isinstance(source, TemplateSource)
    ram = (await source.store.resolve("base")).snapshot.path / "memory.ram"
    assert a2.pid is not None
    assert_qemu_cannot_write(a2.pid, a2.vm_uid, ram)
    for sid in (ids["a2"], ids["b1"], resumed):
        await ok(await api.delete(f"/sandboxes/{sid}"), 204)
