"""The product's modules import one another without circles, no layer imports a layer above it,
and none reaches into another module's private names: read from the source (every import, a
function's own and those under `TYPE_CHECKING` included), so a circle cannot hide behind a late or
a type-only import."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the folders that install as sgl-kvc's packages (pyproject.toml's package-dir)
ROOTS = {"sgl_kvc": REPO / "sgl_kvc", "sgl_kvc.kernels": REPO / "kernels", "sgl_kvc.server": REPO / "server"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if package == "sgl_kvc" and parts and parts[0] in ("kernels", "server"):
                continue
            out[name] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """Each module's imports of the product's modules (type-only ones included), and the private
    names imported."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            source = _absolute(node, module, path) if isinstance(node, ast.ImportFrom) else None
            if source is not None and source.startswith("sgl_kvc"):
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    target = full if full in modules else _owner(source, modules)
                    if target and target != module:
                        edges[module].add(target)
                        if full not in modules and alias.name.startswith("_"):
                            private.append(f"{module}: from {source} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    target = _owner(alias.name, modules) if alias.name.startswith("sgl_kvc") else None
                    if target and target != module:
                        edges[module].add(target)
    return edges, private


def _absolute(node: ast.ImportFrom, module: str, path: Path) -> str | None:
    """The module an `import from` names, a relative one (`from ._ops import x`) resolved from
    the importing `module` (a package's `__init__` is the package itself)."""
    if not node.level:
        return node.module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return found


def test_no_import_circles() -> None:
    edges, _ = _graph()
    assert len(edges) > 60, "the product's modules were not found"
    assert _circles(edges) == []


# The layers, lowest first (docs/architecture.md, "Layout"): a module may import its own layer and
# those below it only. A module belongs to the layer of the longest prefix listed.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("sgl_kvc.core", "sgl_kvc.policies", "sgl_kvc.kernels", "sgl_kvc.model", "sgl_kvc.compat"),
    ("sgl_kvc.config", "sgl_kvc.request_settings", "sgl_kvc.footprint"),
    ("sgl_kvc.adapter",),
    ("sgl_kvc.server", "sgl_kvc.launch", "sgl_kvc.launcher", "sgl_kvc.prelaunch", "sgl_kvc.plugin",
     "sgl_kvc.server_process", "sgl_kvc.cluster", "sgl_kvc.cluster_stats"),
)


def _layer(module: str) -> int | None:
    best = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (level, len(prefix))
    return None if best is None else best[0]


def _upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets
                  if _layer(t) is not None and _layer(m) is not None and _layer(t) > _layer(m))


def test_every_module_has_a_layer() -> None:
    edges, _ = _graph()
    assert sorted(m for m in edges if m != "sgl_kvc" and _layer(m) is None) == []


def test_no_layer_imports_upward() -> None:
    edges, _ = _graph()
    assert _upward(edges) == []


def test_the_check_finds_an_upward_import() -> None:
    """A type-only import is read as an import: settings that name an adapter type are upward."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sgl_kvc.adapter.kvc_req import KvcReq")
    targets = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("sgl_kvc")}
    assert _upward({"sgl_kvc.request_settings": targets}) == ["sgl_kvc.request_settings -> sgl_kvc.adapter.kvc_req"]
    assert _upward({"sgl_kvc.adapter.kvc_req": {"sgl_kvc.request_settings"}}) == []


def test_the_check_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_relative_imports_are_read_as_their_modules() -> None:
    """`from ._ops import x` inside a function of `sgl_kvc.policies.base` is an edge to
    `sgl_kvc.policies._ops`: a circle through a relative import is a circle."""
    tree = ast.parse("def f():\n    from ._ops import x\nfrom . import rkv\nfrom ..core import decode")
    found = [_absolute(n, "sgl_kvc.policies.base", Path("base.py")) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert sorted(found) == ["sgl_kvc.core", "sgl_kvc.policies", "sgl_kvc.policies._ops"]
    assert _absolute(ast.parse("from .base import y").body[0], "sgl_kvc.policies", Path("__init__.py")) == \
        "sgl_kvc.policies.base"


def test_no_module_imports_another_modules_private_names() -> None:
    _, private = _graph()
    assert private == []


def test_every_package_folder_installs() -> None:
    """pyproject.toml lists its packages one by one (two folders install under another name): a
    folder it misses would be absent from a wheel (the GPU kit's), with nothing failing here,
    where the editable install finds it anyway."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert folders == listed


def test_the_documents_modules_stay_small() -> None:
    """Each module of the documents package is one concern a newcomer reads whole: none over 400
    lines (`python -m benchmarks.turn_files` measures which of them one conversation turn runs)."""
    folder = REPO / "sgl_kvc" / "adapter" / "documents"
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert len(sizes) > 5, "the documents package was not found"
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_no_product_module_is_over_500_lines() -> None:
    """A module is one concern a newcomer reads whole: none of the product's over 500 lines."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in sizes.items() if n > 500} == {}
