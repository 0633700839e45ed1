"""spec/*.openapi.json must match the code, and the served document must describe the API correctly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from capsa.frontends import build_app

ROOT = Path(__file__).resolve().parents[2]


def test_exported_openapi_documents_match_the_code() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "export_openapi.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_openapi_document_covers_the_contract() -> None:
    spec = build_app().openapi()
    paths = spec["paths"]
    expected = {
        "/v1/health": {"get"},
        "/v1/ready": {"get"},
        "/metrics": {"get"},
        "/v1/sessions": {"get", "post"},
        "/v1/sessions/{session_id}": {"get", "delete"},
        "/v1/sessions/{session_id}/timeout": {"post"},
        "/v1/sessions/{session_id}/close": {"post"},
        "/v1/sessions/{session_id}/commands": {"post"},
        "/v1/sessions/{session_id}/processes": {"get"},
        "/v1/sessions/{session_id}/processes/{pid}": {"get"},
        "/v1/sessions/{session_id}/processes/{pid}/output": {"get"},
        "/v1/sessions/{session_id}/processes/{pid}/kill": {"post"},
        "/v1/sessions/{session_id}/files/content": {"get", "put"},
        "/v1/sessions/{session_id}/files/list": {"get"},
        "/v1/sessions/{session_id}/files/stat": {"get"},
        "/v1/sessions/{session_id}/files/mkdir": {"post"},
        "/v1/sessions/{session_id}/files": {"delete"},
        "/v1/sessions/{session_id}/files/archive": {"get", "put"},
        "/v1/keys": {"get", "post"},
        "/v1/keys/{key_id}": {"delete"},
        "/v1/nodes": {"get", "post"},
        "/v1/nodes/{node_id}/heartbeat": {"post"},
    }
    for path, methods in expected.items():
        assert path in paths, path
        assert methods <= set(paths[path]), (path, set(paths[path]))
    stored = json.loads((ROOT / "spec" / "api.openapi.json").read_text())
    assert stored == json.loads(json.dumps(spec, sort_keys=True))
