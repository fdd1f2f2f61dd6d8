"""Strict, typed config sections built from dataclasses.

Every config section (core's and plugins') is a dataclass. Subclassing :class:`Section` gives
it the house rules on construction: values are coerced to the annotated types (``"false"`` is
``False``, ``"3"`` is ``3``; garbage is an error), nested mappings become nested sections,
unknown keys fail with a "did you mean" suggestion, and the numeric bounds and choices declared
with :func:`option` are checked. Each error is a :class:`~speedtronic.errors.ConfigError`
naming the dotted field.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import operator
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Union

from speedtronic.errors import ConfigError

__all__ = [
    "BOUNDS",
    "IMPORT_PATH",
    "REDACTED",
    "Section",
    "build_section",
    "coerce",
    "describe_type",
    "field_hints",
    "may_hold_secret",
    "option",
    "section_to_dict",
    "suggest_key",
    "unknown_key_error",
    "without_secrets",
]

# `package.module:attribute`, the form entry points use (a factory or hook named in YAML).
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
# The bounds option() accepts: (keyword, test, symbol), in the order they are checked and shown.
BOUNDS = (
    ("ge", operator.ge, ">="),
    ("gt", operator.gt, ">"),
    ("le", operator.le, "<="),
    ("lt", operator.lt, "<"),
)


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    secret: bool = False,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A documented dataclass field with optional bounds.

    ``help`` feeds the generated configuration reference. ``secret`` fields are replaced by
    ``<redacted>`` whenever a config is saved or shown.
    """
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "secret": secret}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Section:
    """Mixin for config dataclasses: coerces and checks fields in ``__post_init__``.

    Subclasses may define ``validate(self)`` for cross-field rules; raise ``ConfigError`` with
    ``path`` set to the field name.
    """

    def __post_init__(self) -> None:
        hints = field_hints(type(self))
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        guarded = any(f.metadata.get("secret") for f in fields)
        for field in fields:
            value = getattr(self, field.name)
            try:
                value = coerce(value, hints[field.name])
            except ConfigError as exc:
                if _carries_text(value) and (guarded or may_hold_secret(field.name, value)):
                    # Never echo what may be a credential put into the wrong field.
                    raise ConfigError(
                        f"expected {describe_type(hints[field.name])} (the value is not shown: "
                        "it may be a secret)",
                        field.name,
                    ) from None
                raise exc.under(field.name) from None
            _check_bounds(field, value)
            object.__setattr__(self, field.name, value)
        validate = getattr(self, "validate", None)
        if validate is not None:
            try:
                validate()
            except ConfigError as exc:
                secrets = [getattr(self, f.name) for f in fields if f.metadata.get("secret")]
                raise without_secrets(exc, secrets) from None


def without_secrets(error: ConfigError, secrets: Iterable[Any]) -> ConfigError:
    """``error`` with every occurrence of a secret value (a non-empty string among
    ``secrets``) in its message replaced by ``<redacted>``: a credential put into another
    field is never echoed back by that field's check."""
    message = error.message
    for secret in secrets:
        if not isinstance(secret, str) or not secret.strip():
            continue
        # As given, and as repr() shows it (escaped backslashes and quotes).
        for shown in (secret, repr(secret)[1:-1]):
            message = message.replace(shown, REDACTED)
    if message == error.message:
        return error
    return ConfigError(message, error.path)


_SECRET_NAME = re.compile(r"token|secret|passw|api_?key|credential|auth", re.IGNORECASE)
_SECRET_VALUE = re.compile(r"^(hf_|sk-|ghp_|gho_|xox[bp]-)|^[A-Za-z0-9_\-]{32,}$")


def may_hold_secret(name: str, value: Any) -> bool:
    """True when a field's name, or a rejected string's shape, suggests a credential."""
    if _SECRET_NAME.search(name):
        return True
    if isinstance(value, Mapping):
        return any(may_hold_secret("", v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(may_hold_secret("", v) for v in value)
    return isinstance(value, str) and bool(_SECRET_VALUE.search(value.strip()))


def _carries_text(value: Any) -> bool:
    """True when ``value`` is or contains a string (numbers and flags are never secrets)."""
    if isinstance(value, str):
        return True
    if isinstance(value, Mapping):
        return any(_carries_text(k) or _carries_text(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_carries_text(v) for v in value)
    return False


def build_section(cls: type, data: Any, path: str) -> Any:
    """Build the dataclass ``cls`` from a mapping, with errors located under ``path``."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping, got {type(data).__name__}", path)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    for key in data:
        if key not in names:
            raise unknown_key_error(str(key), names, path)
    for field in fields:
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        if required and field.name not in data:
            where = f"{path}.{field.name}" if path else field.name
            raise ConfigError("required key is missing", where)
    try:
        return cls(**dict(data))
    except ConfigError as exc:
        raise exc.under(path) from None


# Names other trainers use for a key, mapped to ours; suggested only where ours is known.
KEY_SYNONYMS: dict[str, tuple[str, ...]] = {
    "learning_rate": ("lr",),
    "batch_size": ("micro_batch_size",),
    "train_batch_size": ("target_batch_size", "micro_batch_size"),
    "gradient_accumulation_steps": ("target_batch_size",),
    "max_iters": ("max_steps",),
    "num_steps": ("max_steps",),
    "steps": ("max_steps",),
    "warmup": ("warmup_steps",),
    "warmup_iters": ("warmup_steps",),
    "clip_grad": ("grad_clip",),
    "max_grad_norm": ("grad_clip",),
    "block_size": ("max_seq_len", "seq_len"),
    "context_length": ("max_seq_len", "seq_len"),
    "n_embd": ("d_model",),
    "hidden_size": ("d_model",),
    "num_layers": ("n_layer",),
    "n_layers": ("n_layer",),
    "num_heads": ("n_head",),
    "n_heads": ("n_head",),
    "eval_interval": ("every",),
    "interval": ("every",),
    "eval_iters": ("batches",),
    "dtype": ("mode",),
    "out_dir": ("output_dir",),
}


def _initials(name: str) -> str:
    return "".join(part[0] for part in name.split("_") if part)


def suggest_key(key: str, known: list[str]) -> str | None:
    """The known key a mistyped or foreign ``key`` most likely meant, or None: a synonym from
    another trainer (``learning_rate`` -> ``lr``), a close spelling, an abbreviation
    (``wd`` -> ``weight_decay``) or a name one contains (``batch_size`` in
    ``micro_batch_size``). Every config section suggests through this one function."""
    for candidate in KEY_SYNONYMS.get(key.lower(), ()):
        if candidate in known:
            return candidate
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return close[0]
    lowered = key.lower()
    for name in known:
        if ("_" in name and _initials(name) == lowered) or ("_" in key and _initials(key) == name):
            return name
    if len(lowered) >= 4:
        contained = [
            name for name in known if lowered in name or (len(name) >= 4 and name in lowered)
        ]
        if len(contained) == 1:
            return contained[0]
    return None


def unknown_key_error(key: str, known: list[str], path: str, hint: str = "") -> ConfigError:
    """The error for an unknown key, with a "did you mean" suggestion when one is close."""
    where = f"{path}.{key}" if path else key
    close = suggest_key(key, known)
    suggestion = f"; did you mean {close!r}?" if close else ""
    return ConfigError(f"unknown key{suggestion}{hint}", where)


def coerce(value: Any, annotation: Any) -> Any:
    """Convert ``value`` to ``annotation``: bool, int, float, str, Literal, Optional/unions,
    list, tuple, dict, or a nested section dataclass."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except ConfigError as exc:
                errors.append(exc.message)
        raise ConfigError("; ".join(errors))
    if origin is Literal:
        if value in args:
            return value
        choices = ", ".join(repr(a) for a in args)
        names = [str(a) for a in args]
        same_case = [n for n in names if n.lower() == str(value).lower()]
        close = same_case or difflib.get_close_matches(str(value), names, n=1, cutoff=0.5)
        suggestion = f"; did you mean {close[0]!r}?" if close and isinstance(value, str) else ""
        raise ConfigError(f"must be one of {choices} (got {_shown(value)}){suggestion}")
    if origin in (list, tuple):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list, got {type(value).__name__} {_shown(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"expected {len(args)} items, got {len(value)}")
            return tuple(coerce(v, a) for v, a in zip(value, args))
        inner = args[0] if args else Any
        items = [coerce(v, inner) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a mapping, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return build_section(annotation, value, "")
    if annotation is bool:
        return _to_bool(value)
    if annotation is int:
        return _to_int(value)
    if annotation is float:
        return _to_float(value)
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"expected a string, got {type(value).__name__}")
    return value


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    raise ConfigError(f"expected a boolean (true/false), got {value!r}")


# Every integer option fits a signed 64-bit integer (what torch and NumPy take); a value
# beyond that is a typo or an attack, never a setting.
INT_LIMIT = 2**63


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"expected an integer, got {value!r}")
    number: int | None = None
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and len(value) <= 40:
        try:
            number = int(value.strip().replace("_", ""))
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"expected an integer, got {_shown(value)}")
    if not -INT_LIMIT <= number < INT_LIMIT:
        raise ConfigError("is out of range (integers must fit in 64 bits)")
    return number


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"expected a number, got {value!r}")
    number: float | None = None
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError("is out of range for a number") from None
    elif isinstance(value, str) and len(value) <= 64:
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"expected a number, got {_shown(value)}")
    # No option means "forever" by infinity: a non-finite value only ever breaks arithmetic
    # later (an outer thread dying on OverflowError, a NaN global).
    if not math.isfinite(number):
        raise ConfigError(f"must be a finite number (got {number!r})")
    return number


def _shown(value: Any) -> str:
    """``value`` for an error message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _check_bounds(field: dataclasses.Field, value: Any) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    for key, ok, symbol in BOUNDS:
        bound = field.metadata.get(key)
        if bound is not None and not ok(value, bound):
            raise ConfigError(f"must be {symbol} {bound:g} (got {value!r})", field.name)


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """Resolved type annotations of a section dataclass."""
    return typing.get_type_hints(cls)


def section_to_dict(section: Any, redact: bool = False) -> dict[str, Any]:
    """A plain, YAML-safe dict of a section; secrets become ``<redacted>`` when ``redact``."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            value = section_to_dict(value, redact)
        elif isinstance(value, tuple):
            value = list(value)
        if redact and field.metadata.get("secret") and value is not None:
            value = REDACTED
        out[field.name] = value
    return out


REDACTED = "<redacted>"


def describe_type(annotation: Any) -> str:
    """A short human name of a field type, for the generated reference."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        parts = [describe_type(a) for a in args if a is not type(None)]
        text = " | ".join(parts)
        return f"{text} | null" if type(None) in args else text
    if origin in (list, tuple):
        return f"list[{describe_type(args[0])}]" if args else "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if dataclasses.is_dataclass(annotation):
        return "section"
    return getattr(annotation, "__name__", str(annotation))
