"""No import cycles inside ``capsa.sdk`` or ``capsa.control``: each package's modules form a layering.

Imports are read from the source by grimp (the library import-linter builds on), module-level and
function-level alike; imports under ``if TYPE_CHECKING:`` only feed annotations and never run, so they are
left out (:mod:`tests.support.import_graph`).
"""

from __future__ import annotations

import grimp
import pytest

from tests.support.import_graph import import_cycles, imports_inside

PACKAGES = ("capsa.sdk", "capsa.control")


@pytest.mark.parametrize("package", PACKAGES)
def test_package_has_no_import_cycle(capsa_imports: grimp.ImportGraph, package: str) -> None:
    imports = imports_inside(capsa_imports, package)
    assert len(imports) > 5, f"grimp found almost no modules in {package}"
    cycles = import_cycles(imports)
    chains = [" -> ".join(capsa_imports.find_shortest_chain(group[0], group[1]) or ()) for group in cycles]
    assert cycles == [], chains


def test_the_cycle_finder_finds_cycles() -> None:
    layered = {"p.a": {"p.b", "p.c"}, "p.b": {"p.c"}, "p.c": set()}
    assert import_cycles(layered) == []
    looped = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": {"p.e"}}
    assert import_cycles(looped) == [["p.a", "p.b", "p.c"], ["p.e"]]
