"""Imports point one way (docs/architecture.md, "Layers"): read from the source, function-level imports included.

A module may import its own package and any package on a lower layer; two packages on the same layer (the
stages) never import each other, they meet through artifacts on disk. The table (``PACKAGES``) and the rule
(``may_import``) live in docs/gen_layers.py, which writes them into the doc. A strict order means no cycle between
packages; inside a package no two modules may import each other either, lazily or not.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
try:  # the one table of the layering and its rule, which docs/architecture.md is generated from
    import gen_layers
    from gen_layers import PACKAGES, may_import, package_of
finally:
    sys.path.remove(str(ROOT / "docs"))


def module_name(path: Path) -> str:
    for pkg, p in sorted(PACKAGES.items(), key=lambda kv: -len(kv[1].folder)):
        base = ROOT / p.folder
        if path.is_relative_to(base):
            rel = path.relative_to(base).with_suffix("")
            parts = [part for part in rel.parts if part != "__init__"]
            return ".".join([pkg, *parts])
    raise AssertionError(f"{path} is in no package")


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``: imports for annotations, never executed."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return guarded


def imports_of(path: Path, module: str, *, type_checking: bool = True) -> set[str]:
    """Every trtkv module ``path`` imports, at any depth (relative imports resolved); without ``type_checking``, not
    those under ``if TYPE_CHECKING:`` (they never run, so they close no import cycle)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = set() if type_checking else _type_checking_only(tree)
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from trtkv import calibration`
    return {m for m in found if m == "trtkv" or m.startswith("trtkv.")}


def source_graph(*, type_checking: bool = True) -> dict[str, set[str]]:
    folders = {ROOT / p.folder for p in PACKAGES.values()}
    files = {p for f in folders for p in f.rglob("*.py")}
    return {module_name(p): imports_of(p, module_name(p), type_checking=type_checking) for p in sorted(files)}


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer or across to a sibling package on the same layer."""
    bad = []
    for src, targets in graph.items():
        src_pkg = package_of(src)
        for dst in sorted(targets):
            dst_pkg = package_of(dst)
            if not may_import(src_pkg, dst_pkg):
                bad.append(f"{src} imports {dst} ({src_pkg} layer {PACKAGES[src_pkg].layer} -> {dst_pkg} layer {PACKAGES[dst_pkg].layer})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles between modules (function-level imports included: a lazy import only hides a cycle), each as the
    sorted modules of one strongly connected component. Edges are the modules named; a submodule's implicit import of
    its package's ``__init__`` is not one. Across packages a cycle is already an upward import; this catches one inside
    a package."""
    edges = {src: sorted(d for d in targets if d in graph and d != src) for src, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph has a few hundred modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_import_points_down_a_layer():
    graph = source_graph()
    assert len(graph) > 50, "the walk found too few modules"
    assert violations(graph) == []


def test_no_import_cycle_between_modules():
    assert cycles(source_graph(type_checking=False)) == []


def test_a_type_checking_import_closes_no_cycle():
    typed = imports_of(ROOT / "plugins" / "contract" / "specs.py", "trtkv.plugins.contract.specs")
    run = imports_of(ROOT / "plugins" / "contract" / "specs.py", "trtkv.plugins.contract.specs", type_checking=False)
    assert "trtkv.plugins.contract.attrs" in typed - run  # `if TYPE_CHECKING: from .attrs import Attrs`


def test_a_cycle_inside_one_package_is_caught():
    graph = source_graph()
    assert "trtkv.runtime.scheduler" in graph["trtkv.runtime.llm_engine"]  # the edge the cycle closes
    graph["trtkv.runtime.scheduler"] = graph["trtkv.runtime.scheduler"] | {"trtkv.runtime.llm_engine"}  # a lazy import back
    assert violations(graph) == []  # inside one package: the layering allows it
    assert ["trtkv.runtime.llm_engine", "trtkv.runtime.scheduler"] in cycles(graph)


def test_an_imported_name_is_no_module():
    graph = {"trtkv.a": {"trtkv.b", "trtkv.b.Thing"}, "trtkv.b": {"trtkv.a.helper"}}  # `from trtkv.b import Thing`
    assert cycles(graph) == []
    graph["trtkv.b"] = {"trtkv.a"}
    assert cycles(graph) == [["trtkv.a", "trtkv.b"]]


def test_layers_section_in_docs_is_generated_from_the_table(monkeypatch):
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_layers.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = gen_layers.DOC.read_text()
    monkeypatch.setitem(PACKAGES, "trtkv.builder", PACKAGES["trtkv.builder"]._replace(layer=2))
    assert gen_layers.GENERATED.render(doc, gen_layers.DOC) != doc


def test_eval_is_core_because_a_stage_scores_with_it():
    """docs/architecture.md says why trtkv/evaluate.py is no stage of its own: calibration imports its metrics (a stage
    may not import a stage) and the core CLI registers eval. When neither holds, it could be one and the doc is stale."""
    graph = source_graph()
    assert package_of("trtkv.evaluate") == "trtkv"
    assert "trtkv.evaluate" in graph["trtkv.calibration.budget"] and "trtkv.evaluate" in graph["trtkv.cli"]


@pytest.mark.parametrize(
    "edge",
    [
        ("trtkv.formats", "trtkv.calibration.export"),  # the core reaching into a stage
        ("trtkv.runtime.backends", "trtkv.builder.graph"),  # the runtime reaching up into a stage
        ("trtkv.builder.build", "trtkv.triton_repo.repository"),  # two stages
        ("trtkv.plugins.kernels", "trtkv.runtime.kv_pool"),  # the kernels reaching up into the runtime
        ("trtkv.attention.cpu", "trtkv.runtime.torch_engine"),  # an attention backend reaching up into the engine
    ],
)
def test_an_upward_or_sideways_import_is_caught(edge):
    graph = source_graph()
    src, dst = edge
    graph[src] = graph[src] | {dst}
    assert any(v.startswith(f"{src} imports {dst}") for v in violations(graph))


def test_a_cycle_between_two_packages_is_caught():
    graph = source_graph()
    graph["trtkv.builder.build"] = graph["trtkv.builder.build"] | {"trtkv.runtime.verify"}  # down: allowed
    graph["trtkv.runtime.verify"] = graph["trtkv.runtime.verify"] | {"trtkv.builder.build"}  # back up: the cycle
    assert violations(graph) == [
        "trtkv.runtime.verify imports trtkv.builder.build (trtkv.runtime layer 3 -> trtkv.builder layer 4)"
    ]


def test_relative_imports_resolve_to_their_package():
    assert module_name(ROOT / "plugins" / "__init__.py") == "trtkv.plugins"
    assert module_name(ROOT / "trtkv" / "runtime" / "kv_pool.py") == "trtkv.runtime.kv_pool"
    imports = imports_of(ROOT / "plugins" / "trt_plugins.py", "trtkv.plugins.trt_plugins")
    assert "trtkv.plugins.contract" in imports or any(m.startswith("trtkv.plugins.") for m in imports)
