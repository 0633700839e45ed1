"""capsa's import graph as the layout tests read it: grimp's (the library import-linter builds on),
module-level and function-level imports alike, without the imports under ``if TYPE_CHECKING:`` (they only
feed annotations and never run); its strongly connected groups and its longest chains."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Set

import grimp

__all__ = ["build_graph", "components", "import_cycles", "imports_inside", "longest_chain"]

Imports = Mapping[str, Set[str]]


def build_graph() -> grimp.ImportGraph:
    return grimp.build_graph("capsa", include_external_packages=False, exclude_type_checking_imports=True,
                             cache_dir=None)


def imports_inside(graph: grimp.ImportGraph, package: str,
                   unit: Callable[[str], str] | None = None) -> dict[str, set[str]]:
    """Who imports whom among ``package`` and its modules; with ``unit``, among the units it maps the modules
    to (an import inside one unit is left out)."""
    modules = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    imports = {m: {t for t in graph.find_modules_directly_imported_by(m) if t in modules} for m in modules}
    if unit is None:
        return imports
    units: dict[str, set[str]] = {unit(m): set() for m in modules}
    for m, targets in imports.items():
        units[unit(m)] |= {unit(t) for t in targets if unit(t) != unit(m)}
    return units


def components(imports: Imports) -> list[list[str]]:
    """The strongly connected groups of ``imports`` (each sorted), every module in exactly one; a group of
    one is a module no cycle runs through. Tarjan's algorithm: a group comes after every group it imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
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
            groups.append(sorted(group))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return groups


def import_cycles(imports: Imports) -> list[list[str]]:
    """The strongly connected groups of more than one module (or a module importing itself), sorted."""
    return sorted(g for g in components(imports) if len(g) > 1 or g[0] in imports.get(g[0], ()))


def longest_chain(imports: Imports) -> list[list[str]]:
    """The longest chain of distinct modules where each imports the next, as its strongly connected groups
    in order (a cycle counts with all its modules: each is a step of a chain through it); its length is the
    number of modules in them."""
    groups = components(imports)
    group_of = {m: i for i, g in enumerate(groups) for m in g}

    @functools.cache
    def chain(i: int) -> tuple[int, ...]:
        below = {group_of[t] for m in groups[i] for t in imports.get(m, ()) if group_of[t] != i}
        return (i, *max((chain(j) for j in sorted(below)), key=size, default=()))

    def size(path: tuple[int, ...]) -> int:
        return sum(len(groups[i]) for i in path)

    return [groups[i] for i in max((chain(i) for i in range(len(groups))), key=size, default=())]
