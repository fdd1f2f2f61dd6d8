"""Core's declared public API, and the rule that plugin distributions use nothing else.

A public core module is one whose dotted path has no ``_``-prefixed part and which declares
``__all__``; a public name is one listed there. The plugin distributions of this repository
(models, diloco, logging) are checked statically: every ``import speedtronic...`` and
``from speedtronic... import name`` in their sources must name a public module and a public
name, so a refactor of core's insides cannot silently break a plugin.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import speedtronic

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_SOURCES = [
    ROOT / "speedtronic-models" / "src",
    ROOT / "speedtronic-diloco" / "src",
    ROOT / "speedtronic-logging" / "src",
]
# `speedtronic.distributed` is a seed-era alias that resolves names from speedtronic-diloco.
LAZY_ALIASES = {"speedtronic.distributed"}


def core_modules() -> list[str]:
    names = ["speedtronic"]
    for info in pkgutil.walk_packages(speedtronic.__path__, "speedtronic."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        names.append(info.name)
    return sorted(names)


def public_names(module_name: str) -> set[str] | None:
    """``__all__`` of a public core module, or None when it is not one."""
    if any(part.startswith("_") for part in module_name.split(".")):
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    declared = getattr(module, "__all__", None)
    return set(declared) if declared is not None else None


def violations(source: str, filename: str = "<plugin>") -> list[str]:
    """Every use of a non-public core module or name in one plugin source file."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [(node.module, [alias.name for alias in node.names])]
        elif isinstance(node, ast.Import):
            modules = [(alias.name, []) for alias in node.names]
        else:
            continue
        for module_name, names in modules:
            if module_name != "speedtronic" and not module_name.startswith("speedtronic."):
                continue
            declared = public_names(module_name)
            if declared is None:
                found.append(f"{filename}:{node.lineno}: {module_name} is not a public module")
                continue
            for name in names:
                submodule = f"{module_name}.{name}"
                if name in declared or (
                    not name.startswith("_") and public_names(submodule) is not None
                ):
                    continue
                found.append(f"{filename}:{node.lineno}: {module_name}.{name} is not public")
    return found


@pytest.mark.parametrize("module_name", core_modules())
def test_every_public_core_module_declares_what_it_exports(module_name: str) -> None:
    module = importlib.import_module(module_name)
    declared = getattr(module, "__all__", None)
    assert declared is not None, f"{module_name} has no __all__"
    if module_name in LAZY_ALIASES:
        return
    missing = [name for name in declared if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names what it does not define: {missing}"


def test_plugin_distributions_use_only_cores_public_api() -> None:
    found = []
    for source_root in PLUGIN_SOURCES:
        for path in sorted(source_root.rglob("*.py")):
            found += violations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "from speedtronic.plugins import _failures",
        "from speedtronic._lazy import import_plugin_attr",
        "import speedtronic._lazy",
        "from speedtronic.engine.trainer import log",
        "from speedtronic.no_such_module import x",
    ],
)
def test_the_check_catches_private_and_undeclared_imports(line: str) -> None:
    assert violations(line)


def test_the_check_accepts_public_imports() -> None:
    source = (
        "from speedtronic import hookimpl, SpeedtronicConfig\n"
        "from speedtronic.checkpoint import fileio\n"
        "from speedtronic.checkpoint.fileio import atomic_write_bytes\n"
        "import speedtronic.errors\n"
    )
    assert violations(source) == []
