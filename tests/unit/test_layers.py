"""The layers of DESIGN.md ("Layers and their rooms"), read from the source: the import graph of
the whole installed package, built from every import statement (module level, inside
functions, under ``TYPE_CHECKING``) without importing anything.

The folders ``membership/``, ``kernels/`` and ``chaos/`` install as ``elastic_refit.membership``,
``.kernels`` and ``.chaos`` (pyproject.toml's package-dir). An import names the most precise
module of the package it reaches: ``from elastic_refit.transport import nccl`` is the module
``elastic_refit.transport.nccl``, and a name a package exports lazily (its ``_EXPORTS``) is
the module that defines it, since using the name imports that module.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "elastic_refit"
# folder -> the import name it installs as (pyproject.toml [tool.setuptools.package-dir])
FOLDERS = {"elastic_refit": "elastic_refit", "membership": "elastic_refit.membership",
           "kernels": "elastic_refit.kernels", "chaos": "elastic_refit.chaos"}
# Packages that are not the library: what tests, demos and benchmarks need, the chaos
# harness, and the command line. Nothing else may import the first two.
TOOLKITS = ("elastic_refit.testing", "elastic_refit.chaos")
NOT_LIBRARY = (*TOOLKITS, "elastic_refit.cli")

def _module_name(path: Path) -> str | None:
    rel = path.relative_to(REPO)
    prefix = FOLDERS.get(rel.parts[0])
    if prefix is None:
        return None
    parts = list(rel.with_suffix("").parts[1:])
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


def _sources() -> dict[str, Path]:
    """module name -> source file, for every Python module the wheel installs."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            name = _module_name(path)
            if name is not None:
                out[name] = path
    return out


def _extension_modules() -> set[str]:
    """The compiled modules setup.py builds (``Extension("name", ...)``): modules of the
    package that import nothing of it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension"
            and node.args and isinstance(node.args[0], ast.Constant)}


def _lazy_exports(tree: ast.Module) -> dict[str, str]:
    """A package's ``_EXPORTS`` (public name -> defining module), when it is a literal."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {str(k): str(v) for k, v in value.items()}
    return {}


@dataclass(frozen=True)
class ImportGraph:
    modules: frozenset[str]
    edges: Mapping[str, frozenset[str]]  # module -> modules of the package it imports
    sites: Mapping[tuple[str, str], tuple[str, ...]]  # (importer, imported) -> "path:line", ...

    def imports(self, importer: Callable[[str], bool], imported: Callable[[str], bool]) -> list[str]:
        """Import sites where a module ``importer`` accepts imports one ``imported`` accepts."""
        return [f"{site}: {src} imports {dst}" for (src, dst), where in sorted(self.sites.items())
                if importer(src) and imported(dst) for site in where]


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def under(*prefixes: str) -> Callable[[str], bool]:
    """Accepts the packages ``prefixes`` and every module in them."""
    return lambda module: _under(module, prefixes)


def _resolve(module: str, modules: frozenset[str]) -> str | None:
    """The longest prefix of dotted ``module`` that is a module of the package."""
    parts = module.split(".")
    while parts:
        name = ".".join(parts)
        if name in modules:
            return name
        parts.pop()
    return None


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: frozenset[str],
             exports: Mapping[str, Mapping[str, str]]) -> set[str]:
    """The package's modules that one import statement names."""
    if isinstance(node, ast.Import):
        found = (_resolve(alias.name, modules) for alias in node.names)
        return {t for t in found if t is not None}
    base = node.module or ""
    if node.level:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    if _resolve(base, modules) is None:
        return set()  # a third-party or standard-library module
    out = set()
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:  # a submodule
            out.add(f"{base}.{alias.name}")
        elif alias.name in exports.get(base, {}):  # a lazily exported name: its module
            out.add(_resolve(exports[base][alias.name], modules) or base)
        else:
            out.add(_resolve(base, modules))
    return out


def build_graph() -> ImportGraph:
    sources = _sources()
    modules = frozenset(sources) | _extension_modules()
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in sources.items()}
    exports = {name: _lazy_exports(tree) for name, tree in trees.items() if sources[name].name == "__init__.py"}
    edges: dict[str, set[str]] = {name: set() for name in modules}  # (extensions: no edges)
    sites: dict[tuple[str, str], list[str]] = {}
    for name, tree in trees.items():
        is_package = sources[name].name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(node, name, is_package, modules, exports):
                if target == name:
                    continue
                edges[name].add(target)
                sites.setdefault((name, target), []).append(f"{sources[name].relative_to(REPO)}:{node.lineno}")
    return ImportGraph(modules, {k: frozenset(v) for k, v in edges.items()},
                       {k: tuple(v) for k, v in sites.items()})


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))
    return out


def one_cycle(edges: Mapping[str, Iterable[str]], component: frozenset[str]) -> list[str]:
    """A shortest cycle through the component's first module (by name), as a module path."""
    start = min(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(edges.get(node, ())):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child in component and child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def describe(graph: ImportGraph, component: frozenset[str]) -> str:
    cycle = one_cycle(graph.edges, component)
    steps = [f"  {a} -> {b} ({', '.join(graph.sites[(a, b)])})" for a, b in itertools.pairwise(cycle)]
    return f"{len(component)} modules: {sorted(component)}; e.g.\n" + "\n".join(steps)


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build_graph()


# ---- the checker itself ------------------------------------------------------------------
def test_the_graph_sees_the_whole_package_and_every_kind_of_import(graph):
    assert len(graph.modules) > 80, sorted(graph.modules)
    for folder_package in FOLDERS.values():
        assert folder_package in graph.modules
    # module level, inside a function, a lazily exported name, a relative import
    assert "elastic_refit.testing.processes" in graph.edges["elastic_refit.chaos.runner"]
    assert "elastic_refit.testing.job" in graph.edges["elastic_refit.chaos.trial"]  # inside Trial._start
    assert "elastic_refit.membership.client" in graph.edges["elastic_refit.chaos.trial"]  # EtcdClient, lazily
    assert "elastic_refit.cli._output" in graph.edges["elastic_refit.cli.demo_cmd"]
    # a compiled module (setup.py), not its package
    assert "elastic_refit.transport._digest" in graph.edges["elastic_refit.transport.buffers"]


def test_the_cycle_finder_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(map(sorted, strongly_connected(edges))) == [["a", "b", "c"], ["d", "e"]]
    assert one_cycle(edges, frozenset({"a", "b", "c"})) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_relative_and_submodule_imports_resolve():
    modules = frozenset({"p", "p.q", "p.q.r", "p.s"})
    rel = ast.parse("from .r import x\nfrom .. import s\nfrom . import r\n").body
    assert [_targets(n, "p.q.t", False, modules, {}) for n in rel] == [{"p.q.r"}, {"p.s"}, {"p.q.r"}]
    lazy = ast.parse("from p import Thing\nimport p.q.r.z\nimport numpy\n").body
    assert [_targets(n, "p.s", False, modules, {"p": {"Thing": "p.q.r"}}) for n in lazy] == [{"p.q.r"}, {"p.q.r"}, set()]


# ---- the layers --------------------------------------------------------------------------
def test_no_import_cycle_at_all(graph):
    cycles = strongly_connected(graph.edges)
    assert not cycles, "import cycles:\n" + "\n".join(describe(graph, c) for c in cycles)


def test_testing_never_imports_chaos(graph):
    """The chaos harness builds on the testing toolkit, never the reverse."""
    found = graph.imports(under("elastic_refit.testing"), under("elastic_refit.chaos"))
    assert not found, "\n".join(found)


def test_membership_imports_the_transport_protocol_never_a_concrete_transport(graph):
    """Membership asks the transport package's factory for transports (DESIGN: layers)."""
    found = graph.imports(under("elastic_refit.membership"),
                          under("elastic_refit.transport.nccl", "elastic_refit.transport.c10d"))
    assert not found, "\n".join(found)


def test_the_library_never_imports_the_toolkits(graph):
    """Nothing outside testing, chaos and the CLI imports testing or chaos."""
    library = {m for m in graph.modules if not _under(m, NOT_LIBRARY)}
    assert {"elastic_refit", "elastic_refit.runtime", "elastic_refit.membership.comm"} <= library
    found = graph.imports(library.__contains__, under(*TOOLKITS))
    assert not found, "\n".join(found)
