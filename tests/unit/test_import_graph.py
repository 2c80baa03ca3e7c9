"""The import graph of ``heron/``: every import counts, top-level or inside a function (and
under ``TYPE_CHECKING``). Packages import only downward in the documented order, leaf modules
import only leaf modules, and no two modules import each other, directly or round a loop."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "heron"

# Top to bottom: a package imports only packages listed after it (README, "Architecture").
ORDER = ["entrypoints", "bench", "quantizer", "training", "route", "server", "transport",
         "engine", "executor", "worker", "speculative", "sample", "loader", "models", "layers",
         "quant", "attention", "distributed", "kernels"]
# Top-level modules every floor may use; they import only each other.
LEAVES = {"__init__", "__main__", "config", "envs", "errors", "sampling_params", "outputs",
          "logging_config", "cli_help", "tokenizer"}
# heron/__init__.py (the public API: LLM, SamplingParams) and __main__ sit above everything.
TOP = {"__init__", "__main__"}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. "heron.worker.model_runner"
    target: str  # imported module, resolved to a file of heron/, e.g. "heron.worker.step"
    where: str  # "heron/worker/model_runner.py:17"

    def floors(self) -> tuple[str, str]:
        return floor(self.source), floor(self.target)


def floor(module: str) -> str:
    """heron.worker.step -> "worker"; heron.config -> "config"; heron -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def facade_exports() -> dict[str, str]:
    """heron/__init__.py's lazy public names: ``from heron import LLM`` is an edge to the module
    that defines LLM (the facade itself imports nothing until a name is used)."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            return ast.literal_eval(node.value)
    return {}


FACADE = facade_exports()


def resolve(name: str) -> str | None:
    """The module of heron/ a dotted name reads: a name of the facade resolves to its defining
    module, anything else to its longest prefix that is a module or package of heron/. The bare
    root (``import heron`` for ``__version__``) is no edge: it loads nothing."""
    head, _, attr = name.partition(".")
    if head != "heron":
        return None
    if attr in FACADE:
        return FACADE[attr]
    parts = name.split(".")
    while len(parts) > 1:
        path = ROOT.parent.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    return None


def imported_names(node: ast.AST, package: list[str]) -> list[str]:
    """Dotted names an import statement reads (for ``from m import a``: m.a, which resolve()
    cuts back to m when a is not a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = package[:len(package) - node.level + 1] if node.level else []
    module = ".".join(base + ([node.module] if node.module else []))
    return [f"{module}.{alias.name}" for alias in node.names]


def all_edges() -> list[Edge]:
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        source = module_name(path)
        package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in imported_names(node, package):
                target = resolve(name)
                if target is not None and target != source:
                    where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                    edges.append(Edge(source, target, where))
    return edges


def upward(edge: Edge) -> bool:
    """True when the edge climbs: a leaf importing a package, anything but the top importing
    heron/__init__ or __main__, a package importing one above it (or unlisted: see below)."""
    src, dst = edge.floors()
    if src == dst or src in TOP:
        return False
    if not {src, dst} <= set(ORDER) | LEAVES:
        return False  # test_every_floor_has_a_place_in_the_order names it
    if src in LEAVES:
        return dst not in LEAVES
    if dst in LEAVES:
        return dst in TOP
    return ORDER.index(src) >= ORDER.index(dst)


def cycles(edges: list[Edge], key) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), nodes named by key."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        a, b = key(e)
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return all_edges()


def test_every_floor_has_a_place_in_the_order():
    floors = {floor(module_name(p)) for p in ROOT.rglob("*.py")}
    assert floors - set(ORDER) - LEAVES == set(), "add new packages to ORDER (and the README)"


def test_no_package_imports_upward(edges):
    bad = sorted(f"{e.where}: {e.source} -> {e.target}" for e in edges if upward(e))
    assert bad == [], "upward imports:\n" + "\n".join(bad)


def test_no_cycle_between_packages(edges):
    found = cycles(edges, Edge.floors)
    assert found == [], f"packages that import each other: {found}"


def test_no_cycle_between_modules(edges):
    # a package's __init__ re-exports its modules; a module importing from its own package's
    # __init__ would loop, so every edge between modules counts
    found = cycles(edges, lambda e: (e.source, e.target))
    assert found == [], f"modules that import each other: {found}"


def test_the_checker_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from heron.engine import core\n")
    names = [n for node in ast.walk(tree) for n in imported_names(node, ["heron", "worker"])]
    assert names == ["heron.engine.core"]
    assert upward(Edge("heron.worker.step", resolve(names[0]), "x"))
