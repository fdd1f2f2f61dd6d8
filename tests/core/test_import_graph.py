"""The import graph of every module under ``speedtronic-*/src`` has no circle.

The graph is read statically with :mod:`ast`, so a module that cannot be imported here (an
optional dependency missing) is still checked. Every ``import`` and ``from ... import`` counts,
absolute or relative, at module level or inside a function: a function-level import only
postpones a circle to the first call, it does not remove the knot in the design; and an
import under ``if TYPE_CHECKING:`` counts too: it never runs, but two modules that each need
the other's types are one knot all the same (the usual way out is a structural protocol on the
side that only reads, as ``speedtronic.engine.run.ConfigLike`` and ``speedtronic_models.export.
LlamaLayout`` are). An import of a module through its parent package's name is an edge to that
module (``from speedtronic import errors`` is an edge to ``speedtronic.errors``, not to
``speedtronic/__init__.py``, when ``errors`` is a module).
Importing ``a.b.c`` executes ``a/__init__.py`` first; that implicit edge is not drawn either,
or every package whose ``__init__`` re-exports its submodules would be a circle by definition.

The test is parametrised per distribution, so a circle inside one of them fails that one alone
and the message names the files that close each loop, with line numbers.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = sorted(p.name for p in ROOT.glob("speedtronic-*") if (p / "src").is_dir())


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    distribution: str

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def discover() -> dict[str, Module]:
    """Every module of every distribution, by dotted name."""
    modules: dict[str, Module] = {}
    for distribution in DISTRIBUTIONS:
        src = ROOT / distribution / "src"
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = Module(".".join(parts), path, distribution)
    return modules


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (functions, ``if TYPE_CHECKING:`` blocks, ...)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def edges(modules: dict[str, Module]) -> dict[str, dict[str, int]]:
    """For each module, the modules of ours it imports and the line of the first import."""
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for module in modules.values():
        tree = ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
        for node in _import_nodes(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(module, node)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else base)
            for target in targets:
                # `import a.b.c` where only `a.b` is ours: the nearest module of ours.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module.name:
                    graph[module.name].setdefault(target, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        # Iterative, so a long chain of modules never reaches the recursion limit.
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def one_loop(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth-first)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component  # unreachable for a strongly connected component


def describe(modules: dict[str, Module], graph: dict[str, dict[str, int]], loop: list[str]) -> str:
    steps = []
    for here, there in itertools.pairwise(loop):
        path = modules[here].path.relative_to(ROOT)
        steps.append(f"{path}:{graph[here][there]} imports {there}")
    return "\n    ".join(steps)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_no_import_circle(distribution: str) -> None:
    modules = discover()
    graph = edges(modules)
    mine = [
        component
        for component in circles(graph)
        if any(modules[name].distribution == distribution for name in component)
    ]
    report = [
        f"circle of {len(component)} modules ({', '.join(component)}):\n    "
        + describe(modules, graph, one_loop(graph, component))
        for component in mine
    ]
    assert not report, "import circles under speedtronic-*/src:\n" + "\n".join(report)


def test_the_walker_sees_relative_function_level_and_type_checking_imports(
    tmp_path: Path,
) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from . import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
        "from .a import f\n"
    )
    (package / "c.py").write_text("import pkg.b\n")
    modules = {
        name: Module(name, package / f"{name.split('.')[-1]}.py", "x")
        for name in ("pkg.a", "pkg.b", "pkg.c")
    }
    modules["pkg"] = Module("pkg", package / "__init__.py", "x")
    graph = edges(modules)
    assert graph["pkg.a"] == {"pkg.b": 2} and graph["pkg.b"] == {"pkg.c": 3, "pkg.a": 4}
    assert graph["pkg.c"] == {"pkg.b": 1}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert one_loop(graph, ["pkg.a", "pkg.b"]) == ["pkg.a", "pkg.b", "pkg.a"]


FIRST_IMPORTS = """
import importlib, sys, traceback
import torch  # noqa: F401 - imported once: only speedtronic's own modules are re-imported
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "speedtronic" or m.startswith("speedtronic.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
"""


def test_every_core_module_imports_as_the_first_of_its_package() -> None:
    """What the graph above leaves out (a package's ``__init__`` runs before its submodule)
    can still close a loop at runtime: each module of core, imported first in a clean
    ``speedtronic`` namespace, must import."""
    names = sorted(
        name
        for name, module in discover().items()
        if module.distribution == "speedtronic-core" and module.path.name != "__main__.py"
    )
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORTS, *names],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", done.stdout
