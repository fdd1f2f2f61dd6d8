"""Parallel strategies by name: the built-ins, those registered in-process, and those plugins
return from the ``parallel_strategies`` hook. :func:`build_strategy` turns a run's
``parallel.strategy`` into the one :class:`ParallelStrategy` object the run uses."""

from __future__ import annotations

import difflib
from typing import Any

from speedtronic.errors import ConfigError, PluginError
from speedtronic.parallel.builtin import DataParallel, FullyShardedDataParallel
from speedtronic.parallel.context import ParallelContext
from speedtronic.parallel.strategy import ParallelStrategy, SingleProcess

__all__ = [
    "BUILTIN_STRATEGIES",
    "build_strategy",
    "known_strategies",
    "register_strategy",
    "unregister_strategy",
]

BUILTIN_STRATEGIES: dict[str, type[ParallelStrategy]] = {
    "none": SingleProcess,
    "ddp": DataParallel,
    "fsdp": FullyShardedDataParallel,
}
AUTO = "auto"  # ddp on several ranks, none on one

_REGISTERED: dict[str, type[ParallelStrategy]] = {}


def _checked(name: str, cls: Any, where: str) -> type[ParallelStrategy]:
    if not isinstance(name, str) or not name.isidentifier():
        raise PluginError(f"{where}: a parallel strategy's name must be an identifier: {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, ParallelStrategy)):
        raise PluginError(
            f"{where}: parallel strategy {name!r} must be a subclass of "
            f"speedtronic.parallel.ParallelStrategy, got {cls!r}"
        )
    if name in BUILTIN_STRATEGIES or name == AUTO:
        raise PluginError(f"{where}: {name!r} is a built-in parallel strategy's name")
    return cls


def register_strategy(name: str, cls: type[ParallelStrategy]) -> type[ParallelStrategy]:
    """Make ``cls`` the strategy ``parallel.strategy: <name>`` builds (in-process: tests,
    scripts; a distribution uses the ``parallel_strategies`` hook). Returns ``cls``."""
    _REGISTERED[name] = _checked(name, cls, "register_strategy")
    return cls


def unregister_strategy(name: str) -> None:
    """Forget an in-process strategy (no error if absent)."""
    _REGISTERED.pop(name, None)


def known_strategies(plugin_manager: Any = None) -> dict[str, type[ParallelStrategy]]:
    """Every strategy a run can name: built-ins, in-process registrations, then plugins'."""
    from speedtronic.plugins import call_each, get_plugin_manager

    found = {**BUILTIN_STRATEGIES, **_REGISTERED}
    manager = plugin_manager if plugin_manager is not None else get_plugin_manager()
    for plugin, contributed in call_each(manager.hook.parallel_strategies, {}):
        if not isinstance(contributed, dict):
            raise PluginError(
                f"plugin {plugin!r}: parallel_strategies must return a mapping of name to "
                f"class, got {type(contributed).__name__}"
            )
        for name, cls in contributed.items():
            checked = _checked(name, cls, f"plugin {plugin!r}")
            if name in found and found[name] is not checked:
                raise PluginError(
                    f"plugin {plugin!r}: parallel strategy {name!r} is already registered "
                    f"({found[name].__module__}.{found[name].__qualname__})"
                )
            found[name] = checked
    return found


def build_strategy(
    name: str, parallel: ParallelContext, plugin_manager: Any = None
) -> ParallelStrategy:
    """The strategy object of a run whose ``parallel.strategy`` is ``name``, over its ranks
    (``auto``: ``ddp`` when several ranks train, ``none`` on one)."""
    if name == AUTO:
        name = "ddp" if parallel.enabled else "none"
    if name in BUILTIN_STRATEGIES:
        return BUILTIN_STRATEGIES[name](parallel)
    known = known_strategies(plugin_manager)
    if name not in known:
        close = difflib.get_close_matches(name, [AUTO, *known], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"is {name!r}, which no built-in or installed plugin provides (known: "
            f"{', '.join([AUTO, *sorted(known)])}){hint}",
            "parallel.strategy",
        )
    return known[name](parallel)
