"""Print the key of what ``pip install -e .[extras]`` puts in a venv: a hash of pyproject.toml's
``[build-system]`` and ``[project]`` tables (dependencies, extras, entry points, version), not of the whole
file, so editing tool settings (pytest markers, ruff, mypy, import contracts) keeps the venv.

    python3 scripts/deps_key.py [PYPROJECT]     # 64 hex digits

Standard library only: it runs with the machine's python3 before any venv exists.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tomllib
from pathlib import Path


def deps_key(pyproject: Path) -> str:
    data = tomllib.loads(pyproject.read_text())
    relevant = {"build-system": data.get("build-system"), "project": data.get("project")}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "pyproject.toml"
    print(deps_key(path))
