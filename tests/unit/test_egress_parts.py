"""DNS codec, secrets at rest, the per-sandbox CA and address screening."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path

import pytest

from capsa.common.addresses import _read_local_addresses, is_public_address, node_addresses
from capsa.node.egress import dnswire
from capsa.node.egress.ca import MAX_LEAVES, SandboxCA, constraint_names, leaf_name
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox, SecretError, new_placeholder


def test_dns_query_roundtrip() -> None:
    q = dnswire.parse_query(dnswire.build_query(1234, "Api.Example.COM"))
    assert (q.id, q.name, q.qtype) == (1234, "api.example.com", dnswire.QTYPE_A)
    reply = dnswire.build_response(q, dnswire.NOERROR, ["10.0.0.1", "192.0.2.9"])
    assert dnswire.parse_a_answers(reply, 1234, "api.example.com") == (0, ["10.0.0.1", "192.0.2.9"])
    nx = dnswire.build_response(q, dnswire.NXDOMAIN)
    assert dnswire.parse_a_answers(nx, 1234, "api.example.com") == (dnswire.NXDOMAIN, [])
    assert nx[3] & 0x80 == 0  # recursion is never available


@pytest.mark.parametrize("data", [
    b"", b"\x00" * 11,
    dnswire.build_query(1, "a.test")[:-3],  # truncated question
    b"\x00\x01\x81\x00" + b"\x00\x01\x00\x00\x00\x00\x00\x00" + b"\x01a\x00\x00\x01\x00\x01",  # a response
    b"\x00\x01\x01\x00\x00\x02\x00\x00\x00\x00\x00\x00" + b"\x01a\x00\x00\x01\x00\x01" * 2,  # two questions
    b"\x00\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + b"\xc0\x0c\x00\x01\x00\x01",  # pointer loop
])
def test_dns_malformed_queries_refused(data: bytes) -> None:
    with pytest.raises(dnswire.DnsFormatError):
        dnswire.parse_query(data)


def test_dns_response_for_other_query_refused() -> None:
    q = dnswire.parse_query(dnswire.build_query(7, "a.test"))
    reply = dnswire.build_response(q, 0, ["192.0.2.1"])
    with pytest.raises(dnswire.DnsFormatError):
        dnswire.parse_a_answers(reply, 8, "a.test")
    with pytest.raises(dnswire.DnsFormatError):
        dnswire.parse_a_answers(reply, 7, "b.test")


def test_secret_box_roundtrip_and_binding() -> None:
    box = SecretBox(os.urandom(32))
    blob = box.encrypt("sec_1", "hunter2")
    assert b"hunter2" not in blob
    assert box.decrypt("sec_1", blob) == "hunter2"
    with pytest.raises(SecretError, match="cannot be decrypted"):
        box.decrypt("sec_2", blob)  # a ciphertext moved to another record
    with pytest.raises(SecretError, match="cannot be decrypted"):
        SecretBox(os.urandom(32)).decrypt("sec_1", blob)
    with pytest.raises(SecretError, match="malformed"):
        box.decrypt("sec_1", b"\x01short")
    with pytest.raises(SecretError, match="32 bytes"):
        SecretBox(b"short")
    with pytest.raises(SecretError, match="base64"):
        SecretBox.from_b64("not base64!!")
    assert SecretBox.from_b64(SecretBox.generate_key()).decrypt is not None


def test_secret_store_never_shows_values() -> None:
    store = InMemorySecretStore(SecretBox(os.urandom(32)), {"sec_1": "value-123"})
    assert store.reveal("sec_1") == "value-123"
    assert "value-123" not in repr(store)
    with pytest.raises(SecretError) as info:
        store.reveal("sec_missing")
    assert info.value.code == "secret_not_found"
    with pytest.raises(SecretError):
        store.put("sec_2", "")
    a, b = new_placeholder(), new_placeholder()
    assert a != b and a.startswith("capsa_ph_") and len(a) > 30


def _openssl_verify(tmp_path: Path, ca: SandboxCA, host: str, leaf_for: str | None = None
                    ) -> subprocess.CompletedProcess[str]:
    chain = ca._issue(leaf_for or host)
    leaf = chain[: chain.index(b"-----END CERTIFICATE-----") + 26]
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    (tmp_path / "leaf.pem").write_bytes(leaf)
    return subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.pem"), "-verify_hostname", host,
                           str(tmp_path / "leaf.pem")], capture_output=True, text=True)


def test_ca_is_name_constrained(tmp_path: Path) -> None:
    ca = SandboxCA("sbx_test", ["api.example.com", "*.svc.example.org"])
    assert ca.permitted == ["api.example.com", "svc.example.org"]
    assert ca.covers("api.example.com") and ca.covers("a.svc.example.org")
    assert not ca.covers("example.com") and not ca.covers("evil.test")
    assert _openssl_verify(tmp_path, ca, "api.example.com").returncode == 0
    assert _openssl_verify(tmp_path, ca, "x.svc.example.org").returncode == 0
    # One wildcard leaf serves every name one label below the wildcard rule's domain.
    assert leaf_name("x.svc.example.org", wildcard=True) == "*.svc.example.org"
    for name in ("x.svc.example.org", "y.svc.example.org"):
        assert _openssl_verify(tmp_path, ca, name, leaf_for="*.svc.example.org").returncode == 0
    assert _openssl_verify(tmp_path, ca, "a.b.svc.example.org", leaf_for="*.svc.example.org").returncode != 0
    assert leaf_name("a.b.svc.example.org", wildcard=True) == "*.b.svc.example.org"
    assert leaf_name("api.example.com", wildcard=False) == "api.example.com"
    # Even a leaf the CA key did sign is worthless for any other name.
    outside = _openssl_verify(tmp_path, ca, "bank.example.net")
    assert outside.returncode != 0 and "subtree" in (outside.stdout + outside.stderr).lower()


def test_ca_without_domains_vouches_for_nothing(tmp_path: Path) -> None:
    ca = SandboxCA("sbx_empty", [])
    assert _openssl_verify(tmp_path, ca, "anything.example.com").returncode != 0


def test_server_contexts_are_cached() -> None:
    ca = SandboxCA("sbx_test", ["a.test"])
    assert ca.server_context("a.test") is ca.server_context("a.test")
    assert constraint_names(["*.b.test", "b.test", "a.test"]) == ["a.test", "b.test"]


async def test_leaf_cache_is_bounded_and_issues_off_the_loop() -> None:
    ca = SandboxCA("sbx_test", ["*.w.test"])
    first = await ca.context_for("*.n0.w.test")
    for i in range(1, MAX_LEAVES + 20):
        await ca.context_for(f"*.n{i}.w.test")
    assert ca.cached == MAX_LEAVES and ca.issued == MAX_LEAVES + 20
    assert ca.cached_context("*.n0.w.test") is None  # least recently used, dropped
    assert await ca.context_for("*.n0.w.test") is not first and ca.issued == MAX_LEAVES + 21


@pytest.mark.parametrize(("addr", "public"), [
    ("93.184.216.34", True), ("2606:2800:220:1::1", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("255.255.255.255", False),
    ("224.0.0.1", False), ("240.0.0.1", False), ("::1", False), ("fe80::1", False), ("fc00::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("192.0.2.1", False), ("198.18.0.1", False),
    # 6to4 embeds any IPv4 address (2002:0a00:0001:: is 10.0.0.1); site-local is private in practice.
    ("2002:a00:1::1", False), ("2002:5db8:d822::1", False), ("fec0::1", False), ("feff::1", False),
])
def test_address_screening_is_strict_by_default(addr: str, public: bool) -> None:
    assert is_public_address(addr, own=frozenset()) is public


def test_the_nodes_own_addresses_are_refused(tmp_path: Path) -> None:
    fib = tmp_path / "fib_trie"
    fib.write_text("Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 93.184.216.34\n        /32 host LOCAL\n"
                   "     |-- 93.184.216.255\n        /32 link BROADCAST\n")
    inet6 = tmp_path / "if_inet6"
    inet6.write_text("26062800022000010000000000000001 02 40 00 80     eth0\n")
    own = _read_local_addresses(fib, inet6)
    assert own == {ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("2606:2800:220:1::1")}
    assert not is_public_address("93.184.216.34", own=own)
    assert not is_public_address("2606:2800:220:1::1", own=own)
    assert is_public_address("93.184.216.35", own=own)
    # By default the kernel's list is used: every address this host holds is refused.
    for addr in node_addresses():
        assert not is_public_address(str(addr))


def test_address_allow_list_override() -> None:
    nets = [ipaddress.ip_network("10.250.0.0/16")]
    assert is_public_address("10.250.3.4", nets)
    assert not is_public_address("10.251.0.1", nets)
    assert not is_public_address("127.0.0.1", nets)
