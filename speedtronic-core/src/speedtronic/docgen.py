"""Reference pages generated from the code: the config schema and the hook specs.

The committed pages are regenerated with::

    python -m speedtronic.docgen config > docs/configuration.md
    python -m speedtronic.docgen hooks > docs/hooks.md

and a test fails when either page differs from what the code says. ``config --plugins`` also
documents the sections of the plugins installed here (not committed: it depends on them).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from speedtronic import config as config_module
from speedtronic import hookspecs
from speedtronic.schema import BOUNDS, describe_type, field_hints

__all__ = [
    "CONFIG_COMMAND",
    "HOOKS_COMMAND",
    "main",
    "render_config_reference",
    "render_hook_reference",
]

CONFIG_COMMAND = "python -m speedtronic.docgen config > docs/configuration.md"
HOOKS_COMMAND = "python -m speedtronic.docgen hooks > docs/hooks.md"

_CONFIG_INTRO = """\
A run is described by one config: a YAML or JSON file, a YAML/JSON string, or a dict
(`SpeedtronicConfig.load(...)`). Validation is strict:

- an unknown key fails with its dotted path and a "did you mean" suggestion, and a section
  that a Speedtronic distribution provides but that is not installed says what to `pip install`;
- values are coerced to the field's type (`"false"` is `false`, `"3"` is `3`; anything else is
  an error), and the bounds listed below are checked;
- `name`, `seed`, `device`, `max_steps` and `output_dir` may be given at the top level as
  shorthand for `run.*`.

Secrets are written as `<redacted>` whenever a config is saved (`SpeedtronicConfig.save`),
printed by `speedtronic validate` or stored in a checkpoint. `to_dict()`, `to_yaml()` and
`to_json()` return the real values unless called with `redact=True`, so code that needs the
secret (a transport) can read it. On the command line,
`--set dotted.key=value` overrides any key below (the value is parsed as YAML).
"""

_MODEL_TEXT = """\
The model to build: `name` picks a model some plugin provides through the `build_model` hook
(or one registered in-process with `speedtronic.register_model`); every other key is passed to
that model's factory as a keyword argument. Parameters may also be nested under `params:`.

| key | type | default | description |
| --- | --- | --- | --- |
| `name` | str | `reference_transformer` | Registered model name; `reference_transformer` comes \
from speedtronic-models. |
| *(any other key)* | any | | Passed to the model factory, e.g. `d_model: 256`. |
"""

_GRADIENT_CHECKPOINTING_TEXT = """\
`gradient_checkpointing` (bool, default `false`): trade compute for memory by calling the
model's `set_gradient_checkpointing(True)`; a model without that method trains without it and
a warning says so.
"""

_HOOKS_INTRO = """\
Every hook Speedtronic calls, generated from `speedtronic/hookspecs.py`. Implement one by
decorating a function of the same name with `speedtronic.hookimpl` (or your own
`pluggy.HookimplMarker("speedtronic")`) in a module your distribution registers in the entry-point
group `speedtronic`. An implementation may accept any subset of the arguments, by name. See
[Writing a plugin](plugins.md) for a complete example.

Hooks marked *first result* stop at the first implementation that returns something other
than `None`; for the others every implementation is called, most recently registered first.
"""


def render_config_reference(include_plugins: bool = False) -> str:
    """The configuration reference (Markdown): every core section, field, type and default."""
    out = [_generated_banner(CONFIG_COMMAND), "# Configuration reference", "", _CONFIG_INTRO]
    out += ["## Top-level keys", "", "| key | what it configures |", "| --- | --- |"]
    top: list[tuple[str, Any]] = []
    for field in dataclasses.fields(config_module.SpeedtronicConfig):
        if field.name == "plugins":
            continue
        top.append((field.name, field))
        out.append(f"| [`{field.name}`](#{field.name}) | {_top_level_summary(field.name)} |")
    out.append("| *plugin sections* | see [Plugin sections](#plugin-sections) |")
    out.append("")
    for name, _ in top:
        out.append(f"## `{name}`")
        out.append("")
        if name == "model":
            out.append(_MODEL_TEXT)
        elif name == "gradient_checkpointing":
            out.append(_GRADIENT_CHECKPOINTING_TEXT)
        else:
            out += _section_tables(name, config_module.CORE_SECTIONS[name])
    out += ["## Plugin sections", "", _plugin_sections_text()]
    if include_plugins:
        for name, cls in config_module.plugin_sections().items():
            out += [f"### `{name}` (from an installed plugin)", ""]
            out += _section_tables(name, cls, level=4)
    return "\n".join(out).rstrip() + "\n"


def _top_level_summary(name: str) -> str:
    if name == "model":
        return "which model to build, and its parameters"
    if name == "gradient_checkpointing":
        return "activation checkpointing on or off"
    doc = _class_doc(config_module.CORE_SECTIONS[name])
    return _markdown(doc.split(": ", 1)[-1]).rstrip(".") if doc else ""


def _section_tables(path: str, cls: type, level: int = 3) -> list[str]:
    doc = _class_doc(cls)
    out = [_markdown(doc), ""] if doc else []
    out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    nested: list[tuple[str, type]] = []
    hints = field_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if dataclasses.is_dataclass(annotation):
            nested.append((f"{path}.{field.name}", annotation))
            default = f"see [`{path}.{field.name}`](#{_anchor(path + '.' + field.name)})"
        else:
            default = _default_text(field)
        cells = [
            f"`{field.name}`",
            _cell(describe_type(annotation)),
            default,
            _cell(_field_description(field)),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for nested_path, nested_cls in nested:
        out += ["#" * level + f" `{nested_path}`", ""]
        out += _section_tables(nested_path, nested_cls, level + 1)
    return out


def _field_description(field: dataclasses.Field) -> str:
    meta = field.metadata
    text = _markdown(meta.get("help", ""))
    bounds = [f"{symbol} {meta[key]:g}" for key, _, symbol in BOUNDS if meta.get(key) is not None]
    if bounds:
        text += f" Must be {' and '.join(bounds)}."
    if meta.get("secret"):
        text += " Secret: shown as `<redacted>`."
    return text.strip()


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "*required*"
    if isinstance(value, tuple):
        value = list(value)
    return _cell("`" + json.dumps(value) + "`")


def _plugin_sections_text() -> str:
    from speedtronic.plugins import PROVIDED_SECTIONS

    sections = sorted(PROVIDED_SECTIONS.items())
    listed = "\n".join(f"- `{key}`: from {dist} (`pip install {dist}`)" for key, dist in sections)
    return (
        "Installed plugins add their own top-level sections through the `config_sections` "
        "hook; they are validated exactly like the sections above and reach code as "
        "`config.<section>`. This page documents core only, so that it does not depend on "
        "what happens to be installed; the distributions of this repository provide:\n\n"
        f"{listed}\n\n"
        "`python -m speedtronic.docgen config --plugins` prints this page with the sections "
        "of the plugins installed in your environment, and `speedtronic validate` shows every "
        "section with its defaults."
    )


def render_hook_reference() -> str:
    """The hook reference (Markdown), from the hookspec signatures and docstrings."""
    out = [_generated_banner(HOOKS_COMMAND), "# Hook reference", "", _HOOKS_INTRO]
    out += ["| hook | called | result |", "| --- | --- | --- |"]
    specs = _hookspecs()
    for name, fn in specs:
        first = _is_firstresult(fn)
        summary = _markdown(inspect.getdoc(fn) or "").split(". ")[0].split("\n\n")[0]
        out.append(
            f"| [`{name}`](#{name}) | {_cell(summary.rstrip('.'))} | "
            f"{'first result' if first else 'all'} |"
        )
    out.append("")
    for name, fn in specs:
        out += [f"## {name}", "", "```python", _signature(name, fn), "```", ""]
        if _is_firstresult(fn):
            out += ["*First result: the first non-`None` answer wins.*", ""]
        out += [_markdown(inspect.getdoc(fn) or ""), ""]
    return "\n".join(out).rstrip() + "\n"


def _hookspecs() -> list[tuple[str, Any]]:
    from speedtronic.plugins import hook_names

    return [(name, getattr(hookspecs, name)) for name in hook_names()]


def _is_firstresult(fn: Any) -> bool:
    return bool(getattr(fn, "speedtronic_spec", {}).get("firstresult"))


def _signature(name: str, fn: Any) -> str:
    # Annotations are strings here (postponed evaluation); show them as written.
    annotations = dict(fn.__annotations__)
    returns = annotations.pop("return", None)
    params = ", ".join(f"{arg}: {kind}" for arg, kind in annotations.items())
    return f"def {name}({params})" + (f" -> {returns}" if returns else "") + ": ..."


def _class_doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    # A dataclass without a docstring gets its signature as __doc__; that is no description.
    return "" if doc.startswith(f"{cls.__name__}(") else doc


def _markdown(text: str) -> str:
    """reStructuredText-flavoured docstring markup to Markdown."""
    text = re.sub(r":func:`([^`]+)`", r"[`\1`](#\1)", text)
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(text: str) -> str:
    # Python-Markdown's default slugify, which mkdocs uses for heading ids.
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _generated_banner(command: str) -> str:
    return f"<!-- Generated by `{command}`; edit the code, not this page. -->\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m speedtronic.docgen {config,hooks} [--plugins]``."""
    parser = argparse.ArgumentParser(prog="python -m speedtronic.docgen")
    parser.add_argument("page", choices=("config", "hooks"))
    parser.add_argument(
        "--plugins", action="store_true", help="include installed plugins' config sections"
    )
    args = parser.parse_args(argv)
    if args.page == "config":
        sys.stdout.write(render_config_reference(include_plugins=args.plugins))
    else:
        sys.stdout.write(render_hook_reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
