"""Lazy access to names that live in plugin distributions (the seed-era import paths).

Core never imports a plugin eagerly: these helpers run only when a user touches such a name.
"""

from __future__ import annotations

import importlib
from typing import Any


def import_plugin_module(module: str, distribution: str) -> Any:
    """Import ``module`` from a plugin distribution, or raise ImportError naming it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
            raise ImportError(
                f"{module} is provided by the {distribution} distribution: "
                f"pip install {distribution}"
            ) from None
        raise


def import_plugin_attr(module: str, attr: str, distribution: str) -> Any:
    """``getattr(import_plugin_module(module), attr)`` with the same clear error."""
    return getattr(import_plugin_module(module, distribution), attr)
