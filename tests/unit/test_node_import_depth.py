"""How deep the imports inside ``capsa.node`` run: no cycle, and bounds on the longest chain of modules where
each imports the next (read as in test_import_cycles.py: :mod:`tests.support.import_graph`).

Two measures, both over the condensation of the strongly connected groups (a group counts with all its
members):

* features: the node's root modules and subpackages as units (``agent``, ``templates``, ``egress``, ...), as
  issue 28 counted its "11 levels" (``daemon -> assembly -> agent -> sources -> shipped -> template_build ->
  templates -> snapshots -> warm_pool -> runtime -> statedir`` on dcc7ca4; 13 on main before the layout by
  feature). 6 now (the target): ``daemon -> api -> agent -> templates -> egress -> net``; the status
  table the API answers with is a leaf module of its own (``statuses``), so ``templates.source`` reading it
  does not tie ``templates`` to ``api``.
* modules: every module of ``capsa.node`` on its own (18 on main before; 16 since the broker's parts take
  the resolvers from :mod:`capsa.common.destinations` instead of through ``egress.dns``): the node's HTTP
  edge over the agent (``daemon -> api.app -> api.snapshots -> api.sandboxes -> api.deps -> agent.agent ->
  agent.sandbox_egress``), then the egress broker split by job (``node_egress -> service -> broker ->
  listeners -> request_loop -> approval_hold -> injection -> sandboxes -> audit``), each step a module
  importing the part it drives rather than a helper in the wrong module.

The bounds are what the tree measures, so a chain can only get shorter.
"""

from __future__ import annotations

import grimp

from tests.support.import_graph import import_cycles, imports_inside, longest_chain

NODE = "capsa.node"
MAX_MODULE_CHAIN = 16
MAX_FEATURE_CHAIN = 6


def feature(module: str) -> str:
    """The root module or subpackage of ``capsa.node`` that ``module`` belongs to."""
    return ".".join(module.split(".")[:3])


def _show(chain: list[list[str]]) -> str:
    return " -> ".join("{" + ", ".join(g) + "}" if len(g) > 1 else g[0] for g in chain)


def test_no_import_cycle_inside_the_node(capsa_imports: grimp.ImportGraph) -> None:
    imports = imports_inside(capsa_imports, NODE)
    assert len(imports) > 50, "grimp found almost no modules in capsa.node"
    assert import_cycles(imports) == []


def test_the_longest_chain_of_node_modules(capsa_imports: grimp.ImportGraph) -> None:
    chain = longest_chain(imports_inside(capsa_imports, NODE))
    depth = sum(len(g) for g in chain)
    print(f"capsa.node: longest import chain {depth} modules: {_show(chain)}")
    assert depth <= MAX_MODULE_CHAIN, _show(chain)


def test_the_longest_chain_of_node_features(capsa_imports: grimp.ImportGraph) -> None:
    chain = longest_chain(imports_inside(capsa_imports, NODE, feature))
    depth = sum(len(g) for g in chain)
    print(f"capsa.node: longest import chain {depth} features: {_show(chain)}")
    assert depth <= MAX_FEATURE_CHAIN, _show(chain)


def test_the_chain_finder_counts_every_module_of_a_cycle() -> None:
    assert longest_chain({}) == []
    layered = {"p.a": {"p.b", "p.c"}, "p.b": {"p.c"}, "p.c": set(), "p.d": {"p.c"}}
    assert longest_chain(layered) == [["p.a"], ["p.b"], ["p.c"]]
    looped = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.b", "p.d"}, "p.d": set(), "p.e": {"p.d"}}
    assert longest_chain(looped) == [["p.a"], ["p.b", "p.c"], ["p.d"]]


def test_features_group_the_modules_of_a_subpackage() -> None:
    graph = grimp.ImportGraph()
    for importer, imported in (("p.n.a", "p.n.x.b"), ("p.n.x.b", "p.n.x.c"), ("p.n.x.c", "p.n.d"),
                               ("p.n.a", "q.e")):
        graph.add_import(importer=importer, imported=imported)
    assert sum(len(g) for g in longest_chain(imports_inside(graph, "p.n"))) == 4
    features = imports_inside(graph, "p.n", feature)
    assert features == {"p.n.a": {"p.n.x"}, "p.n.x": {"p.n.d"}, "p.n.d": set()}
    assert longest_chain(features) == [["p.n.a"], ["p.n.x"], ["p.n.d"]]
