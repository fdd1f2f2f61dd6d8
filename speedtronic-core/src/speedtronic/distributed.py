"""Seed-era path ``speedtronic.distributed``: speedtronic-diloco's public API, when installed.

Importing this module without speedtronic-diloco raises an ImportError that names the
distribution to install. Core itself never imports it.
"""

from __future__ import annotations

from typing import Any

from speedtronic._lazy import import_plugin_attr, import_plugin_module

_MODULE = "speedtronic_diloco"
_DISTRIBUTION = "speedtronic-diloco"

_impl = import_plugin_module(_MODULE, _DISTRIBUTION)

__all__ = list(getattr(_impl, "__all__", []))


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(f"module 'speedtronic.distributed' has no attribute {name!r}")
    return import_plugin_attr(_MODULE, name, _DISTRIBUTION)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(_impl)))
