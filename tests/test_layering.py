"""Imports point one way (docs/architecture.md, "Layers"): read from the source, function-level imports included.

A module may import its own package and any package on a lower layer; two packages on the same layer (the
stages) never import each other, they meet through artifacts on disk. A strict order also means no cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> (source folder, layer). The one definition of the layering; docs/architecture.md shows it.
PACKAGES = {
    "trtkv": ("trtkv", 0),  # the core: formats, quantization math, models, data, artifacts, manifest, cli
    "trtkv.plugins": ("plugins", 1),  # kernels, their references, the op contract, ORT / TensorRT glue
    "trtkv.runtime": ("trtkv/runtime", 2),  # engines run the kernels: block manager, scheduler, backends
    "trtkv.calibration": ("calibration", 3),  # the stages: calibrate -> build-engine -> serve
    "trtkv.builder": ("builder", 3),
    "trtkv.triton_repo": ("triton_repo", 3),
}


def package_of(module: str) -> str:
    """The most specific entry of PACKAGES that holds ``module``."""
    best = "trtkv"
    for pkg in PACKAGES:
        if (module == pkg or module.startswith(pkg + ".")) and len(pkg) > len(best):
            best = pkg
    return best


def module_name(path: Path) -> str:
    for pkg, (folder, _) in sorted(PACKAGES.items(), key=lambda kv: -len(kv[1][0])):
        base = ROOT / folder
        if path.is_relative_to(base):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            return ".".join([pkg, *parts])
    raise AssertionError(f"{path} is in no package")


def imports_of(path: Path, module: str) -> set[str]:
    """Every trtkv module ``path`` imports, at any depth (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
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


def source_graph() -> dict[str, set[str]]:
    folders = {ROOT / folder for folder, _ in PACKAGES.values()}
    files = {p for f in folders for p in f.rglob("*.py")}
    return {module_name(p): imports_of(p, module_name(p)) for p in sorted(files)}


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer or across to a sibling package on the same layer."""
    bad = []
    for src, targets in graph.items():
        src_pkg = package_of(src)
        for dst in sorted(targets):
            dst_pkg = package_of(dst)
            if dst_pkg == src_pkg:
                continue
            if PACKAGES[dst_pkg][1] >= PACKAGES[src_pkg][1]:
                bad.append(f"{src} imports {dst} ({src_pkg} layer {PACKAGES[src_pkg][1]} -> {dst_pkg} layer {PACKAGES[dst_pkg][1]})")
    return bad


def test_every_import_points_down_a_layer():
    graph = source_graph()
    assert len(graph) > 50, "the walk found too few modules"
    assert violations(graph) == []


@pytest.mark.parametrize(
    "edge",
    [
        ("trtkv.formats", "trtkv.calibration.export"),  # the core reaching into a stage
        ("trtkv.runtime.backends", "trtkv.builder.graph"),  # the runtime reaching up into a stage
        ("trtkv.builder.build", "trtkv.triton_repo.repository"),  # two stages
        ("trtkv.plugins.kernels", "trtkv.runtime.kv_pool"),  # the kernels reaching up into the runtime
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
        "trtkv.runtime.verify imports trtkv.builder.build (trtkv.runtime layer 2 -> trtkv.builder layer 3)"
    ]


def test_relative_imports_resolve_to_their_package():
    assert module_name(ROOT / "plugins" / "__init__.py") == "trtkv.plugins"
    assert module_name(ROOT / "trtkv" / "runtime" / "kv_pool.py") == "trtkv.runtime.kv_pool"
    imports = imports_of(ROOT / "plugins" / "trt_plugins.py", "trtkv.plugins.trt_plugins")
    assert "trtkv.plugins.contract" in imports or any(m.startswith("trtkv.plugins.") for m in imports)
