"""The shape of every distribution's source: no room too big (files of at most 650 lines,
classes of at most 400, a class counted together with the classes of this repository it
inherits from: a mixin split off a big class is the same room). Import circles:
tests/core/test_import_graph.py."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
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


def test_diloco_transports_depend_on_nothing_above_them() -> None:
    graph = import_graph("speedtronic_diloco")
    assert "speedtronic_diloco.transports.shared_dir" in graph["speedtronic_diloco.transports"]
    leaves = {"speedtronic_diloco.identity", "speedtronic_diloco.timestamps"}  # stdlib only
    assert not graph["speedtronic_diloco.transports.base"] - leaves
    assert all(not graph[leaf] for leaf in leaves)


@dataclass
class ClassRoom:
    """One class of the repository: where it is, its own lines, the classes of the repository
    it names as bases."""

    module: str
    name: str
    path: Path
    lines: int
    bases: list[tuple[str, str]] = field(default_factory=list)


def _imported_names(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """``local name -> (module, name)`` for every ``from module import name [as local]``."""
    names: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module, alias.name)
    return names


def class_rooms(packages: list[str]) -> dict[tuple[str, str], ClassRoom]:
    """Every class of ``packages`` by (module, name), each with its in-repository bases (a
    base named directly, or imported by name from a module of the repository, also through
    a package that re-exports it)."""
    rooms: dict[tuple[str, str], ClassRoom] = {}
    pending: list[tuple[ClassRoom, list[ast.expr], dict[str, tuple[str, str]]]] = []
    for package in packages:
        root = package_dir(package)
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            module = module_name(root, path)
            imported = _imported_names(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    size = (node.end_lineno or node.lineno) - node.lineno + 1
                    room = ClassRoom(module, node.name, path, size)
                    rooms[(module, node.name)] = room
                    pending.append((room, node.bases, imported))
    exports = {key: key for key in rooms}
    for package in packages:  # `from speedtronic.checkpoint import X` where X lives deeper
        root = package_dir(package)
        for path in root.rglob("__init__.py"):
            package_name = module_name(root, path)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for local, target in _imported_names(tree).items():
                if target in rooms:
                    exports[(package_name, local)] = target
    for room, bases, imported in pending:
        for base in bases:
            if isinstance(base, ast.Name):
                target = imported.get(base.id, (room.module, base.id))
                if target in exports:
                    room.bases.append(exports[target])
    return rooms


def with_bases(rooms: dict[tuple[str, str], ClassRoom], key: tuple[str, str]) -> Iterator[str]:
    """The class and every in-repository class it inherits from, each once (as module.name)."""
    seen: set[tuple[str, str]] = set()
    stack = [key]
    while stack:
        current = stack.pop()
        if current in seen or current not in rooms:
            continue
        seen.add(current)
        yield ".".join(current)
        stack.extend(rooms[current].bases)


def room_size(rooms: dict[tuple[str, str], ClassRoom], key: tuple[str, str]) -> int:
    return sum(rooms[tuple(name.rsplit(".", 1))].lines for name in with_bases(rooms, key))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_room_is_too_big(package: str) -> None:
    root = package_dir(package)
    too_big = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_FILE_LINES:
            too_big.append(f"{path.relative_to(root)}: {lines} lines")
    rooms = class_rooms(PACKAGES)
    for key, room in sorted(rooms.items()):
        if room.module.split(".")[0] != package:
            continue
        size = room_size(rooms, key)
        if size > MAX_CLASS_LINES:
            counted = ", ".join(with_bases(rooms, key))
            too_big.append(
                f"{room.path.relative_to(root)}: class {room.name}, {size} lines ({counted})"
            )
    assert not too_big, too_big


def test_a_class_is_counted_with_its_bases_of_this_repository() -> None:
    """The walker finds a base class imported from another module of the repository and adds
    its lines (a mixin split off a big class would count with it)."""
    rooms = class_rooms(PACKAGES)
    child = ("speedtronic.parallel.builtin", "DataParallel")
    base = ("speedtronic.parallel.strategy", "ParallelStrategy")
    assert rooms[child].bases == [base] and rooms[base].bases == []
    assert room_size(rooms, child) == rooms[child].lines + rooms[base].lines
    assert list(with_bases(rooms, child)) == [".".join(child), ".".join(base)]
