"""Finding 11 of the security review: a secret value the broker could not send as a header is refused when
it is created (problem+json ``validation_error``, field ``body.value``, without quoting the value), so it
never reaches the broker, whose HTTP library would quote it in an error."""

from __future__ import annotations

import base64
import os
from collections.abc import Awaitable, Callable

import pytest

from capsa.control.egress.schemas import SECRET_VALUE_CONTROL, SECRET_VALUE_WHITESPACE
from tests.support.api_stack import ApiStack
from tests.support.problems import assert_problem

pytestmark = pytest.mark.timeout(120)

KEY = base64.b64encode(os.urandom(32)).decode()
BAD = [
    ("tok-trailing-space-9f3 ", SECRET_VALUE_WHITESPACE),
    (" tok-leading-space-9f3", SECRET_VALUE_WHITESPACE),
    ("tok-trailing-newline-9f3\n", SECRET_VALUE_CONTROL),
    ("tok-with\ttab-9f3", SECRET_VALUE_CONTROL),
    ("tok-with\x01soh-9f3", SECRET_VALUE_CONTROL),
    ("tok-with\x1besc-9f3", SECRET_VALUE_CONTROL),
    ("tok-with\x7fdel-9f3", SECRET_VALUE_CONTROL),
    ("tok-with\x00nul-9f3", SECRET_VALUE_CONTROL),
]


async def test_secret_values_with_control_characters_or_edge_whitespace_are_refused(
        make_stack: Callable[..., Awaitable[ApiStack]]) -> None:
    stack = await make_stack(settings={"secret_key": KEY})
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        for i, (value, message) in enumerate(BAD):
            response = await c.post("/v1/secrets", json={"name": f"bad{i}", "value": value})
            body = assert_problem(response, 422, "validation_error")
            assert [e["field"] for e in body["errors"]] == ["body.value"]
            assert message in body["errors"][0]["message"]
            assert value.strip() not in response.text  # never echoed
        ok = await c.post("/v1/secrets", json={"name": "good", "value": "sk-inner space-ok"})
        assert ok.status_code == 201, ok.text
        assert [s["name"] for s in (await c.get("/v1/secrets")).json()["items"]] == ["good"]
