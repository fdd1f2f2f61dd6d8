"""The plugin manager: built-in plugins, entry-point discovery, and the plugin listing.

Built-in plugins are registered exactly like third-party ones. Entry points in the
``speedtronic`` group are loaded once, on first use of the plugin manager, never at
``import speedtronic``. A plugin that fails to import (or implements a hook that does not exist)
is reported in one warning naming its entry point and distribution, and the run goes on
without it.

``SPEEDTRONIC_LOAD_PLUGINS`` restricts loading, for debugging: unset loads every installed
plugin, an empty string loads none (built-ins only), and a comma-separated list loads only the
entry points or distributions it names.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from speedtronic import hookspecs
from speedtronic.install_hints import CORE_DISTRIBUTION, install_command

__all__ = [
    "CORE_DISTRIBUTION",
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "KNOWN_PROVIDERS",
    "LOAD_PLUGINS_ENV",
    "PROVIDED_EXTRAS",
    "PROVIDED_MODELS",
    "PROVIDED_SECTIONS",
    "FailedPlugin",
    "PluginInfo",
    "call_each",
    "get_plugin_manager",
    "hook_names",
    "install_command",
    "list_plugins",
    "load_filter",
    "load_plugins",
    "missing_provider_hint",
    "normalize_distribution",
    "pm",
    "provided_by",
    "register",
    "unregister",
]

log = logging.getLogger("speedtronic.plugins")

ENTRY_POINT_GROUP = "speedtronic"
LOAD_PLUGINS_ENV = "SPEEDTRONIC_LOAD_PLUGINS"

# The stdout/file/JSONL metric sinks are not here on purpose: they are per-run objects built
# from the `logging` section and owned by the run's MetricLogger. `on_metric` carries no run,
# so a module-level sink would have to keep process-global state shared by every run.
DEFAULT_PLUGINS: tuple[str, ...] = ("speedtronic.registry",)

# What the first-party distributions provide, so an error can say which distribution to install
# when a config uses it without that distribution: top-level config sections, and model names.
PROVIDED_SECTIONS: dict[str, str] = {
    "distributed": "speedtronic-diloco",
    "wandb": "speedtronic-logging",
    "tensorboard": "speedtronic-logging",
}
PROVIDED_MODELS: dict[str, str] = {
    "reference_transformer": "speedtronic-models",
    "hf_causal_lm": "speedtronic-models",
}
# Both tables in one, for look-ups that only need "who provides this key".
KNOWN_PROVIDERS: dict[str, str] = {**PROVIDED_SECTIONS, **PROVIDED_MODELS}
# The extra of that distribution a key needs besides it (the backend library).
PROVIDED_EXTRAS: dict[str, str] = {"wandb": "wandb", "tensorboard": "tensorboard"}

pm = pluggy.PluginManager("speedtronic")
pm.add_hookspecs(hookspecs)

# Re-entrant: a plugin module may touch the plugin manager while it is being imported.
_lock = threading.RLock()
_loaded = False
_failures: dict[str, FailedPlugin] = {}
_skipped: dict[str, str] = {}
_plugin_distributions: dict[str, tuple[str, str]] = {}


@dataclass(frozen=True)
class PluginInfo:
    """One row of ``speedtronic plugins``."""

    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]
    error: str = ""
    # What it adds, e.g. ("model reference_transformer", "section distributed", "command x").
    provides: tuple[str, ...] = ()


@dataclass(frozen=True)
class FailedPlugin:
    """An entry point that could not be loaded, and why."""

    name: str
    distribution: str
    version: str
    error: str


def normalize_distribution(name: str) -> str:
    """PEP 503 normalisation, so ``Speedtronic_Diloco`` and ``speedtronic-diloco`` compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


def load_filter() -> set[str] | None:
    """The names allowed by ``SPEEDTRONIC_LOAD_PLUGINS`` (normalised), or None when unset."""
    raw = os.environ.get(LOAD_PLUGINS_ENV)
    if raw is None:
        return None
    return {normalize_distribution(item.strip()) for item in raw.split(",") if item.strip()}


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
            _plugin_distributions[module_name] = (CORE_DISTRIBUTION, _version(CORE_DISTRIBUTION))
        wanted = load_filter()
        matched: set[str] = set()
        for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist_name = entry_point.dist.name if entry_point.dist else "unknown"
            version = entry_point.dist.version if entry_point.dist else "unknown"
            keys = {normalize_distribution(entry_point.name), normalize_distribution(dist_name)}
            if wanted is not None and not keys & wanted:
                _skipped[entry_point.name] = dist_name
                continue
            matched |= keys
            if pm.has_plugin(entry_point.name):
                log.warning(
                    "plugin %r from distribution %s is ignored: a plugin of that name is "
                    "already registered",
                    entry_point.name,
                    dist_name,
                )
                continue
            _load_entry_point(entry_point, dist_name, version)
        for name in sorted((wanted or set()) - matched):
            log.warning("%s names %r, which is not an installed plugin", LOAD_PLUGINS_ENV, name)
    return pm


def _load_entry_point(entry_point: Any, dist_name: str, version: str) -> None:
    try:
        plugin = entry_point.load()
        pm.register(plugin, name=entry_point.name)
    except Exception as exc:  # a broken plugin must not take the run down with it
        _fail(entry_point.name, dist_name, version, f"{type(exc).__name__}: {exc}")
        return
    unknown = sorted(c.name for c in pm.get_hookcallers(plugin) or [] if not c.has_spec())
    if unknown:
        pm.unregister(plugin)
        _fail(entry_point.name, dist_name, version, _unknown_hooks_message(unknown))
        return
    _plugin_distributions[entry_point.name] = (dist_name, version)


def _unknown_hooks_message(unknown: list[str]) -> str:
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, hook_names(), n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return "implements unknown hook " + ", ".join(parts)


def _fail(name: str, dist_name: str, version: str, error: str) -> None:
    _failures[name] = FailedPlugin(name, dist_name, version, error)
    log.warning(
        "plugin %r from distribution %s failed to load (%s); continuing without it",
        name,
        dist_name,
        error.splitlines()[0] if error else "unknown error",
    )


def call_each(
    caller: Any,
    arguments: dict[str, Any],
    on_error: Callable[[str, Exception], None] | None = None,
) -> list[tuple[str, Any]]:
    """Call every implementation of one hook on its own, in pluggy's order (newest first).

    Returns ``(plugin name, result)`` pairs. With ``on_error``, an implementation that raises is
    reported as ``on_error(plugin_name, exc)`` and the others still run (per-plugin failure
    isolation, which a plain ``pm.hook.x(...)`` call does not give); without it the exception
    propagates. Each implementation receives the subset of ``arguments`` it names, as pluggy
    passes them, so one written for fewer arguments keeps working.
    """
    results: list[tuple[str, Any]] = []
    for impl in reversed(caller.get_hookimpls()):
        if getattr(impl, "hookwrapper", False) or getattr(impl, "wrapper", False):
            continue  # wrappers only make sense around a full hook call
        args = [arguments[name] for name in impl.argnames]
        if on_error is None:
            results.append((impl.plugin_name, impl.function(*args)))
            continue
        try:
            results.append((impl.plugin_name, impl.function(*args)))
        except Exception as exc:
            on_error(impl.plugin_name, exc)
    return results


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with plugins loaded."""
    return load_plugins()


def hook_names() -> list[str]:
    """Names of every hook in :mod:`speedtronic.hookspecs`, in definition order."""
    return [
        name
        for name, value in vars(hookspecs).items()
        if callable(value) and hasattr(value, "speedtronic_spec")
    ]


def register(plugin: Any, name: str | None = None, distribution: str = "in-process") -> str:
    """Register an in-process plugin object or module (tests, notebooks, scripts)."""
    load_plugins()
    registered = pm.register(plugin, name=name)
    if registered is None:
        raise ValueError(f"plugin {name or plugin!r} is blocked")
    _plugin_distributions[registered] = (distribution, "")
    return registered


def unregister(name: str) -> None:
    """Remove a plugin registered under ``name`` (no error if absent)."""
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
    _plugin_distributions.pop(name, None)


def missing_provider_hint(key: str) -> str:
    """A parenthesised sentence saying which distribution would provide ``key``, or ``""``.

    ``key`` is a config section or model name that nothing loaded provides. The hint covers a
    first-party distribution that is not installed, installed but failed to load, excluded by
    ``SPEEDTRONIC_LOAD_PLUGINS``, or installed in a version without it; and any third-party
    plugin that failed to load and might have provided it.
    """
    load_plugins()
    dist = KNOWN_PROVIDERS.get(key)
    if dist is not None:
        wanted = normalize_distribution(dist)
        failed = [f for f in _failures.values() if normalize_distribution(f.distribution) == wanted]
        if failed:
            return (
                f" (provided by {dist}, which is installed but failed to load: "
                f"{failed[0].error}; reinstall it with pip install --force-reinstall {dist})"
            )
        if any(normalize_distribution(d) == wanted for d in _skipped.values()):
            return (
                f" (provided by {dist}, which is installed but not loaded because "
                f"{LOAD_PLUGINS_ENV}={os.environ.get(LOAD_PLUGINS_ENV, '')!r})"
            )
        version = _version(dist)
        if version != "unknown":
            return (
                f" (expected from {dist}, but the installed version {version} does not provide "
                f"it; pip install --upgrade {dist})"
            )
        return f" (provided by {dist}: {install_command(dist, PROVIDED_EXTRAS.get(key, ''))})"
    same_name = _failures.get(key)
    if same_name is not None:
        return (
            f" (plugin {key!r} from {same_name.distribution} failed to load: {same_name.error}; "
            f"fix or reinstall {same_name.distribution})"
        )
    if _failures:
        names = ", ".join(f"{f.name!r} from {f.distribution}" for f in _failures.values())
        return f" (plugins that failed to load and may provide it: {names})"
    return ""


def list_plugins() -> list[PluginInfo]:
    """Every registered plugin, then every failed one, with distribution, version and hooks."""
    load_plugins()
    rows = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # a blocked name
            continue
        hooks = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or []))
        dist, version = _plugin_distributions.get(name, ("in-process", ""))
        rows.append(
            PluginInfo(name, dist, version, hooks=hooks, provides=provided_by(name, plugin, hooks))
        )
    rows.sort(key=lambda row: row.name)
    failed = [
        PluginInfo(f.name, f.distribution, f.version, hooks=(), error=f.error)
        for f in _failures.values()
    ]
    return rows + failed


def provided_by(name: str, plugin: Any, hooks: tuple[str, ...]) -> tuple[str, ...]:
    """What one plugin adds: its model names, config sections and CLI commands (each asked of
    that plugin alone; a plugin that fails to answer simply lists less)."""
    import argparse

    provides = [f"model {model}" for model in getattr(plugin, "MODEL_NAMES", ())]
    others = [p for p in pm.get_plugins() if p is not plugin]

    def ignore(plugin_name: str, exc: Exception) -> None:
        log.debug("plugin %r could not say what it provides: %s", plugin_name, exc)

    if "config_sections" in hooks:
        caller = pm.subset_hook_caller("config_sections", remove_plugins=others)
        for _, sections in call_each(caller, {}, ignore):
            provides += [f"section {section}" for section in sections or {}]
    if "register_commands" in hooks:
        scratch = argparse.ArgumentParser().add_subparsers()
        caller = pm.subset_hook_caller("register_commands", remove_plugins=others)
        call_each(caller, {"subparsers": scratch}, ignore)
        provides += [f"command {command}" for command in scratch.choices]
    return tuple(provides)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"
