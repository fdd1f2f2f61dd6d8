"""Pickle-free serialisation of nested training state: tensors to safetensors, the rest to JSON.

:func:`encode` splits a tree of dicts, lists, tuples, scalars, strings, bytes, NumPy arrays and
tensors into a JSON-compatible tree plus a flat ``{name: tensor}`` mapping; :func:`decode`
reverses it. Tensors that share storage (tied weights) are stored once. Loading never runs
code: safetensors and JSON are data only.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import torch

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_KEYED = "__keyed__"
_BYTES = "__bytes__"
_NDARRAY = "__ndarray__"
_FLOAT = "__float__"
_ESCAPED = "__escaped__"
_MARKERS = {_TENSOR, _TUPLE, _KEYED, _BYTES, _NDARRAY, _FLOAT, _ESCAPED}


def encode(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(json_tree, tensors)`` for ``tree``; tensors are detached, contiguous CPU copies."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}

    def visit(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            key = _storage_key(node)
            if key is not None and key in seen:
                return {_TENSOR: seen[key]}
            name = path or "root"
            while name in tensors:
                name += "_"
            tensors[name] = node.detach().to("cpu").contiguous()
            if key is not None:
                seen[key] = name
            return {_TENSOR: name}
        if isinstance(node, bool) or node is None or isinstance(node, (int, str)):
            return node
        if isinstance(node, float):
            return node if math.isfinite(node) else {_FLOAT: repr(node)}
        if isinstance(node, np.generic):
            return visit(node.item(), path)
        if isinstance(node, np.ndarray):
            return {
                _NDARRAY: base64.b64encode(np.ascontiguousarray(node).tobytes()).decode(),
                "dtype": node.dtype.str,
                "shape": list(node.shape),
            }
        if isinstance(node, bytes):
            return {_BYTES: base64.b64encode(node).decode()}
        if isinstance(node, tuple):
            return {_TUPLE: [visit(v, f"{path}.{i}") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [visit(v, f"{path}.{i}") for i, v in enumerate(node)]
        if isinstance(node, dict):
            if all(isinstance(k, str) for k in node):
                out = {k: visit(v, f"{path}.{k}" if path else k) for k, v in node.items()}
                if _MARKERS & out.keys():
                    return {_ESCAPED: out}
                return out
            return {
                _KEYED: [
                    [visit(k, f"{path}.key{i}"), visit(v, f"{path}.{k}" if path else str(k))]
                    for i, (k, v) in enumerate(node.items())
                ]
            }
        if isinstance(node, torch.dtype):
            return str(node)
        raise TypeError(f"cannot serialise {type(node).__name__} at {path or 'root'!r}")

    return visit(tree, ""), tensors


def decode(json_tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild the tree :func:`encode` produced. Shared tensors come back shared."""

    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(v) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (marker, value), = node.items()
            if marker == _TENSOR:
                if value not in tensors:
                    raise KeyError(f"tensor {value!r} missing from the tensor file")
                return tensors[value]
            if marker == _TUPLE:
                return tuple(visit(v) for v in value)
            if marker == _KEYED:
                return {_hashable(visit(k)): visit(v) for k, v in value}
            if marker == _BYTES:
                return base64.b64decode(value)
            if marker == _FLOAT:
                return float(value)
            if marker == _ESCAPED:
                return {k: visit(v) for k, v in value.items()}
        if _NDARRAY in node:
            raw = base64.b64decode(node[_NDARRAY])
            return np.frombuffer(raw, dtype=np.dtype(node["dtype"])).reshape(node["shape"]).copy()
        return {k: visit(v) for k, v in node.items()}

    return visit(json_tree)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _storage_key(tensor: torch.Tensor) -> Any:
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if ptr == 0:
        return None
    return (ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
