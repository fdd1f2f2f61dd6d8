"""Reading config text: size, depth and alias-expansion bounds on untrusted files, YAML that
refuses duplicate keys, and the dotted ``KEY=VALUE`` overrides of ``--set``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from speedtronic.errors import ConfigError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_NODES",
    "RUN_ALIASES",
    "check_plain_data",
    "is_file",
    "load_yaml",
    "parse_config_text",
    "read_mapping",
    "set_dotted",
    "split_overrides",
]


# Keys of the run section a dotted override may name without it (`--set max_steps=5`).
RUN_ALIASES = ("name", "max_steps", "output_dir", "seed", "device")


def is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except OSError:  # e.g. a name too long to be a path
        return False


# A config is a few kilobytes; anything far larger is not one (and is not read whole).
MAX_CONFIG_BYTES = 4 << 20
# Sections nest two or three levels; a document nested deeper than this is not a config.
MAX_CONFIG_DEPTH = 32
# A config holds a few hundred values; YAML aliases can make a 300-byte document stand for
# billions of them, which every later walk over the config would visit.
MAX_CONFIG_NODES = 100_000


def check_plain_data(data: Any, path: str = "", depth: int = 0) -> None:
    """Reject what no config contains: mappings nested deeper than :data:`MAX_CONFIG_DEPTH`
    and keys that are not strings (a YAML ``1:`` or ``[a, b]:`` key). Raises ConfigError."""
    if depth > MAX_CONFIG_DEPTH:
        raise ConfigError(f"nested more than {MAX_CONFIG_DEPTH} levels deep", path)
    if isinstance(data, Mapping):
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"keys must be strings, got the {type(key).__name__} key {key!r}"[:200], path
                )
            check_plain_data(value, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(data, (list, tuple)):
        for index, value in enumerate(data):
            check_plain_data(value, f"{path}[{index}]", depth + 1)


def read_mapping(path: Path, yaml_ok: bool) -> Any:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"cannot read config file {path}: it is a directory") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
            f"{exc.start})"
        ) from None
    return parse_config_text(text, str(path), yaml_ok)


class _StrictLoader(yaml.SafeLoader):
    """A safe YAML loader that rejects duplicate keys (the later one would silently win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                mark = key_node.start_mark
                raise ConfigError(
                    f"a {type(key).__name__} cannot be a key (line {mark.line + 1}, column "
                    f"{mark.column + 1})"
                )
            if isinstance(key, str) and key in seen:
                mark = key_node.start_mark
                raise ConfigError(
                    f"duplicate key {key!r} at line {mark.line + 1}, column {mark.column + 1}"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """How many nodes ``root`` stands for once every alias is expanded (counted with one
    visit per distinct node, so a "billion laughs" document is measured, not expanded);
    counts saturate just past ``limit``."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    # Iterative post-order walk: a document nested deeply must not exhaust the Python stack.
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            sizes[key] = 1
            continue
        if children_done:
            total = 1 + sum(sizes.get(id(child), 0) for child in children)
            sizes[key] = min(total, limit + 1)
            open_nodes.discard(key)
            continue
        if key in open_nodes:
            continue  # an alias of an enclosing node: a recursive document (too deep later)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def load_yaml(text: str) -> Any:
    """Parse one YAML document with the strict loader (duplicate keys and non-scalar keys are
    errors) after checking that its aliases do not expand it past :data:`MAX_CONFIG_NODES`
    values. Raises ConfigError for those; YAML's own errors pass through."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, MAX_CONFIG_NODES)
        if size > MAX_CONFIG_NODES:
            raise ConfigError(
                f"its aliases expand it to more than {MAX_CONFIG_NODES:,} values (a config "
                "holds a few hundred)"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_config_text(text: str, origin: str, yaml_ok: bool) -> Any:
    try:
        data = load_yaml(text) if yaml_ok else json.loads(text)
    except ConfigError as exc:
        raise ConfigError(f"cannot parse {origin}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"cannot parse {origin}: {exc.problem or exc.context}{where}") from None
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot parse {origin}: {detail}") from None
    except RecursionError:
        raise ConfigError(f"cannot parse {origin}: nested too deeply") from None
    except (ValueError, TypeError, OverflowError) as exc:
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if "integer string conversion" in detail:  # past Python's int(str) digit limit
            detail = "a number has too many digits"
        raise ConfigError(f"cannot parse {origin}: {detail}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{origin}: the config root must be a mapping")
    return data


def split_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    items = []
    for raw in overrides:
        key, sep, value = raw.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {raw!r} must look like dotted.key=value")
        try:
            parsed = load_yaml(value) if value.strip() else ""
        except ConfigError as exc:
            raise ConfigError(
                f"cannot parse the value of override {key.strip()!r}: {exc}"
            ) from None
        except yaml.YAMLError:  # not YAML (e.g. "a: b: c"): take the text as it is
            parsed = value
        except (RecursionError, ValueError, TypeError, OverflowError):
            raise ConfigError(f"cannot parse the value of override {key.strip()!r}") from None
        items.append((key.strip(), parsed))
    return items


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if parts[0] in RUN_ALIASES and len(parts) == 1:
        parts = ["run", parts[0]]
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                "cannot set a key inside a non-section value", ".".join(parts[: i + 1])
            )
        node = child
    node[parts[-1]] = value
