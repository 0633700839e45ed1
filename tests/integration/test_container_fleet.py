"""capsa's container image runs a fleet (issue 30): PostgreSQL, the control plane container and two node
containers started with podman the way the Kubernetes manifests start them, and a session that is created on
node A, runs commands, pauses there and resumes on node B through the store.

How each container is run (the manifests' settings, as podman options):

- the image is ``localhost/capsa:<key>`` from scripts/build_image.py, built from Debian packages and this
  tree without a registry (reused when its inputs are unchanged);
- control plane: ``capsa control``, as the image's user (uid 10001, not root), read-only root filesystem,
  no capabilities, its state directory and /tmp emptyDirs (a host directory owned by 10001, a tmpfs), with
  CAPSA_DATABASE_URL, CAPSA_BOOTSTRAP_KEY and CAPSA_SECRET_KEY as a Secret would give them; ready when
  ``/v1/ready`` answers 200 (at least one node), alive on ``/v1/health``;
- node: ``capsa node --listen ... --advertise-url ...``, as root and privileged (/dev/kvm when there is one,
  loop devices for the btrfs pool, network namespaces and nftables for sandboxes, cgroups), enrolled with a
  token from ``capsa nodes token`` (CAPSA_ENROL_TOKEN: the DaemonSet's shell reads it from a Secret), its
  state directory ``/var/lib/capsa`` a bind mount of a host directory (hostPath), the host's /lib/modules
  read-only when it has one, the store a bind-mounted directory (``file:///store``), QEMU under TCG, no
  warm pool; its image cache (the unpacked guest image, the base template) in the container's own layer;
- every container on the host network (the manifests give each pod its own IP: here the node API and the
  control plane listen on 127.0.0.1 ports of their own, and PostgreSQL is the host's), run by runc with
  the test process's own ulimits (tests/support/containers.py: what these machines need, not capsa);
- everything is stopped with SIGTERM (what the kubelet sends) and must exit 0; then no container, QEMU,
  loop device, mount, network namespace, link or nftables table of the fleet may be left on the host.

What this does not prove about a real cluster: there is no kubelet (no probes acting on readiness or
liveness, no restarts, no termination grace period enforced), no CNI (no pod network, no NetworkPolicy, no
Service in front of the control plane), no scheduler or DaemonSet placement, no Secret or downward API
plumbing (the same values are passed as plain environment variables), no image pull from a registry, one
kernel and one host for both "nodes" (so a node's loss of its host, or nodes with different CPUs or QEMU
versions, are not exercised), TCG instead of KVM, and a directory store instead of object storage.
"""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from capsa.control.keys import generate_key
from capsa.sdk import AsyncClient, AsyncSession
from tests.support.containers import (
    Container,
    build_capsa_image,
    containers_labelled,
    host_snapshot,
    loop_devices_into,
    run_container,
)
from tests.support.counter import counter_past, counter_script, goes_on, session_counter
from tests.support.fleet import enrol_token
from tests.support.leftovers import node_leftovers, node_netns_prefix
from tests.support.postgres import PgCluster
from tests.support.processes import qemu_pids
from tests.support.served import free_port, serve_workdir

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.timeout(3600)]

STATE = Path("/var/lib/capsa")  # the node's state directory inside its container (the contract's)
CONTROL_OPTIONS = ("--user", "10001:10001", "--read-only", "--cap-drop", "ALL",
                   "--security-opt", "no-new-privileges", "--tmpfs", "/tmp:rw,size=2g,mode=1777")
"""The control plane's pod security: uid 10001, read-only root, no capabilities, /tmp an emptyDir (its
state directory, another, is a host directory owned by 10001 as fsGroup makes it)."""
NODE_OPTIONS = ("--user", "0:0", "--privileged")
"""The node's: root and privileged (see deploy/kubernetes's node DaemonSet for why)."""
MODULES = {Path("/lib/modules"): "/lib/modules:ro"} if Path("/lib/modules").is_dir() else {}
"""The host's kernel modules for modprobe, as the DaemonSet mounts them (these hosts' kernels have none)."""
COUNTER = counter_script()


@pytest.fixture(scope="module")
def capsa_image() -> str:
    built = build_capsa_image()
    print(f"image {built['image']}: {int(str(built['size_bytes'])) / 1e6:.0f} MB, "
          f"reused {built['reused']}, {built['seconds']} s")
    return str(built["image"])


@pytest.fixture
def workdir() -> Iterator[Path]:
    with serve_workdir("capsa-containers-") as path:
        yield path


def _uid(container: Container) -> str:
    done = subprocess.run(["podman", "exec", container.name, "id", "-u"], capture_output=True, text=True,
                          check=False, timeout=60)
    return done.stdout.strip()


async def _status(url: str) -> int:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(url)).status_code


async def test_a_session_pauses_on_one_node_container_and_resumes_on_another_through_the_store(
        pg: PgCluster, capsa_image: str, workdir: Path) -> None:
    run_id = secrets.token_hex(4)
    store = workdir / "store"
    store.mkdir()
    needles = [str(workdir), str(STATE), node_netns_prefix(STATE)]
    before = host_snapshot(needles)
    admin, db_url = generate_key().full, pg.new_database()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started: list[Container] = []

    def node(name: str) -> tuple[Container, str]:
        state = workdir / name
        state.mkdir()
        node_port = free_port()
        container = run_container(
            capsa_image, f"capsa-{name}-{run_id}", run_id,
            ["node", "--listen", f"127.0.0.1:{node_port}",
             "--advertise-url", f"http://127.0.0.1:{node_port}"],
            env={"CAPSA_CONTROL_URL": url, "CAPSA_ENROL_TOKEN": enrol_token(url, admin),
                 "CAPSA_STATE_DIR": str(STATE), "CAPSA_STORE_URL": "file:///store", "CAPSA_ACCEL": "tcg",
                 "CAPSA_POOL_SIZE": "0"},
            mounts={state: str(STATE), store: "/store", **MODULES}, options=NODE_OPTIONS)
        started.append(container)
        registered = container.wait_for_line(" registered", timeout=900)
        container.wait_http(f"http://127.0.0.1:{node_port}/node/v1/health")
        return container, registered.split()[1]

    codes: dict[str, int] = {}
    try:
        control_state = workdir / "control"
        control_state.mkdir()
        os.chown(control_state, 10001, 10001)
        control = run_container(
            capsa_image, f"capsa-control-{run_id}", run_id,
            ["control", "--host", "127.0.0.1", "--port", str(port)],
            env={"CAPSA_DATABASE_URL": db_url, "CAPSA_BOOTSTRAP_KEY": admin,
                 "CAPSA_SECRET_KEY": base64.b64encode(os.urandom(32)).decode(),
                 "CAPSA_ALLOW_INSECURE_NODE_URLS": "1", "CAPSA_STATE_DIR": str(STATE)},
            mounts={control_state: str(STATE)}, options=CONTROL_OPTIONS)
        started.append(control)
        control.wait_http(f"{url}/v1/health")
        assert await _status(f"{url}/v1/ready") == 503  # no node yet
        assert _uid(control) == "10001"

        t0 = time.monotonic()
        node_a, id_a = node("node-a")
        timings = {"node A up (guest image unpacked, base template built)": time.monotonic() - t0}
        assert _uid(node_a) == "0"
        assert await _status(f"{url}/v1/ready") == 200
        async with AsyncClient(url, admin) as client:
            t0 = time.monotonic()
            session = await AsyncSession.create(timeout=900, client=client)
            timings["create"] = time.monotonic() - t0
            assert (await client.get_session(session.id)).node_id == id_a
            ran = await session.commands.run("echo hello from $(hostname)")
            assert ran.exit_code == 0 and ran.stdout.startswith("hello from "), ran
            await session.files.write("/root/note", "kept on a\n")
            await session.commands.run(COUNTER, background=True)
            counted = await counter_past(lambda: session_counter(session), 4)
            t0 = time.monotonic()
            await session.pause()
            timings["pause (to the store)"] = time.monotonic() - t0
            [snap] = await client.list_snapshots(session.id)
            assert snap.kind == "pause" and snap.node_id == id_a and snap.stored
            assert any(store.rglob("*")), "nothing was written to the store"

            t0 = time.monotonic()
            _, id_b = node("node-b")
            timings["node B up"] = time.monotonic() - t0
            codes[node_a.name] = node_a.stop()
            started.remove(node_a)
            node_a.remove()
            assert node_leftovers(workdir / "node-a", netns_prefix=node_netns_prefix(STATE)) == []
            assert loop_devices_into(workdir / "node-a") == []

            t0 = time.monotonic()
            resumed = await AsyncSession.resume(session.id, client=client)
            timings["resume on node B (from the store)"] = time.monotonic() - t0
            info = await client.get_session(session.id)
            assert info.state == "running" and info.node_id == id_b
            assert await resumed.files.read("/root/note") == "kept on a\n"
            await goes_on(lambda: session_counter(resumed), counted)  # from where it was on node A
            assert (await resumed.commands.run("cat /root/note")).stdout == "kept on a\n"
            await resumed.close()
            print(", ".join(f"{what}: {took:.1f} s" for what, took in timings.items()))
    finally:
        for container in reversed(started):
            codes[container.name] = container.stop()
            if codes[container.name] != 0:
                print(container.logs()[-4000:])
            container.remove()
    assert all(code == 0 for code in codes.values()), codes
    assert containers_labelled(run_id) == []
    assert qemu_pids(STATE) == [] and qemu_pids(workdir) == []
    for name in ("node-a", "node-b"):
        assert node_leftovers(workdir / name, netns_prefix=node_netns_prefix(STATE)) == []
    assert loop_devices_into(workdir) == []
    assert host_snapshot(needles).added_since(before) == []
