"""Seed-era path ``speedtronic.distributed``: re-exports speedtronic-diloco when installed.

Importing this module without speedtronic-diloco raises an ImportError that names the
distribution to install. Core itself never imports it.
"""

from __future__ import annotations

from speedtronic._lazy import import_plugin_module

_impl = import_plugin_module("speedtronic_diloco", "speedtronic-diloco")

__all__ = list(getattr(_impl, "__all__", []))
globals().update({name: getattr(_impl, name) for name in __all__})
