"""Lazy access to names that live in plugin distributions (the seed-era import paths).

Core never imports a plugin eagerly: these helpers run only when a user touches such a name,
and a missing distribution becomes an ImportError that says what to install.
"""

from __future__ import annotations

import importlib
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
