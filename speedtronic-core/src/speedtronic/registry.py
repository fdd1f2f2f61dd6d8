"""The in-process model registry, itself a built-in plugin answering ``build_model``.

``register_model("name")`` keeps working for code that registers factories in-process;
:func:`build_model` asks every plugin (registry first, then entry points) through the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from speedtronic.errors import ConfigError, PluginError
from speedtronic.hookspecs import hookimpl

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


@hookimpl
def build_model(name: str, params: dict[str, Any]) -> Any:
    factory = _FACTORIES.get(name)
    if factory is None:
        return None
    return factory(**params)


def known_model_names() -> list[str]:
    """Every model name some plugin declares (plugins may expose ``MODEL_NAMES``)."""
    from speedtronic.plugins import get_plugin_manager

    names = set(_FACTORIES)
    for plugin in get_plugin_manager().get_plugins():
        names.update(getattr(plugin, "MODEL_NAMES", ()))
    return sorted(names)


def build_model_from_hook(name: str, **params: Any) -> Any:
    """Build model ``name`` through the ``build_model`` hook; a clear error if nobody answers."""
    from speedtronic.plugins import get_plugin_manager, missing_provider_hint

    model = get_plugin_manager().hook.build_model(name=name, params=dict(params))
    if model is None:
        known = ", ".join(known_model_names()) or "none"
        raise ConfigError(
            f"no plugin builds a model named {name!r}{missing_provider_hint(name)}; "
            f"known models: {known}",
            "model.name",
        )
    if not callable(model):
        raise PluginError(f"the build_model hook for {name!r} returned {type(model).__name__}")
    return model
