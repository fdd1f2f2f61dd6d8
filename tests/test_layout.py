"""The shape of every distribution's source: no import cycle between the modules of a package
and no room too big (files of at most 650 lines, classes of at most 400)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGES = ["speedtronic", "speedtronic_models", "speedtronic_diloco", "speedtronic_logging"]
MAX_FILE_LINES = 650
MAX_CLASS_LINES = 400


def package_dir(package: str) -> Path:
    return Path(importlib.import_module(package).__file__).parent  # type: ignore[arg-type]


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path, package: str) -> set[str]:
    """The ``package`` modules ``path`` imports when it is imported (imports inside functions
    and ``if TYPE_CHECKING:`` blocks are not taken at import time)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == package or name.startswith(f"{package}.")}


def import_graph(package: str) -> dict[str, set[str]]:
    root = package_dir(package)
    modules = {module_name(root, path): path for path in root.rglob("*.py")}
    return {
        name: {d for d in module_level_imports(path, package) if d in modules and d != name}
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph`` (``[a, b, a]``), or None."""
    done: set[str] = set()

    def walk(start: str, path: list[str]) -> list[str] | None:
        for dep in sorted(graph[start]):
            if dep in path:
                return [*path[path.index(dep) :], dep]
            if dep in done:
                continue
            found = walk(dep, [*path, dep])
            if found:
                return found
        done.add(start)
        return None

    for name in sorted(graph):
        found = walk(name, [name])
        if found:
            return found
    return None


def test_find_cycle_names_the_files_that_close_a_loop() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles_between_modules(package: str) -> None:
    cycle = find_cycle(import_graph(package))
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_diloco_transports_depend_on_nothing_above_them() -> None:
    graph = import_graph("speedtronic_diloco")
    assert "speedtronic_diloco.transports.shared_dir" in graph["speedtronic_diloco.transports"]
    assert not graph["speedtronic_diloco.transports.base"] - {"speedtronic_diloco.identity"}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_room_is_too_big(package: str) -> None:
    root = package_dir(package)
    too_big = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_big.append(f"{path.relative_to(root)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_big.append(f"{path.relative_to(root)}: class {node.name}, {size} lines")
    assert not too_big, too_big
