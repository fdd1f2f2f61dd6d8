"""The plugin manager: built-in plugins, entry-point discovery, and the plugin listing.

Built-in features (the model registry, the stdout/file/JSONL metric sinks) are registered
exactly like third-party plugins. Entry points in the ``speedtronic`` group are loaded lazily on
first use. ``SPEEDTRONIC_LOAD_PLUGINS`` restricts loading: unset loads every installed plugin,
an empty string loads none, and a comma-separated list loads only those entry-point names or
distributions.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from speedtronic import hookspecs

log = logging.getLogger("speedtronic.plugins")

ENTRY_POINT_GROUP = "speedtronic"
LOAD_PLUGINS_ENV = "SPEEDTRONIC_LOAD_PLUGINS"

DEFAULT_PLUGINS: tuple[str, ...] = ("speedtronic.registry",)

# Config sections and names that first-party distributions provide, so an error can say which
# distribution to install when the section or name is used without it.
KNOWN_PROVIDERS: dict[str, str] = {
    "distributed": "speedtronic-diloco",
    "wandb": "speedtronic-logging",
    "tensorboard": "speedtronic-logging",
    "reference_transformer": "speedtronic-models",
}

pm = pluggy.PluginManager("speedtronic")
pm.add_hookspecs(hookspecs)

_lock = threading.Lock()
_loaded = False
_failures: dict[str, str] = {}
_plugin_distributions: dict[str, tuple[str, str]] = {}


@dataclass(frozen=True)
class PluginInfo:
    """One row of ``speedtronic plugins``."""

    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]


def _wanted() -> set[str] | None:
    raw = os.environ.get(LOAD_PLUGINS_ENV)
    if raw is None:
        return None
    return {item.strip() for item in raw.split(",") if item.strip()}


def load_plugins() -> pluggy.PluginManager:
    """Register the built-in plugins and every allowed entry point (once per process)."""
    global _loaded
    with _lock:
        if _loaded:
            return pm
        _loaded = True
        for module_name in DEFAULT_PLUGINS:
            module = importlib.import_module(module_name)
            if not pm.is_registered(module):
                pm.register(module, name=module_name)
                _plugin_distributions[module_name] = ("speedtronic-core", _version("speedtronic-core"))
        wanted = _wanted()
        for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist_name = entry_point.dist.name if entry_point.dist else "unknown"
            if wanted is not None and entry_point.name not in wanted and dist_name not in wanted:
                continue
            if pm.get_plugin(entry_point.name) is not None:
                continue
            try:
                plugin = entry_point.load()
                pm.register(plugin, name=entry_point.name)
            except Exception as exc:  # a broken plugin must not take the run down with it
                message = f"{type(exc).__name__}: {exc}"
                _failures[entry_point.name] = dist_name
                log.warning(
                    "plugin %r from distribution %s failed to load (%s); continuing without it",
                    entry_point.name,
                    dist_name,
                    message,
                )
                continue
            version = entry_point.dist.version if entry_point.dist else "unknown"
            _plugin_distributions[entry_point.name] = (dist_name, version)
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with plugins loaded."""
    return load_plugins()


def register(plugin: Any, name: str | None = None, distribution: str = "in-process") -> str:
    """Register an in-process plugin object or module (tests, notebooks, scripts)."""
    load_plugins()
    registered = pm.register(plugin, name=name)
    if registered is None:
        raise ValueError(f"plugin {name or plugin!r} is already registered")
    _plugin_distributions[registered] = (distribution, "")
    return registered


def unregister(name: str) -> None:
    """Remove a plugin registered under ``name`` (no error if absent)."""
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
    _plugin_distributions.pop(name, None)


def failed_plugins() -> dict[str, str]:
    """Entry points that failed to import, mapped to their distribution."""
    load_plugins()
    return dict(_failures)


def missing_provider_hint(key: str) -> str:
    """A sentence telling which distribution provides ``key``, or an empty string."""
    dist = KNOWN_PROVIDERS.get(key)
    if dist is None:
        return ""
    if dist in _failures.values():
        return f" (provided by {dist}, which is installed but failed to load; see the warning above)"
    return f" (provided by {dist}: pip install {dist})"


def list_plugins() -> list[PluginInfo]:
    """Every registered plugin with its distribution, version and implemented hooks."""
    load_plugins()
    rows = []
    for name, plugin in pm.list_name_plugin():
        hooks = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or []))
        dist, version = _plugin_distributions.get(name, ("in-process", ""))
        rows.append(PluginInfo(name=name, distribution=dist, version=version, hooks=hooks))
    return sorted(rows, key=lambda row: row.name)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"
