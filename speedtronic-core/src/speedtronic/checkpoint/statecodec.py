"""Pickle-free serialisation of nested training state: tensors to safetensors, the rest to JSON.

:func:`encode` splits a tree of dicts (any hashable scalar or tuple keys), lists, tuples,
scalars, strings, bytes, NumPy arrays, ``torch.dtype`` values and tensors into a JSON-compatible
tree plus a flat ``{name: tensor}`` mapping for safetensors; :func:`decode` reverses it. Tensors
that are the same view of the same memory (tied weights) are stored once and come back as one
tensor. Module state dicts keep their ``_metadata`` (module versions used by
``load_state_dict``). Decoding only ever builds data: no class is looked up, no code runs.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

__all__ = ["StateDecodeError", "decode", "encode"]

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_KEYED = "__keyed__"
_BYTES = "__bytes__"
_NDARRAY = "__ndarray__"
_FLOAT = "__float__"
_DTYPE = "__dtype__"
_STATE_DICT = "__state_dict__"
_ESCAPED = "__escaped__"
_MARKERS = frozenset(
    {_TENSOR, _TUPLE, _KEYED, _BYTES, _NDARRAY, _FLOAT, _DTYPE, _STATE_DICT, _ESCAPED}
)

# Dtypes safetensors stores natively; anything else travels as raw bytes plus its dtype name.
_NATIVE_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
    }
)
# NumPy arrays are stored inline; only plain numeric kinds (no object arrays, ever).
_NDARRAY_KINDS = frozenset("biufc")


class StateDecodeError(ValueError):
    """The JSON tree or the tensor mapping does not describe a valid encoded state."""


def encode(tree: Any, *, copy: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(json_tree, tensors)`` for ``tree``; tensors become contiguous CPU tensors that share
    no memory with each other (what safetensors requires). With ``copy`` they share none with
    ``tree`` either: a snapshot that training may go on changing (``checkpoint.async_save``)."""
    tensors: dict[str, torch.Tensor] = {}
    by_view: dict[tuple[Any, ...], dict[str, Any]] = {}
    storages: set[tuple[str, int]] = set()

    def add_tensor(node: torch.Tensor, path: str) -> dict[str, Any]:
        view = _view_key(node)
        if view is not None and view in by_view:
            return by_view[view]
        name = path or "root"
        while name in tensors:
            name += "_"
        data = node.detach()
        if data.device.type != "cpu":
            data = data.to("cpu")
        elif copy or (view is not None and view[:2] in storages):
            # A snapshot owns its memory; and safetensors refuses two views of one storage.
            data = data.clone()
        data = data.contiguous()
        if view is not None:
            storages.add(view[:2])
        ref: dict[str, Any] = {_TENSOR: name}
        if data.dtype not in _NATIVE_DTYPES:
            ref["dtype"] = str(data.dtype).removeprefix("torch.")
            ref["shape"] = list(data.shape)
            data = data.reshape(-1).view(torch.uint8)
        tensors[name] = data
        if view is not None:
            by_view[view] = ref
        return ref

    def visit(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            return add_tensor(node, path)
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, float):
            return node if math.isfinite(node) else {_FLOAT: repr(float(node))}
        if isinstance(node, np.generic):
            return visit(node.item(), path)
        if isinstance(node, np.ndarray):
            if node.dtype.kind not in _NDARRAY_KINDS:
                raise TypeError(
                    f"cannot serialise a NumPy array of dtype {node.dtype} at {path or 'root'!r}"
                )
            return {
                _NDARRAY: base64.b64encode(np.ascontiguousarray(node).tobytes()).decode(),
                "dtype": node.dtype.str,
                "shape": list(node.shape),
            }
        if isinstance(node, (bytes, bytearray)):
            return {_BYTES: base64.b64encode(bytes(node)).decode()}
        if isinstance(node, torch.dtype):
            return {_DTYPE: str(node).removeprefix("torch.")}
        if isinstance(node, tuple):
            return {_TUPLE: [visit(v, f"{path}.{i}") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [visit(v, f"{path}.{i}") for i, v in enumerate(node)]
        if isinstance(node, dict):
            encoded = visit_dict(node, path)
            metadata = getattr(node, "_metadata", None)
            if isinstance(metadata, dict):
                return {_STATE_DICT: encoded, "metadata": visit(dict(metadata), "")}
            return encoded
        raise TypeError(f"cannot serialise {type(node).__name__} at {path or 'root'!r}")

    def visit_dict(node: dict[Any, Any], path: str) -> Any:
        def child(key: Any) -> str:
            return f"{path}.{key}" if path else str(key)

        if all(isinstance(k, str) for k in node):
            out = {k: visit(v, child(k)) for k, v in node.items()}
            # A user key that looks like one of our markers must not be read back as one.
            return {_ESCAPED: out} if _MARKERS & out.keys() else out
        return {
            _KEYED: [[visit(k, f"{child(k)}.key"), visit(v, child(k))] for k, v in node.items()]
        }

    return visit(tree, ""), tensors


def decode(json_tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild the tree :func:`encode` produced. Shared tensors come back shared.

    Raises :class:`StateDecodeError` when the input is not something :func:`encode` wrote.
    """

    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(v) for v in node]
        if not isinstance(node, dict):
            return node
        markers = _MARKERS & node.keys()
        if not markers:
            return {k: visit(v) for k, v in node.items()}
        if len(markers) > 1:
            raise StateDecodeError(f"ambiguous encoded node with keys {sorted(node)}")
        (marker,) = markers
        value = node[marker]
        if marker == _TENSOR:
            return tensor(node)
        if marker == _TUPLE:
            return tuple(visit(v) for v in _expect(value, list, marker))
        if marker == _KEYED:
            out = {}
            for pair in _expect(value, list, marker):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise StateDecodeError("a keyed entry must be a [key, value] pair")
                out[visit(pair[0])] = visit(pair[1])
            return out
        if marker == _BYTES:
            return base64.b64decode(_expect(value, str, marker), validate=True)
        if marker == _FLOAT:
            text = _expect(value, str, marker)
            if text not in ("inf", "-inf", "nan"):
                raise StateDecodeError(f"unexpected special float {text!r}")
            return float(text)
        if marker == _DTYPE:
            return _dtype(_expect(value, str, marker))
        if marker == _NDARRAY:
            return ndarray(node)
        if marker == _STATE_DICT:
            entries = visit(value)
            metadata = visit(node.get("metadata", {}))
            if not isinstance(entries, dict) or not isinstance(metadata, dict):
                raise StateDecodeError("a state dict node needs mapping entries and metadata")
            result: OrderedDict[Any, Any] = OrderedDict(entries)
            result._metadata = metadata  # type: ignore[attr-defined]
            return result
        return {k: visit(v) for k, v in _expect(value, dict, marker).items()}  # escaped

    def tensor(node: dict[str, Any]) -> torch.Tensor:
        name = node[_TENSOR]
        if not isinstance(name, str) or name not in tensors:
            raise StateDecodeError(f"tensor {name!r} is missing from the tensor file")
        data = tensors[name]
        if "dtype" not in node:
            return data
        dtype = _dtype(_expect(node["dtype"], str, "dtype"))
        shape = _expect(node.get("shape"), list, "shape")
        return data.view(dtype).reshape(shape)

    def ndarray(node: dict[str, Any]) -> np.ndarray:
        dtype = np.dtype(_expect(node.get("dtype"), str, "dtype"))
        if dtype.kind not in _NDARRAY_KINDS:
            raise StateDecodeError(f"refusing NumPy dtype {dtype} (only numeric arrays)")
        raw = base64.b64decode(_expect(node[_NDARRAY], str, _NDARRAY), validate=True)
        shape = _expect(node.get("shape"), list, "shape")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()

    return visit(json_tree)


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise StateDecodeError(f"{what}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise StateDecodeError(f"unknown torch dtype {name!r}")
    return dtype


def _view_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of a tensor's view: equal keys mean the very same elements."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None
    if storage.data_ptr() == 0 or storage.nbytes() == 0:
        return None
    return (
        str(tensor.device),
        storage.data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )
