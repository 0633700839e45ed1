"""Per-sandbox namespaces, taps and nftables rules on the real kernel: creation, contents, teardown."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess

import pytest

from capsa.node.net import sandbox_net
from capsa.node.net.sandbox_net import NetError, NetworkManager
from capsa.node.net.wire import open_tap

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and nftables"),
]


def _sh(*argv: str) -> str:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True).stdout


def _sid() -> str:
    return "sbx_" + secrets.token_hex(10)


async def test_create_inspect_destroy() -> None:
    manager = NetworkManager()
    net = await manager.create(_sid())
    try:
        assert net.netns in _sh("ip", "netns", "list")
        assert net.tap not in _sh("ip", "-o", "link")  # the tap lives only inside the namespace
        links = json.loads(_sh("ip", "-n", net.netns, "-j", "addr"))
        tap = next(link for link in links if link["ifname"] == net.tap)
        assert "UP" in tap["flags"]
        assert [(a["local"], a["prefixlen"]) for a in tap["addr_info"]] == [(net.gateway_ip, 30)]
        assert not any(a["family"] == "inet6" for link in links for a in link["addr_info"])
        assert _sh("ip", "netns", "exec", net.netns, "sysctl", "-n", "net.ipv4.ip_forward").strip() == "0"
        routes = _sh("ip", "-n", net.netns, "route")
        assert "default" not in routes  # nowhere to go but the node services
        rules = _sh("ip", "netns", "exec", net.netns, "nft", "list", "ruleset")
        assert f"dnat ip to {net.gateway_ip}:{net.ports.tls}" in rules
        assert f"dnat ip to {net.gateway_ip}:{net.ports.http}" in rules
        assert "ether type ip6" in rules and f"ip saddr != {net.guest_ip}" in rules
        assert "hook forward priority filter; policy drop;" in rules
        assert "hook input priority filter; policy drop;" in rules
        counters = await manager.drop_counters(net)
        assert set(counters) == set(sandbox_net.DROP_COUNTERS) and not any(counters.values())
        assert net.guest_config()["address"] == f"{net.guest_ip}/30"
        assert net.proxy_url == f"http://{net.gateway_ip}:3128"
    finally:
        await manager.destroy(net)
    assert await manager.leftovers(net) == []
    assert net.netns not in _sh("ip", "netns", "list")
    assert net.tap not in _sh("ip", "-o", "link")
    assert "capsa" not in _sh("nft", "list", "tables")  # nothing ever leaked into the node's own ruleset
    await manager.destroy(net)  # idempotent


async def test_sandboxes_share_one_address_each_alone_in_its_namespace() -> None:
    manager = NetworkManager()
    a = await manager.create(_sid())
    b = await manager.create(_sid())
    try:
        # The same guest and gateway address (a snapshot restored anywhere keeps its address) ...
        assert (a.guest_ip, a.gateway_ip) == (b.guest_ip, b.gateway_ip)
        assert a.tap != b.tap and a.netns != b.netns
        # ... in namespaces that hold only their own tap: nothing of b is reachable from a's.
        links = _sh("ip", "-n", a.netns, "-o", "link")
        assert a.tap in links and b.tap not in links and len(links.strip().splitlines()) == 2  # lo + tap
        routes = _sh("ip", "-n", a.netns, "-4", "route").strip().splitlines()
        assert len(routes) == 1 and f"dev {a.tap} " in routes[0] and "default" not in routes[0], routes
    finally:
        await manager.destroy(a)
        await manager.destroy(b)
    assert await manager.leftovers(a) == [] and await manager.leftovers(b) == []


@pytest.mark.parametrize("bad", ["", "../etc", "a b", "x" * 60, "sbx;reboot"])
async def test_bad_sandbox_ids_refused(bad: str) -> None:
    with pytest.raises(NetError) as info:
        await NetworkManager().create(bad)
    assert info.value.status == 422


async def test_duplicate_refused() -> None:
    manager = NetworkManager()
    sid = _sid()
    net = await manager.create(sid)
    try:
        with pytest.raises(NetError) as info:
            await manager.create(sid)
        assert info.value.code == "conflict"
    finally:
        await manager.destroy(net)


async def test_failed_creation_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = NetworkManager()
    monkeypatch.setattr(sandbox_net, "render_ruleset", lambda _net: "this is not nftables\n")
    sid = _sid()
    with pytest.raises(NetError, match="failed"):
        await manager.create(sid)
    assert manager.netns_name(sid) not in _sh("ip", "netns", "list")
    monkeypatch.undo()
    net = await manager.create(sid)  # the id and subnet were released
    await manager.destroy(net)


async def test_cleanup_stale() -> None:
    # A private prefix: cleanup must never touch namespaces of other node agents or test runs.
    prefix = f"capsa-t{secrets.token_hex(3)}-"
    crashed = NetworkManager(netns_prefix=prefix)
    keep_net = await crashed.create(_sid())
    lost_net = await crashed.create(_sid())
    fresh = NetworkManager(netns_prefix=prefix)
    removed = await fresh.cleanup_stale(keep={keep_net.sandbox_id})
    try:
        assert lost_net.netns in removed and keep_net.netns not in removed
        assert lost_net.netns not in _sh("ip", "netns", "list")
    finally:
        await crashed.destroy(keep_net)
        await crashed.destroy(lost_net)


async def test_egress_service_attach_detach() -> None:
    from capsa.common.egress_policy import EgressPolicy
    from capsa.node.egress.audit import ListSink
    from capsa.node.egress.broker import EgressBroker
    from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
    from capsa.node.egress.service import EgressService

    sink = ListSink()
    store = InMemorySecretStore(SecretBox(os.urandom(32)), {"sec_x": "the-real-value"})
    service = EgressService(NetworkManager(), EgressBroker(secrets=store, sink=sink), sink,
                            poll_interval=0.1)
    policy = EgressPolicy.from_data({"domains": [{"domain": "api.example.com"}],
                                     "secrets": [{"secret": "sec_x", "domain": "api.example.com",
                                                  "env": "EXAMPLE_KEY"}]})
    fds_before = len(os.listdir("/proc/self/fd"))
    try:
        with_net = await service.attach(_sid(), policy, session_id="ses_1")
        without = await service.attach(_sid(), None)
        listening = _sh("ip", "netns", "exec", with_net.net.netns, "ss", "-ltnuH")
        for port in (8080, 8443, 3128, 53):
            assert f"{with_net.net.gateway_ip}:{port}" in listening
        assert _sh("ip", "netns", "exec", without.net.netns, "ss", "-ltnuH").strip() == ""
        assert with_net.env["HTTPS_PROXY"] == with_net.net.proxy_url
        assert with_net.env["NO_PROXY"] == with_net.env["no_proxy"] == "localhost,127.0.0.1,::1"
        assert with_net.env["EXAMPLE_KEY"].startswith("capsa_ph_")
        assert "the-real-value" not in repr(with_net)
        assert with_net.ca_pem.startswith(b"-----BEGIN CERTIFICATE-----")
        assert not without.networked and without.env == {} and without.ca_pem == b""
        for attached in (with_net, without):
            await service.detach(attached.net.sandbox_id)
            assert attached.net.netns not in _sh("ip", "netns", "list")
        await service.detach(with_net.net.sandbox_id)  # idempotent
        # No socket left behind: a leaked one would keep the deleted namespace (and its tap) alive.
        assert len(os.listdir("/proc/self/fd")) == fds_before
    finally:
        await service.close()


@pytest.mark.parametrize("uid", [None, 65534])
async def test_qemu_attaches_to_the_tap(uid: int | None) -> None:
    """As the runtime does it: the node opens the tap inside the namespace and hands the queue fd to
    QEMU, which may then run unprivileged (here: as nobody) and needs no access to /dev/net/tun."""
    manager = NetworkManager()
    net = await manager.create(_sid())
    fd = open_tap(net.netns, net.tap)
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
    try:
        proc = await asyncio.create_subprocess_exec(
            *drop, "qemu-system-x86_64", "-M", "microvm", "-S", "-nodefaults", "-no-user-config",
            "-display", "none", "-accel", "tcg",
            "-netdev", f"tap,id=n0,fd={fd},vhost=off",
            "-device", f"virtio-net-device,netdev=n0,mac={net.mac}",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, pass_fds=(fd,))
    finally:
        os.close(fd)
    try:
        await asyncio.sleep(1.0)
        assert proc.returncode is None, (await proc.communicate())[1]
        link = json.loads(_sh("ip", "-n", net.netns, "-j", "link", "show", net.tap))[0]
        assert "LOWER_UP" in link["flags"]  # QEMU holds the queue: carrier is up
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()
        await manager.destroy(net)
    assert await manager.leftovers(net) == []


async def test_tap_owner() -> None:
    manager = NetworkManager()
    net = await manager.create(_sid(), tap_owner=65534)
    try:
        details = json.loads(_sh("ip", "-n", net.netns, "-d", "-j", "link", "show", net.tap))[0]
        assert details["linkinfo"]["info_data"]["user"] in (65534, "nobody")
    finally:
        await manager.destroy(net)
    with pytest.raises(NetError):
        await manager.create(_sid(), tap_owner=-1)
