"""No import cycles inside ``capsa.sdk`` or ``capsa.control``: each package's modules form a layering.

Imports are read from the source by grimp (the library import-linter builds on), module-level and
function-level alike; imports under ``if TYPE_CHECKING:`` only feed annotations and never run, so they are
left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import grimp
import pytest

PACKAGES = ("capsa.sdk", "capsa.control")


def import_cycles(imports: Mapping[str, Set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (or a module importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(imports.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1 or module in imports.get(module, ()):
                cycles.append(sorted(group))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return sorted(cycles)


def imports_inside(graph: grimp.ImportGraph, package: str) -> dict[str, set[str]]:
    modules = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    return {m: {t for t in graph.find_modules_directly_imported_by(m) if t in modules} for m in modules}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("capsa", exclude_type_checking_imports=True, cache_dir=None)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_has_no_import_cycle(graph: grimp.ImportGraph, package: str) -> None:
    imports = imports_inside(graph, package)
    assert len(imports) > 5, f"grimp found almost no modules in {package}"
    cycles = import_cycles(imports)
    chains = [" -> ".join(graph.find_shortest_chain(group[0], group[1]) or ()) for group in cycles]
    assert cycles == [], chains


def test_the_cycle_finder_finds_cycles() -> None:
    layered = {"p.a": {"p.b", "p.c"}, "p.b": {"p.c"}, "p.c": set()}
    assert import_cycles(layered) == []
    looped = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": {"p.e"}}
    assert import_cycles(looped) == [["p.a", "p.b", "p.c"], ["p.e"]]
