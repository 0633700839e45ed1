"""The broker's request parts on their own: the head checks, the placeholder scan of a streamed body, and the
redaction pattern cache."""

from __future__ import annotations

import pytest

from capsa.common.egress_policy import EgressPolicy, SecretBinding
from capsa.node.egress.http1 import Deny, Request
from capsa.node.egress.injection import PlaceholderScan
from capsa.node.egress.redaction import PatternCache
from capsa.node.egress.request_head import body_length, check_path, destination, split_host

POLICY = EgressPolicy.model_validate({"domains": [{"domain": "api.test", "forbid_uploads_above": 10}]})


def _request(target: str, host: bytes, *headers: tuple[bytes, bytes]) -> Request:
    return Request("GET", target, target, "", 0, [(b"host", host), *headers])


@pytest.mark.parametrize(("value", "expected"), [
    ("Api.Test", ("api.test", 80)),
    ("api.test.:8080", ("api.test", 8080)),
    ("[::1]:443", ("::1", 443)),
    ("::1", ("::1", 80)),
])
def test_split_host(value: str, expected: tuple[str, int]) -> None:
    assert split_host(value, 80) == expected


@pytest.mark.parametrize("value", ["api.test:0", "api.test:x", "[::1"])
def test_split_host_refuses_malformed(value: str) -> None:
    with pytest.raises(Deny) as caught:
        split_host(value, 80)
    assert caught.value.status == 400


def test_destination_sets_host_port_and_path_of_an_absolute_form_request() -> None:
    req = _request("http://api.test/v1/x?q=1", b"api.test")
    destination(req, "proxy", False, None, 80, 80)
    assert (req.host, req.port, req.path) == ("api.test", 80, "/v1/x?q=1")


@pytest.mark.parametrize(("target", "host", "mode", "tls", "pinned", "status"), [
    ("/", b"other.test", "tls", True, "api.test", 421),
    ("http://api.test/", b"other.test", "proxy", False, None, 421),
    ("/", b"api.test", "proxy", False, None, 400),
    ("/", b"127.0.0.1", "http", False, None, 403),
    ("/", b"api.test:8080", "http", False, None, 403),
])
def test_destination_refusals(target: str, host: bytes, mode: str, tls: bool, pinned: str | None,
                              status: int) -> None:
    with pytest.raises(Deny) as caught:
        destination(_request(target, host), mode, tls, pinned, 443 if tls else 80, 80)  # type: ignore[arg-type]
    assert caught.value.status == status


@pytest.mark.parametrize("path", ["/a/../b", "/a/./b", "/a//b", "/a%2f..%2fb", "/a\\b"])
def test_check_path_refuses_odd_segments(path: str) -> None:
    with pytest.raises(Deny):
        check_path(path)


def test_body_length() -> None:
    rule = POLICY.domains[0]
    assert body_length(_request("/", b"api.test", (b"content-length", b"5")), rule, 10) == 5
    assert body_length(_request("/", b"api.test", (b"transfer-encoding", b"chunked")), rule, 10) is None
    with pytest.raises(Deny) as caught:
        body_length(_request("/", b"api.test", (b"content-length", b"11")), rule, 10)
    assert caught.value.status == 413


def test_placeholder_scan_finds_a_placeholder_split_across_chunks() -> None:
    placeholder = "capsa_ph_0123456789abcdef"
    binding = SecretBinding(secret="sec_1", domain="api.test", header="authorization")
    scan = PlaceholderScan({placeholder: binding})
    scan.check(b"x" * 100 + placeholder[:7].encode())
    with pytest.raises(Deny) as caught:
        scan.check(placeholder[7:].encode())
    assert caught.value.status == 403 and "sec_1" in caught.value.reason


def test_placeholder_scan_without_placeholders_passes_everything() -> None:
    scan = PlaceholderScan({})
    scan.check(b"anything at all")


def test_pattern_cache_rebuilds_on_a_new_generation_and_after_forget() -> None:
    built: list[int] = []

    def values() -> list[bytes]:
        built.append(1)
        return [b"s3cr3t-value-1234"]

    cache = PatternCache()
    first = cache.get(1, values)
    assert cache.get(1, values) is first and len(built) == 1
    assert cache.get(2, values) is not first and len(built) == 2
    cache.forget()
    cache.get(2, values)
    assert len(built) == 3
