"""Names imported on first use: those that live in plugin distributions (the seed-era import
paths; core never imports a plugin eagerly, and a missing distribution becomes an ImportError
that says what to install), and the exports of core's own packages that must stay cheap to
import (:func:`lazy_exports`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def import_plugin_module(module: str, distribution: str) -> Any:
    """Import ``module`` from a plugin distribution, or raise ImportError naming it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # Only the plugin itself being absent is translated; a missing dependency *inside* an
        # installed plugin keeps its own, more precise error.
        if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
            from speedtronic.install_hints import install_command

            raise ImportError(
                f"{module} is provided by the {distribution} distribution, which is not "
                f"installed: {install_command(distribution)}",
                name=module,
            ) from None
        raise


def import_plugin_attr(module: str, attr: str, distribution: str) -> Any:
    """``getattr(import_plugin_module(module), attr)``, with an ImportError naming
    ``distribution`` when the module or the name is missing."""
    imported = import_plugin_module(module, distribution)
    try:
        return getattr(imported, attr)
    except AttributeError:
        version = getattr(imported, "__version__", "unknown")
        raise ImportError(
            f"the installed {distribution} ({version}) does not provide {attr}; "
            f"pip install --upgrade {distribution}",
            name=module,
        ) from None


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, str]], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` that import its names on first use:
    ``exports`` maps a name to ``(submodule, attribute)``. A package whose ``__init__`` imports
    nothing stays cheap to import (no torch) while ``from package import name`` still works."""
    namespace = sys.modules[package].__dict__
    names = sorted(set(public))

    def __getattr__(name: str) -> Any:
        try:
            module, attribute = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f"{package}.{module}"), attribute)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__


def by_module(names_of: Mapping[str, Iterable[str]]) -> dict[str, tuple[str, str]]:
    """:func:`lazy_exports`' table from ``{submodule: names it defines}``."""
    return {name: (module, name) for module, names in names_of.items() for name in names}
