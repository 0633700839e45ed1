"""The test suites' own layout: helpers shared between test modules live in tests/support (public names),
fixtures in conftest files. No test module imports from another test module, and no fixture is a copy of
another one."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ALLOWED = ("tests.support",)


def _module_name(path: Path) -> str:
    return ".".join(("tests", *path.relative_to(TESTS).with_suffix("").parts))


def _sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Every module named by an import statement anywhere in the file (functions included), with relative
    imports resolved against ``module``."""
    found: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target in ("tests", *ALLOWED) or not node.module:
                # ``from tests import x`` / ``from . import x``: each name is a module of its own
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, target))
    return found


def _forbidden(name: str, own: str) -> bool:
    if name != "tests" and not name.startswith("tests."):
        return False
    if any(name == a or name.startswith(a + ".") for a in ALLOWED) or name.endswith(".conftest"):
        return False
    return name not in (own, "tests")


def test_no_test_module_imports_another_test_module() -> None:
    offenders = []
    for path in _sources():
        module = _module_name(path)
        is_package = path.name == "__init__.py"
        if is_package:
            module = module.removesuffix(".__init__")
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, module, is_package):
            if _forbidden(name, module):
                offenders.append(f"{path.relative_to(TESTS.parent)}:{line} imports {name}")
    assert offenders == [], "import shared helpers from tests.support instead:\n" + "\n".join(offenders)


def _is_fixture(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "fixture"


def _fixture_bodies(tree: ast.Module) -> list[tuple[str, int, str]]:
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                _is_fixture(d) for d in node.decorator_list):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            found.append((node.name, node.lineno, ast.dump(ast.Module(body=body, type_ignores=[]))))
    return found


def test_no_fixture_is_a_copy_of_another() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line, body in _fixture_bodies(tree):
            where[body].append(f"{path.relative_to(TESTS.parent)}:{line} {name}")
    copies = [places for places in where.values() if len(places) > 1]
    assert copies == [], "move these into a conftest.py:\n" + "\n".join(" = ".join(c) for c in copies)


def test_the_import_check_sees_what_it_must() -> None:
    tree = ast.parse("from tests.integration.test_cli_serve import x\nimport tests.unit.test_a\n"
                     "from tests.support.served import start_serve\nfrom . import test_b\n"
                     "from .conftest import y\ndef f():\n    from tests.security.test_c import z\n")
    names = [n for _, n in _imported(tree, "tests.unit.test_z", False)]
    assert [n for n in names if _forbidden(n, "tests.unit.test_z")] == [
        "tests.integration.test_cli_serve", "tests.unit.test_a", "tests.unit.test_b", "tests.security.test_c"]
