"""The SDK maps every problem document and transport failure to its typed exception."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from capsa.sdk import (
    AsyncClient,
    AsyncSession,
    BadRequest,
    CapsaAPIError,
    CapsaConnectionError,
    CapsaTimeoutError,
    ClientConfig,
    Forbidden,
    InternalError,
    InvalidState,
    NoCapacity,
    NodeUnreachable,
    NotFound,
    NotReady,
    PayloadTooLarge,
    RateLimited,
    SessionFailed,
    TemplateNotFound,
    Unauthorized,
    Unavailable,
    ValidationFailed,
)
from capsa.sdk.errors import error_from_problem

CASES = [
    ("unauthorized", 401, Unauthorized),
    ("forbidden", 403, Forbidden),
    ("not_found", 404, NotFound),
    ("validation_error", 422, ValidationFailed),
    ("rate_limited", 429, RateLimited),
    ("invalid_state", 409, InvalidState),
    ("template_not_found", 404, TemplateNotFound),
    ("no_capacity", 503, NoCapacity),
    ("session_failed", 409, SessionFailed),
    ("payload_too_large", 413, PayloadTooLarge),
    ("internal_error", 500, InternalError),
    ("not_ready", 503, NotReady),
    ("node_unreachable", 503, NodeUnreachable),
    ("bad_request", 400, BadRequest),
]


def problem(code: str, status: int, detail: str = "it went wrong", **extra: Any) -> httpx.Response:
    body = {"type": f"https://capsa.dev/errors/{code}", "title": code.replace("_", " "), "status": status,
            "detail": detail, "code": code, **extra}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})


def client_answering(response: httpx.Response) -> AsyncClient:
    return AsyncClient("http://capsa.test", "csk_abc_def", transport=httpx.MockTransport(lambda r: response))


@pytest.mark.parametrize(("code", "status", "cls"), CASES)
async def test_every_code_maps_to_its_class(code: str, status: int, cls: type[CapsaAPIError]) -> None:
    async with client_answering(problem(code, status, "because")) as client:
        with pytest.raises(cls) as info:
            await client.get_session("ses_x")
    err = info.value
    assert type(err) is cls
    assert (err.code, err.status, err.detail) == (code, status, "because")
    assert isinstance(err, CapsaAPIError)
    assert str(err) == f"{code}: because"


def test_subclasses_group_naturally() -> None:
    assert issubclass(TemplateNotFound, NotFound)
    assert issubclass(SessionFailed, InvalidState)
    assert all(issubclass(c, Unavailable) for c in (NoCapacity, NotReady, NodeUnreachable))


async def test_validation_errors_name_the_fields() -> None:
    errors = [{"field": "body.timeout", "message": "must be <= 86400"},
              {"field": "body.env.1x", "message": "bad"}]
    async with client_answering(problem("validation_error", 422, "invalid request", errors=errors)) as client:
        with pytest.raises(ValidationFailed) as info:
            await client.create_session(timeout=10**9)
    assert [e.field for e in info.value.errors] == ["body.timeout", "body.env.1x"]
    assert info.value.errors[0].message == "must be <= 86400"
    assert "body.timeout: must be <= 86400" in str(info.value)


async def test_rate_limited_carries_retry_after() -> None:
    response = problem("rate_limited", 429, "slow down")
    response.headers["Retry-After"] = "7"
    async with client_answering(response) as client:
        with pytest.raises(RateLimited) as info:
            await client.create_session()
    assert info.value.retry_after == 7.0


async def test_unknown_code_falls_back_on_status() -> None:
    async with client_answering(problem("brand_new_code", 404)) as client:
        with pytest.raises(NotFound) as info:
            await client.get_session("ses_x")
    assert info.value.code == "brand_new_code"
    async with client_answering(problem("brand_new_code", 502)) as client:
        with pytest.raises(InternalError):
            await client.get_session("ses_x")
    async with client_answering(problem("brand_new_code", 503)) as client:
        with pytest.raises(Unavailable) as unavailable:
            await client.get_session("ses_x")
    assert type(unavailable.value) is Unavailable
    async with client_answering(problem("brand_new_code", 418)) as client:
        with pytest.raises(CapsaAPIError) as generic:
            await client.get_session("ses_x")
    assert type(generic.value) is CapsaAPIError and generic.value.status == 418


async def test_non_json_error_body_still_gives_an_error() -> None:
    html = httpx.Response(502, text="<html>Bad Gateway</html>")
    async with client_answering(html) as client:
        with pytest.raises(InternalError) as info:
            await client.health()
    assert info.value.status == 502 and "Bad Gateway" in info.value.detail


def test_stream_error_events_keep_class_status() -> None:
    err = error_from_problem(0, {"type": "error", "code": "session_failed", "detail": "vm died"})
    assert isinstance(err, SessionFailed) and err.status == 409 and err.detail == "vm died"


async def test_connection_refused_is_a_connection_error() -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with AsyncClient(f"http://127.0.0.1:{port}", "csk_a_b") as client:
        with pytest.raises(CapsaConnectionError) as info:
            await client.health()
    assert f"127.0.0.1:{port}" in str(info.value)


async def test_timeout_is_a_timeout_error() -> None:
    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    async with AsyncClient("http://capsa.test", "k", transport=httpx.MockTransport(hang)) as client:
        with pytest.raises(CapsaTimeoutError):
            await client.health()


async def test_bad_url_is_a_connection_error() -> None:
    async with AsyncClient("not-a-url", "k") as client:
        with pytest.raises(CapsaConnectionError):
            await client.health()


def test_key_with_header_breaking_characters_is_refused() -> None:
    from capsa.sdk import CapsaClientError

    with pytest.raises(CapsaClientError):
        AsyncClient("http://capsa.test", "csk_a_b\r\nX-Evil: 1")


def test_config_repr_hides_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSA_API_URL", "http://example.test:9/")
    monkeypatch.setenv("CAPSA_API_KEY", "csk_abcdefabcdef_supersecretsupersecretsupersecret12")
    config = ClientConfig.resolve()
    assert config.api_url == "http://example.test:9"
    assert config.api_key and config.api_key.endswith("12")
    assert "supersecret" not in repr(config)
    explicit = ClientConfig.resolve("http://other.test", "csk_x_y")
    assert (explicit.api_url, explicit.api_key) == ("http://other.test", "csk_x_y")


async def test_owned_client_is_closed_when_create_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []
    transport = httpx.MockTransport(lambda r: problem("template_not_found", 404, "no template 'nope'"))
    original = AsyncClient.aclose

    async def spy(self: AsyncClient) -> None:
        closed.append(True)
        await original(self)

    monkeypatch.setattr(AsyncClient, "aclose", spy)
    with pytest.raises(TemplateNotFound):
        await AsyncSession.create("nope", api_url="http://capsa.test", api_key="k", transport=transport)
    assert closed == [True]


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner,
                                                                                       max_size=3),
                           max_leaves=10)


@given(status=st.integers(400, 599),
       body=st.one_of(st.none(), st.dictionaries(st.sampled_from(["code", "detail", "title", "errors", "x"]),
                                                 json_values)),
       retry_after=st.one_of(st.none(), st.text(max_size=8)))
def test_any_error_body_gives_an_api_error(status: int, body: dict[str, Any] | None,
                                           retry_after: str | None) -> None:
    err = error_from_problem(status, body, retry_after=retry_after)
    assert isinstance(err, CapsaAPIError) and err.status == status
    assert isinstance(str(err), str) and isinstance(err.detail, str)
    if isinstance(err, RateLimited):
        assert err.retry_after is None or 0 <= err.retry_after < float("inf")


@pytest.mark.parametrize(("header", "expected"), [("3", 3.0), ("0.5", 0.5), ("-4", 0.0), ("nan", None),
                                                  ("inf", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None)])
def test_retry_after_values(header: str, expected: float | None) -> None:
    err = error_from_problem(429, {"code": "rate_limited"}, retry_after=header)
    assert isinstance(err, RateLimited) and err.retry_after == expected


def test_malformed_validation_errors_are_ignored() -> None:
    err = error_from_problem(422, {"code": "validation_error", "errors": 5})
    assert isinstance(err, ValidationFailed) and err.errors == []
