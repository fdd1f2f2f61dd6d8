"""The in-process model registry, itself a built-in plugin answering ``build_model``.

``register_model("name")`` keeps working for code that registers factories in-process;
:func:`build_model_from_hook` (exported as ``speedtronic.build_model``) asks every plugin
through the hook and names the known models when none answers.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar

from speedtronic.errors import ConfigError, PluginError
from speedtronic.hookspecs import hookimpl
from speedtronic.schema import IMPORT_PATH, suggest_key

__all__ = [
    "IMPORT_PATH",
    "build_model",
    "build_model_from_hook",
    "import_factory",
    "known_model_names",
    "register_model",
    "registered_models",
    "unregister_model",
]

F = TypeVar("F", bound=Callable[..., Any])

_FACTORIES: dict[str, Callable[..., Any]] = {}


def register_model(name: str, factory: Callable[..., Any] | None = None) -> Any:
    """Register a model factory ``factory(**params) -> nn.Module`` under ``name``.

    Use as a decorator (``@register_model("my_model")``) or call directly. Registering a name
    twice replaces the earlier factory.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("register_model needs a non-empty string name")

    def decorate(fn: F) -> F:
        _FACTORIES[name] = fn
        return fn

    if factory is not None:
        decorate(factory)  # type: ignore[arg-type]
        return factory
    return decorate


def unregister_model(name: str) -> None:
    """Forget an in-process factory (no error if absent)."""
    _FACTORIES.pop(name, None)


def registered_models() -> list[str]:
    """Names registered in-process with :func:`register_model`."""
    return sorted(_FACTORIES)


def __getattr__(name: str) -> Any:
    # This module is a plugin (plugins.DEFAULT_PLUGINS) and, like any plugin, lists the model
    # names it answers for in MODEL_NAMES; here the list changes as models are registered.
    if name == "MODEL_NAMES":
        return tuple(registered_models())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def build_model(name: str, params: dict[str, Any]) -> Any:
    """Answer for names registered with :func:`register_model` and for import paths
    ``package.module:factory``; ``None`` for any other."""
    factory = _FACTORIES.get(name)
    if factory is None and IMPORT_PATH.match(name):
        factory = import_factory(name)
    if factory is None:
        return None
    _check_params(name, factory, params)
    return factory(**params)


def import_factory(path: str, where: str = "model.name") -> Callable[..., Any]:
    """Resolve ``package.module:factory`` (a class or function) for YAML that names a factory
    without a plugin. Raises ConfigError naming ``where``."""
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for {path!r}: {exc}", where) from None
    except Exception as exc:  # the module raised on import; --debug shows its traceback
        raise ConfigError(
            f"importing {module_name!r} for {path!r} failed ({type(exc).__name__}: {exc})", where
        ) from exc
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{module_name!r} has no attribute {attribute!r}", where)
    if not callable(target):
        raise ConfigError(f"{path!r} is a {type(target).__name__}, not a factory", where)
    return target


def _check_params(name: str, factory: Callable[..., Any], params: dict[str, Any]) -> None:
    """Turn a parameter the factory does not take into a config error (not a TypeError deep in
    user code)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins and C callables: let the call itself decide
        return
    try:
        signature.bind(**params)
    except TypeError as exc:
        accepted = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        unexpected = [key for key in params if key not in accepted]
        if unexpected and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            key = unexpected[0]
            close = suggest_key(key, accepted)
            hint = f"; did you mean {close!r}?" if close else ""
            raise ConfigError(
                f"model {name!r} takes no parameter {key!r}{hint} "
                f"(it takes: {', '.join(accepted) or 'nothing'})",
                f"model.{key}",
            ) from None
        raise ConfigError(f"cannot build model {name!r}: {exc}", "model") from None


def known_model_names() -> list[str]:
    """Every model name registered in-process or declared by a plugin's ``MODEL_NAMES``."""
    from speedtronic.plugins import get_plugin_manager

    names = set(_FACTORIES)
    for plugin in get_plugin_manager().get_plugins():
        names.update(getattr(plugin, "MODEL_NAMES", ()))
    return sorted(names)


def build_model_from_hook(name: str, **params: Any) -> Any:
    """Build model ``name`` through the ``build_model`` hook; a clear error if nobody answers."""
    from speedtronic.plugins import get_plugin_manager, missing_provider_hint

    try:
        model = get_plugin_manager().hook.build_model(name=name, params=dict(params))
    except (MemoryError, RuntimeError) as exc:
        text = str(exc)
        if not isinstance(exc, MemoryError) and not (
            "can't allocate memory" in text or "out of memory" in text
        ):
            raise
        tried = re.search(r"allocate (\d+) bytes", text)
        size = f" (it tried to allocate {int(tried.group(1)) / 2**30:,.1f} GiB)" if tried else ""
        raise ConfigError(
            f"building model {name!r} needs more memory than there is{size}: check its sizes "
            "(vocab_size, d_model, n_layer, ...)",
            "model",
        ) from None
    if model is None:
        names = known_model_names()
        close = difflib.get_close_matches(name, names, n=1)
        suggestion = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"no plugin builds a model named {name!r}{suggestion}{missing_provider_hint(name)}. "
            f"Known models: {', '.join(names) or 'none'}. To add one: decorate a factory with "
            "@speedtronic.register_model('name') and load its module with --plugin MODULE, "
            "name the factory as 'package.module:function', or declare a plugin entry point "
            "(docs/plugins.md)",
            "model.name",
        )
    if not callable(model):
        raise PluginError(f"the build_model hook for {name!r} returned {type(model).__name__}")
    return model
