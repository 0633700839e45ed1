"""Checking the API's error answers (RFC 9457 problem details)."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["assert_problem"]


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Assert that ``response`` is a problem+json answer with ``status`` and ``code``; return its body."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["code"] == code
    assert body["status"] == status
    assert body["type"].endswith("/" + code)
    assert isinstance(body["title"], str) and isinstance(body["detail"], str)
    return body
