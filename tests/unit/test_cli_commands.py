"""CLI commands through click's CliRunner against a scripted API (the SDK's transport is swapped in-process).

Real subprocesses against a real ``capsa serve`` are in tests/integration/test_cli*.py.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

from capsa.cli.main import cli
from capsa.sdk import client as sdk_client

NOW = "2026-11-30T04:00:00Z"
SID = "ses_cccccccccccccccccccc"
ADMIN = "csk_adminadmin01_" + "s" * 32


def session_json(sid: str = SID, state: str = "running") -> dict[str, Any]:
    return {"id": sid, "tenant": "t1", "state": state, "template": "base", "created_at": NOW,
            "updated_at": NOW, "expires_at": NOW, "idle_timeout": None, "last_activity_at": NOW,
            "metadata": {"team": "a"}, "memory_mib": 256, "vcpus": 1, "node_id": "local",
            "failure_reason": None, "closed_at": None}


def problem(status: int, code: str, detail: str, **extra: Any) -> httpx.Response:
    return httpx.Response(status, json={"code": code, "detail": detail, "status": status, "title": code,
                                        **extra})


class Api:
    """Scripted server state; records requests so tests can check what the CLI asked for."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.closed: list[str] = []
        self.exit_code: int | None = 3
        self.signal: int | None = None
        self.timed_out = False

    def __call__(self, r: httpx.Request) -> httpx.Response:
        body: Any = json.loads(r.content) if r.content else {}
        self.requests.append((r.method, r.url.path, dict(r.url.params), body))
        if r.headers.get("authorization") != f"Bearer {ADMIN}":
            return problem(401, "unauthorized", "missing or invalid API key")
        p = r.url.path
        if p == "/v1/sessions" and r.method == "POST":
            if body["template"] == "nope":
                return problem(404, "template_not_found", "no template 'nope'")
            return httpx.Response(201, json=session_json())
        if p == "/v1/sessions" and r.method == "GET":
            return httpx.Response(200, json={"items": [session_json(), session_json("ses_x", "closed")],
                                             "next_cursor": None})
        if p == f"/v1/sessions/{SID}" and r.method == "GET":
            return httpx.Response(200, json=session_json())
        if p == f"/v1/sessions/{SID}/close":
            self.closed.append(SID)
            return httpx.Response(200, json=session_json(state="closed"))
        if p == f"/v1/sessions/{SID}/commands":
            result = {"exit_code": self.exit_code, "signal": self.signal, "timed_out": self.timed_out}
            if r.headers.get("accept") == "application/x-ndjson":
                events = [{"type": "stdout", "data": "hello\n"}, {"type": "stderr", "data": "oops\n"},
                          {"type": "result", **result}]
                return httpx.Response(200, content="".join(json.dumps(e) + "\n" for e in events),
                                      headers={"content-type": "application/x-ndjson"})
            return httpx.Response(200, json={**result, "stdout": "hello\n", "stderr": "oops\n"})
        if p == "/v1/keys" and r.method == "POST":
            return httpx.Response(201, json={"id": "csk_newkeynewkey", "key": "csk_newkeynewkey_" + "x" * 32,
                                             "tenant": body["tenant"], "admin": body["admin"],
                                             "name": body["name"], "created_at": NOW, "revoked_at": None})
        if p == "/v1/keys" and r.method == "GET":
            return httpx.Response(200, json={"items": [{"id": "csk_adminadmin01", "tenant": "admin",
                                                        "admin": True, "name": None, "created_at": NOW}]})
        if p.startswith("/v1/keys/") and r.method == "DELETE":
            kid = p.rsplit("/", 1)[1]
            if kid != "csk_newkeynewkey":
                return problem(404, "not_found", f"no key {kid}")
            return httpx.Response(200, json={"id": kid, "tenant": "t1", "admin": False,
                                             "created_at": NOW, "revoked_at": NOW})
        return problem(404, "not_found", f"no session {p.rsplit('/', 1)[-1]}")


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    fake = Api()
    original = sdk_client.AsyncClient.__init__

    def init(self: sdk_client.AsyncClient, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("transport") is None:
            kwargs["transport"] = httpx.MockTransport(fake)
        original(self, *args, **kwargs)

    monkeypatch.setattr(sdk_client.AsyncClient, "__init__", init)
    monkeypatch.setenv("CAPSA_API_URL", "http://capsa.test")
    monkeypatch.setenv("CAPSA_API_KEY", ADMIN)
    yield fake


Invoke = Callable[..., Result]


@pytest.fixture
def invoke() -> Invoke:
    def run(*args: str, **kwargs: Any) -> Result:
        return CliRunner().invoke(cli, list(args), catch_exceptions=False, **kwargs)

    return run


def test_run_streams_output_closes_and_propagates_exit_code(api: Api, invoke: Invoke) -> None:
    result = invoke("run", "--env", "A=1", "-m", "team=a", "--timeout", "30", "--", "python3", "-c", "x")
    assert result.exit_code == 3
    assert result.stdout == "hello\n" and "oops" in result.stderr
    create = next(r for r in api.requests if r[:2] == ("POST", "/v1/sessions"))
    assert create[3]["env"] == {"A": "1"} and create[3]["metadata"] == {"team": "a"}
    assert create[3]["timeout"] >= 30  # the session outlives the command
    run = next(r for r in api.requests if r[1].endswith("/commands"))
    assert run[3]["cmd"] == ["python3", "-c", "x"] and run[3]["timeout"] == 30
    assert api.closed == [SID]


def test_run_single_argument_is_a_shell_line(api: Api, invoke: Invoke) -> None:
    api.exit_code = 0
    assert invoke("run", "--", "ls / | wc -l").exit_code == 0
    run = next(r for r in api.requests if r[1].endswith("/commands"))
    assert run[3]["cmd"] == "ls / | wc -l"


def test_run_signal_and_timeout_exit_codes(api: Api, invoke: Invoke) -> None:
    api.exit_code, api.signal = None, 9
    assert invoke("run", "--", "sleep", "9").exit_code == 137
    api.signal, api.timed_out = None, True
    result = invoke("run", "--", "sleep", "9")
    assert result.exit_code == 124 and "timed out" in result.stderr


def test_run_json(api: Api, invoke: Invoke) -> None:
    result = invoke("run", "--json", "--", "echo", "hello")
    data = json.loads(result.stdout)
    assert data["session_id"] == SID and data["stdout"] == "hello\n" and data["exit_code"] == 3
    assert result.exit_code == 3 and api.closed == [SID]


def test_run_api_error_is_one_line_exit_125(api: Api, invoke: Invoke) -> None:
    result = invoke("run", "--template", "nope", "--", "true")
    assert result.exit_code == 125
    assert result.stderr == "error: template_not_found: no template 'nope'\n"
    assert "Traceback" not in result.output


def test_run_stdin_with_interactive(api: Api, invoke: Invoke) -> None:
    invoke("run", "-i", "--", "cat", input="piped text")
    run = next(r for r in api.requests if r[1].endswith("/commands"))
    assert run[3]["stdin"] == "piped text"


def test_bad_env_is_a_usage_error(api: Api, invoke: Invoke) -> None:
    result = invoke("run", "--env", "NOEQUALS", "--", "true")
    assert result.exit_code == 2 and "KEY=VALUE" in result.stderr
    assert api.requests == []


def test_exec_does_not_close_the_session(api: Api, invoke: Invoke) -> None:
    result = invoke("exec", SID, "--", "echo", "hi")
    assert result.exit_code == 3 and result.stdout == "hello\n"
    assert api.closed == []
    missing = invoke("exec", "ses_missing", "--", "true")
    assert missing.exit_code == 125 and missing.stderr.startswith("error: not_found:")


def test_ls_table_and_json(api: Api, invoke: Invoke) -> None:
    table = invoke("ls", "--state", "running", "-m", "team=a")
    assert table.exit_code == 0 and SID in table.stdout and "STATE" in table.stdout
    params = api.requests[-1][2]
    assert params["state"] == "running" and params["metadata.team"] == "a"
    data = json.loads(invoke("ls", "--json").stdout)
    assert [s["id"] for s in data["items"]] == [SID, "ses_x"]


def test_close(api: Api, invoke: Invoke) -> None:
    result = invoke("close", SID)
    assert result.exit_code == 0 and result.stdout == f"{SID} closed\n" and api.closed == [SID]
    data = json.loads(invoke("close", "--json", SID).stdout)
    assert data["items"][0]["state"] == "closed"
    assert invoke("close", "ses_missing").exit_code == 1


def test_keys_create_ls_revoke(api: Api, invoke: Invoke) -> None:
    created = invoke("keys", "create", "--tenant", "t1", "--name", "ci")
    assert created.exit_code == 0
    assert created.stdout == "csk_newkeynewkey_" + "x" * 32 + "\n"  # only the key on stdout
    assert "cannot be shown again" in created.stderr
    assert api.requests[-1][3] == {"tenant": "t1", "admin": False, "name": "ci"}
    as_json = json.loads(invoke("keys", "create", "--tenant", "t2", "--admin", "--json").stdout)
    assert as_json["key"].startswith("csk_newkeynewkey_") and as_json["admin"] is True
    listing = invoke("keys", "ls")
    assert "csk_adminadmin01" in listing.stdout and "TENANT" in listing.stdout
    assert json.loads(invoke("keys", "ls", "--json").stdout)["items"][0]["admin"] is True
    assert invoke("keys", "revoke", "csk_newkeynewkey").stdout == "revoked csk_newkeynewkey\n"
    bad = invoke("keys", "revoke", "csk_nokey")
    assert bad.exit_code == 1 and bad.stderr == "error: not_found: no key csk_nokey\n"


def test_wrong_key_is_reported(api: Api, invoke: Invoke) -> None:
    result = invoke("ls", "--api-key", "csk_wrong_key")
    assert result.exit_code == 1
    assert result.stderr == "error: unauthorized: missing or invalid API key\n"


def test_unreachable_server_is_one_line(invoke: Invoke, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("CAPSA_API_URL", f"http://127.0.0.1:{port}")
    for args in (["ls"], ["keys", "ls"], ["close", SID]):
        result = invoke(*args)
        assert result.exit_code == 1, args
        assert result.stderr.startswith(f"error: cannot reach capsa API at http://127.0.0.1:{port}")
        assert result.stderr.count("\n") == 1
    assert invoke("run", "--", "true").exit_code == 125
