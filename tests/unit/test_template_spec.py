"""Template spec parsing: a good spec loads with its host files; bad ones get a clear error.

Building a template in a real VM: tests/integration/test_node_snapshots_vm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from capsa.common.errors import CapsaError
from capsa.node.templates.build import load_spec, spec_record


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_good_spec_loads_with_host_files(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("print('hi')\n")
    spec, sources = load_spec(_write(tmp_path, """
name: py-tools
apt: [jq, "curl=7.88.1-10+deb12u5"]
pip: ["requests==2.32.3", "six"]
files:
  - {path: /opt/app.py, source: app.py}
  - {path: /etc/motd, content: "hello\\n", mode: "0600"}
commands: ["echo $X > /tmp/x"]
env: {X: "1"}
"""))
    assert spec.name == "py-tools" and spec.base == "base" and spec.apt == ["jq", "curl=7.88.1-10+deb12u5"]
    assert sources == {"app.py": b"print('hi')\n"}
    record = spec_record(spec, sources)
    # The record keeps a host file's hash, not its bytes.
    assert record["files"][0]["source_sha256"] and "print" not in str(record)
    # The default RAM mode is left out of the record (records made before the field existed stay equal).
    assert spec.ram == "shared" and "ram" not in record


def test_private_ram_is_recorded(tmp_path: Path) -> None:
    spec, sources = load_spec(_write(tmp_path, "name: web\nnetwork: true\nram: private\n"))
    assert spec.ram == "private" and spec_record(spec, sources)["ram"] == "private"


@pytest.mark.parametrize(("text", "message"), [
    ("name: base\n", "cannot be built from a spec"),
    ("name: Bad Name\n", "name"),
    ("name: x\napt: ['jq; rm -rf /']\n", "apt.0"),
    ("name: x\npip: ['--index-url=http://evil']\n", "pip.0"),
    ("name: x\nfiles: [{path: relative.txt, content: a}]\n", "files.0.path"),
    ("name: x\nfiles: [{path: /a, content: a, source: b}]\n", "exactly one of content or source"),
    ("name: x\nfiles: [{path: /a, source: missing.bin}]\n", "cannot read missing.bin"),
    ("name: x\nunknown: 1\n", "unknown"),
    ("name: x\nram: huge\n", "ram"),
    ("name: [unclosed\n", "cannot read template spec"),
    ("- just a list\n", "invalid template spec"),
])
def test_bad_specs_are_refused_clearly(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(CapsaError) as info:
        load_spec(_write(tmp_path, text))
    assert info.value.code == "bad_request" and info.value.status == 400
    assert message in info.value.message


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(CapsaError, match="cannot read template spec"):
        load_spec(tmp_path / "nope.yaml")
