"""Who this node is: resolving and checking the node id used in local and remote paths."""

from __future__ import annotations

import hashlib
import os
import re

from speedtronic.errors import ConfigError

# Letters, digits, dot, dash, underscore and @; the id becomes a path component both in the
# store (nodes/<id>/) and in the local state and cache directories.
_NODE_ID = re.compile(r"^[A-Za-z0-9_.@-]{1,96}$")


def node_id_problem(node_id: str) -> str | None:
    """Why ``node_id`` cannot be used as a path component, or None when it can."""
    if not node_id:
        return "must not be empty"
    if "/" in node_id or "\\" in node_id:
        return "must not contain '/' or '\\'"
    if node_id.strip(".") == "":
        return "must not be '.' or '..'"
    if not _NODE_ID.match(node_id):
        return "may contain only letters, digits, '.', '-', '_' and '@' (at most 96)"
    return None


def is_valid_node_id(node_id: str) -> bool:
    """True when ``node_id`` is safe as a path component."""
    return node_id_problem(node_id) is None


def validate_node_id(node_id: str, source: str = "distributed.node_id") -> str:
    """Return ``node_id`` or raise a ConfigError naming where it came from."""
    problem = node_id_problem(node_id)
    if problem is not None:
        raise ConfigError(f"{problem} (got {node_id!r})", source)
    return node_id


def resolve_node_id(configured: str | None) -> str:
    """The node id: the configured one, else ``HF_USERNAME``, else ``USER``, else ``local``.

    Ids taken from the environment are validated too: they end up in paths just the same.
    """
    if configured:
        return validate_node_id(configured)
    for variable in ("HF_USERNAME", "USER"):
        value = os.environ.get(variable)
        if value:
            return validate_node_id(value, f"${variable} (distributed.node_id is unset)")
    return "local"


def node_data_seed(seed: int, node_id: str) -> int:
    """A data-stream seed for this node: the same ``seed`` gives each node its own samples."""
    digest = hashlib.sha256(f"{seed}:{node_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
