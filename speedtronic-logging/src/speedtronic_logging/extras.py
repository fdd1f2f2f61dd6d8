"""Lazy imports of the optional backends, failing with the extra that installs them.

Neither W&B nor TensorBoard is imported until a run enables it, so installing the plugin (and
discovering plugins) stays cheap and works without either backend.
"""

from __future__ import annotations

import importlib
from typing import Any

from speedtronic.errors import PluginError
from speedtronic.plugins import install_command

DISTRIBUTION = "speedtronic-logging"


def install_hint(extra: str) -> str:
    """The pip command that installs ``extra`` of this distribution (from the source checkout
    when there is one)."""
    return install_command(DISTRIBUTION, extra)


def require(module: str, extra: str, feature: str) -> Any:
    """Import ``module`` for ``feature`` (what asked for it: a config section or a sink class),
    or raise one PluginError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PluginError(
            f"{feature} needs {module}, which cannot be imported ({exc}); "
            f"install it with: {install_hint(extra)}"
        ) from None
