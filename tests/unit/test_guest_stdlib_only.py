"""The guest daemon is copied into the VM image, where only Debian's python3 exists: it may import the
standard library and its own package, nothing else. import-linter cannot express "stdlib only", so this test
reads every import statement of every guest module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import capsa.guest

GUEST_DIR = Path(capsa.guest.__file__).parent


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import inside capsa.guest
                continue
            found.append((node.module or "", node.lineno))
    return found


def test_guest_modules_import_only_stdlib_and_themselves() -> None:
    modules = sorted(GUEST_DIR.glob("*.py"))
    assert modules, "no guest modules found"
    bad: list[str] = []
    for path in modules:
        for name, line in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or name == "__future__":
                continue
            if name == "capsa.guest" or name.startswith("capsa.guest."):
                continue
            bad.append(f"{path.name}:{line}: import {name}")
    assert not bad, "guest code imports outside the standard library:\n" + "\n".join(bad)


def test_checker_catches_a_third_party_import(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("import httpx\nfrom capsa.common import ids\nimport os\n")
    names = [n for n, _ in _imports(sample)]
    offenders = [n for n in names if n.split(".")[0] not in sys.stdlib_module_names]
    assert offenders == ["httpx", "capsa.common"]
