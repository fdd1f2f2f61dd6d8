"""Compressed deltas: codecs that encode a floating pseudo-gradient into safetensors tensors plus
metadata, and the node's error feedback.

``distributed.compression`` picks the codec a node uploads with:

``none``
    the delta as it is (the file is exactly what an uncompressed node has always written: no
    codec metadata).
``bf16``
    every real floating tensor rounded to bfloat16 (round to nearest even): a relative error of
    at most 2**-8 per element, half the bytes of float32.
``int8`` / ``int4``
    blockwise absmax quantisation: the flattened tensor is cut into blocks of ``block_size``
    elements (default 256; the last block is shorter); each block stores one scale
    ``s = absmax / qmax`` (``qmax`` 127 / 7; float32 or bfloat16, ``scales``) and the integers
    ``q = round(x / s)`` clamped to ``[-qmax, qmax]``. int4 values are stored as ``q + 8`` two
    per byte (element ``2i`` in the low nibble, ``2i + 1`` in the high one). Per element
    ``|x - q s| <= s / 2`` (:func:`error_bound`): for float32 scales ``absmax / 254`` (int8)
    and ``absmax / 14`` (int4) of the element's block; bfloat16 scales are rounded *up* so the
    bound grows by at most a factor ``(1 + 2**-7)(1 + 2**-8)``.

Complex and empty tensors travel uncompressed (``raw``) whatever the codec. Non-finite input is
refused before anything is encoded (:class:`CodecError` naming the tensor), and so is a value
that would overflow the codec (a float64 delta beyond bfloat16's range).

**The file.** A compressed delta is an ordinary safetensors file whose metadata carries, next to
the delta's own entries (``node_id``, ``local_step``, ...): ``codec`` (``bf16``/``int8``/
``int4``), ``codec_format`` (:data:`CODEC_FORMAT`), ``codec_block``, ``codec_scales`` and
``codec_tensors``, a JSON object ``{name: [kind, dtype, shape]}`` naming every tensor's stored
form (``raw``, ``bf16``, ``int8``, ``int4``), original dtype and shape. Tensor ``name`` holds the
payload (int8: same shape as the delta; int4: ``ceil(n / 2)`` uint8; bf16/raw: the values) and
``name::scale`` the block scales. A file without ``codec`` is a plain delta. :func:`decode_delta`
checks everything (codec, version, parameters, every tensor's kind against the codec, the exact
tensor set, dtypes, sizes, finite non-negative scales, integers within ``[-qmax, qmax]``) and
raises :class:`CodecError` on the first problem; the master turns that into a rejection naming
the file.

**Error feedback** (as in 1-bit Adam, EF21 and LoCo): :class:`ErrorFeedback` keeps the residual
``r = x - decode(encode(x))`` of the last upload in float32 and adds it to the next delta
(``x = delta + r``), so what the master receives over many rounds tracks the sum of the true
deltas to within one round's quantisation error instead of drifting. The residual is committed
only when the upload succeeded (a failed upload's progress is sent again, cumulatively, with the
old residual), it is part of the coordinator's ``state_dict``, and :func:`residual_survives` is
the reset rule applied when a global is installed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from speedtronic.errors import SpeedtronicError

if TYPE_CHECKING:
    from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.tensors import (
    TensorDict,
    TensorFileError,
    compute_dtype,
    is_floating,
    load_tensors,
    save_tensors,
)

__all__ = [
    "CODECS",
    "CODEC_FORMAT",
    "DEFAULT_BLOCK_SIZE",
    "GLOBAL_CODECS",
    "MAX_BLOCK_SIZE",
    "META_BLOCK",
    "META_CODEC",
    "META_FORMAT",
    "META_SCALES",
    "META_TENSORS",
    "SCALE_SUFFIX",
    "CodecError",
    "CodecSpec",
    "EncodedDelta",
    "ErrorFeedback",
    "decode_delta",
    "decode_delta_file",
    "encode_delta",
    "encode_global",
    "error_bound",
    "is_compressed",
    "pack_int4",
    "residual_survives",
    "restore_dtypes",
    "unpack_int4",
]

log = logging.getLogger("speedtronic.diloco")

#: The values of ``distributed.compression``.
CODECS = ("none", "bf16", "int8", "int4")
#: The values of ``distributed.global_compression``.
GLOBAL_CODECS = ("none", "bf16")
#: Version of the compressed-delta layout described in the module docstring.
CODEC_FORMAT = "1"
DEFAULT_BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 1 << 20
META_CODEC = "codec"
META_FORMAT = "codec_format"
META_BLOCK = "codec_block"
META_SCALES = "codec_scales"
META_TENSORS = "codec_tensors"
#: Suffix of the tensor holding a quantised tensor's block scales.
SCALE_SUFFIX = "::scale"

_QMAX = {"int8": 127, "int4": 7}
_SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_KINDS = ("raw", "bf16", "int8", "int4")
_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
# bf16 keeps 8 significant bits: nudging a scale up by one ulp before rounding to nearest
# guarantees the stored scale is >= absmax / qmax, so no element is clamped.
_BF16_UP = 1.0 + 2.0**-7


class CodecError(SpeedtronicError, ValueError):
    """A delta cannot be encoded (non-finite or out of range), or a compressed file is
    malformed: unknown codec or version, bad parameters, wrong tensor set, dtypes or sizes."""


@dataclass(frozen=True)
class CodecSpec:
    """A codec and its parameters (the ``distributed`` keys ``compression``,
    ``compression_block`` and ``compression_scales``)."""

    codec: str = "none"
    block_size: int = DEFAULT_BLOCK_SIZE
    scales: str = "fp32"

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise CodecError(f"unknown codec {self.codec!r} (one of {', '.join(CODECS)})")
        if not 1 <= int(self.block_size) <= MAX_BLOCK_SIZE:
            raise CodecError(f"block size {self.block_size} is not in 1 .. {MAX_BLOCK_SIZE}")
        if self.scales not in _SCALE_DTYPES:
            raise CodecError(f"scales {self.scales!r} is not fp32 or bf16")

    @classmethod
    def from_config(cls, config: DistributedConfig) -> CodecSpec:
        """The spec a ``distributed`` section asks for."""
        return cls(
            codec=config.compression,
            block_size=config.compression_block,
            scales=config.compression_scales,
        )

    @property
    def compressed(self) -> bool:
        return self.codec != "none"


def error_bound(codec: str, absmax: float, scales: str = "fp32") -> float:
    """The largest per-element error of ``codec`` in a block whose largest magnitude is
    ``absmax`` (bf16: relative to the element itself, so this is ``absmax * 2**-8``)."""
    if codec == "none":
        return 0.0
    if codec == "bf16":
        return absmax * 2.0**-8
    bound = absmax / _QMAX[codec] / 2
    if scales == "bf16":
        bound *= _BF16_UP * (1.0 + 2.0**-8)
    return bound


# --------------------------------------------------------------------------- int4 packing
def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack integers in ``[-8, 7]`` two per byte (``value + 8``; even index in the low nibble);
    an odd count is padded with a zero. Returns a flat uint8 tensor."""
    flat = values.reshape(-1).to(torch.int16)
    if flat.numel() and (int(flat.min()) < -8 or int(flat.max()) > 7):
        raise CodecError("int4 values must lie in [-8, 7]")
    nibbles = (flat + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack_int4(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` int4 values (int8 tensor) packed by :func:`pack_int4`."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != (count + 1) // 2:
        raise CodecError(
            f"int4 payload of {packed.numel()} {packed.dtype} values cannot hold {count}"
        )
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:count]


# --------------------------------------------------------------------------- one tensor
def _blocks(count: int, block: int) -> int:
    return (count + block - 1) // block


def _quantise(
    tensor: torch.Tensor, codec: str, block: int, scales: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, scales)`` of a real floating tensor."""
    qmax = _QMAX[codec]
    work = tensor.detach().reshape(-1).to(compute_dtype(tensor.dtype))
    count = work.numel()
    padded = torch.zeros(_blocks(count, block) * block, dtype=work.dtype)
    padded[:count] = work
    blocks = padded.view(-1, block)
    scale = blocks.abs().amax(dim=1) / qmax
    # bf16 scales are nudged up so that rounding never makes them smaller than absmax / qmax.
    stored = (scale * _BF16_UP).to(torch.bfloat16) if scales == "bf16" else scale.to(torch.float32)
    if not bool(torch.isfinite(stored).all()):
        raise CodecError(f"values too large for {scales} scales")
    used = stored.to(work.dtype)
    safe = torch.where(used > 0, used, torch.ones_like(used))
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).reshape(-1)[:count]
    if codec == "int8":
        payload = q.to(torch.int8).reshape(tensor.shape)
    else:
        payload = pack_int4(q.to(torch.int8))
    return payload, stored


def _check_range(name: str, payload: torch.Tensor, kind: str, count: int) -> None:
    """The encoder writes integers in the symmetric range ``[-qmax, qmax]`` only: int8 -128
    and the int4 nibble 0 (-8) come from no encoder, so a file holding them is malformed."""
    if kind == "int8":
        if payload.numel() and int(payload.min()) < -_QMAX["int8"]:
            raise CodecError(f"{name}: int8 value -128 is outside the symmetric range")
        return
    nibbles = torch.stack([payload & 0x0F, payload >> 4], dim=1).reshape(-1)[:count]
    if nibbles.numel() and int(nibbles.min()) == 0:
        raise CodecError(f"{name}: int4 nibble 0 (-8) is outside the symmetric range")


def _dequantise(
    payload: torch.Tensor,
    scale: torch.Tensor,
    kind: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    block: int,
) -> torch.Tensor:
    count = math.prod(shape)
    q = payload.reshape(-1) if kind == "int8" else unpack_int4(payload, count)
    work = compute_dtype(dtype)
    padded = torch.zeros(_blocks(count, block) * block, dtype=work)
    padded[:count] = q.to(work)
    values = padded.view(-1, block) * scale.to(work)[:, None]
    return values.reshape(-1)[:count].reshape(shape)


# --------------------------------------------------------------------------- deltas
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_delta(
    delta: Mapping[str, torch.Tensor], spec: CodecSpec
) -> tuple[TensorDict, dict[str, str]]:
    """``(tensors, metadata)`` to store for the floating ``delta`` under ``spec`` (codec
    ``none``: the tensors unchanged and no metadata). CodecError on non-finite values, a
    non-floating tensor, or a value the codec cannot represent."""
    for name, tensor in delta.items():
        if not is_floating(tensor):
            raise CodecError(f"{name}: dtype {tensor.dtype} is not floating; not encoded")
        if not bool(torch.isfinite(tensor).all()):
            raise CodecError(f"{name}: non-finite values; not encoded")
    if not spec.compressed:
        return dict(delta), {}
    tensors: TensorDict = {}
    manifest: dict[str, list[Any]] = {}
    for name, tensor in delta.items():
        shape = list(tensor.shape)
        if tensor.is_complex() or tensor.numel() == 0:
            kind, stored = "raw", {name: tensor.detach().contiguous()}
        elif spec.codec == "bf16":
            rounded = tensor.detach().to(torch.bfloat16)
            if not bool(torch.isfinite(rounded).all()):
                raise CodecError(f"{name}: values beyond the bfloat16 range; not encoded")
            kind, stored = "bf16", {name: rounded}
        else:
            try:
                payload, scale = _quantise(tensor, spec.codec, spec.block_size, spec.scales)
            except CodecError as exc:
                raise CodecError(f"{name}: {exc}; not encoded") from None
            kind, stored = spec.codec, {name: payload, name + SCALE_SUFFIX: scale}
        for key, value in stored.items():
            if key in tensors:
                raise CodecError(f"{key}: tensor name collides with a codec tensor")
            tensors[key] = value
        manifest[name] = [kind, _dtype_name(tensor.dtype), shape]
    metadata = {
        META_CODEC: spec.codec,
        META_FORMAT: CODEC_FORMAT,
        META_BLOCK: str(spec.block_size),
        META_SCALES: spec.scales,
        META_TENSORS: json.dumps(manifest, separators=(",", ":")),
    }
    return tensors, metadata


def is_compressed(metadata: Mapping[str, str]) -> bool:
    """True when a delta file's metadata names a codec (other than ``none``)."""
    return metadata.get(META_CODEC, "none") != "none"


def _parse_params(metadata: Mapping[str, str]) -> tuple[str, int, str, dict[str, Any]]:
    codec = metadata.get(META_CODEC)
    if codec not in CODECS or codec == "none":
        raise CodecError(f"unknown codec {codec!r}")
    version = metadata.get(META_FORMAT)
    if version != CODEC_FORMAT:
        raise CodecError(f"unknown codec format {version!r} (this reader knows {CODEC_FORMAT})")
    try:
        block = int(metadata.get(META_BLOCK, ""))
    except ValueError:
        raise CodecError(f"bad codec_block {metadata.get(META_BLOCK)!r}") from None
    if not 1 <= block <= MAX_BLOCK_SIZE:
        raise CodecError(f"codec_block {block} is not in 1 .. {MAX_BLOCK_SIZE}")
    scales = metadata.get(META_SCALES)
    if scales not in _SCALE_DTYPES:
        raise CodecError(f"bad codec_scales {scales!r}")
    try:
        manifest = json.loads(metadata.get(META_TENSORS) or "")
    except json.JSONDecodeError:
        raise CodecError("codec_tensors is not valid JSON") from None
    if not isinstance(manifest, dict):
        raise CodecError("codec_tensors is not a JSON object")
    return codec, block, scales, manifest


def _parse_entry(name: str, entry: Any) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if not (isinstance(entry, list) and len(entry) == 3):
        raise CodecError(f"{name}: bad codec_tensors entry {entry!r}")
    kind, dtype_name, shape = entry
    if kind not in _KINDS:
        raise CodecError(f"{name}: unknown tensor encoding {kind!r}")
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CodecError(f"{name}: bad dtype {dtype_name!r}")
    if not (
        isinstance(shape, list)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise CodecError(f"{name}: bad shape {shape!r}")
    if kind != "raw" and dtype.is_complex:
        raise CodecError(f"{name}: a complex tensor cannot be {kind}")
    return kind, dtype, tuple(shape)


def decode_delta(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> TensorDict:
    """The delta a compressed file holds, each tensor in the compute dtype of its original
    dtype (at least float32). A plain delta (no ``codec``) comes back unchanged. CodecError
    names the first problem."""
    if not is_compressed(metadata):
        return dict(tensors)
    codec, block, scales, manifest = _parse_params(metadata)
    expected: set[str] = set()
    out: TensorDict = {}
    for name, entry in manifest.items():
        kind, dtype, shape = _parse_entry(name, entry)
        if kind not in ("raw", codec):
            raise CodecError(f"{name}: stored as {kind} in a {codec} file")
        count = math.prod(shape)
        payload = tensors.get(name)
        if payload is None:
            raise CodecError(f"{name}: tensor missing")
        expected.add(name)
        if kind in ("raw", "bf16"):
            want = dtype if kind == "raw" else torch.bfloat16
            if payload.dtype != want or tuple(payload.shape) != shape:
                raise CodecError(
                    f"{name}: stored {payload.dtype} {tuple(payload.shape)}, expected {want} "
                    f"{shape}"
                )
            out[name] = payload.to(compute_dtype(dtype))
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            raise CodecError(f"{name}: scales missing")
        expected.add(name + SCALE_SUFFIX)
        want_payload = torch.int8 if kind == "int8" else torch.uint8
        want_count = count if kind == "int8" else (count + 1) // 2
        if payload.dtype != want_payload or payload.numel() != want_count:
            raise CodecError(
                f"{name}: payload of {payload.numel()} {payload.dtype}, expected {want_count} "
                f"{want_payload} for shape {shape}"
            )
        if scale.dtype != _SCALE_DTYPES[scales] or tuple(scale.shape) != (_blocks(count, block),):
            raise CodecError(
                f"{name}: {tuple(scale.shape)} {scale.dtype} scales, expected "
                f"({_blocks(count, block)},) {_SCALE_DTYPES[scales]}"
            )
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise CodecError(f"{name}: non-finite or negative scales")
        _check_range(name, payload, kind, count)
        out[name] = _dequantise(payload, scale, kind, shape, dtype, block)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise CodecError(f"tensors not in codec_tensors: {extra[:5]}")
    return out


def decode_delta_file(
    source: str | Path, dest: str | Path | None = None
) -> tuple[TensorDict, dict[str, str], bool]:
    """Read the delta file ``source``: ``(delta, metadata, compressed)``, the delta decoded.
    With ``dest`` (and a compressed file) the decoded delta is also written there as a plain
    delta file carrying the same metadata minus the codec entries (and minus a signature, which
    no longer matches). CodecError names ``source``."""
    try:
        tensors, metadata = load_tensors(source)
    except TensorFileError as exc:
        raise CodecError(str(exc)) from None
    if not is_compressed(metadata):
        return tensors, metadata, False
    try:
        delta = decode_delta(tensors, metadata)
    except CodecError as exc:
        raise CodecError(f"{source}: {exc}") from None
    if dest is not None:
        skip = {META_CODEC, META_FORMAT, META_BLOCK, META_SCALES, META_TENSORS, "signature"}
        plain = {k: v for k, v in metadata.items() if k not in skip}
        plain["decoded_from"] = metadata.get(META_CODEC, "")
        save_tensors(dest, delta, plain)
    return delta, metadata, True


# --------------------------------------------------------------------------- globals
def encode_global(
    weights: Mapping[str, torch.Tensor], codec: str
) -> tuple[TensorDict, dict[str, str]]:
    """What the master publishes under ``distributed.global_compression``: ``none`` leaves the
    weights alone; ``bf16`` stores float32/float64 tensors as bfloat16 (other tensors as they
    are), with ``codec: bf16`` in the metadata."""
    if codec == "none":
        return dict(weights), {}
    if codec != "bf16":
        raise CodecError(f"unknown global codec {codec!r} (one of {', '.join(GLOBAL_CODECS)})")
    out: TensorDict = {}
    for name, tensor in weights.items():
        if tensor.dtype in (torch.float32, torch.float64):
            rounded = tensor.to(torch.bfloat16)
            out[name] = rounded if bool(torch.isfinite(rounded).all()) else tensor
        else:
            out[name] = tensor
    return out, {META_CODEC: "bf16"}


def restore_dtypes(
    incoming: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]
) -> TensorDict:
    """``incoming`` with every floating tensor cast to the dtype of the local tensor of the same
    name (a bf16-published global becomes float32 again in a float32 model)."""
    out: TensorDict = {}
    for name, tensor in incoming.items():
        target = local.get(name)
        if (
            target is not None
            and tensor.dtype != target.dtype
            and tensor.is_floating_point()
            and target.is_floating_point()
        ):
            tensor = tensor.to(target.dtype)
        out[name] = tensor
    return out


# --------------------------------------------------------------------------- error feedback
def residual_survives(
    previous_step: int | None, new_step: int, max_staleness: int | None = None
) -> bool:
    """The reset rule for the error-feedback residual when a global is installed.

    Every round installs a global, and carrying the residual across those installs is what
    makes error feedback work, so it is kept as long as the new global *continues* from the
    one the residual was measured against: its outer step is above the last installed one and
    at most ``max_staleness`` steps ahead (the master would reject a delta that stale, so the
    residual is as stale). It is dropped for the first global a node installs (nothing before
    it to continue), a global at or below the last one (a different or restarted run, or a
    store that went back) and a jump of more than ``max_staleness`` (the node was away)."""
    if previous_step is None or previous_step < 0:
        return False
    if new_step <= previous_step:
        return False
    return max_staleness is None or new_step - previous_step <= max_staleness


@dataclass(frozen=True)
class EncodedDelta:
    """One encoded upload: what is written (``tensors``, ``metadata``), the residual it leaves
    (committed when the upload succeeds) and ``error``, the relative L2 norm of that residual
    (``||x - decode(encode(x))|| / ||x||``, 0 for an exact codec)."""

    tensors: TensorDict
    metadata: dict[str, str]
    residual: TensorDict
    error: float
    norm: float


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    total = 0.0
    for tensor in state.values():
        total += float(torch.linalg.vector_norm(tensor.to(torch.float64))) ** 2
    return math.sqrt(total)


class ErrorFeedback:
    """The node's quantisation residual (see the module docstring). ``enabled=False`` keeps no
    residual (every upload is quantised on its own: the ablation)."""

    def __init__(self, spec: CodecSpec, enabled: bool = True) -> None:
        self.spec = spec
        self.enabled = enabled
        self.residual: TensorDict = {}

    def encode(self, delta: Mapping[str, torch.Tensor]) -> EncodedDelta:
        """Encode ``delta`` plus the residual (entries of another shape, or for tensors the
        delta lacks, are left for later). Does not change the residual: see :meth:`commit`."""
        corrected: TensorDict = {}
        for name, value in delta.items():
            # Non-finite input is refused by encode_delta; do not let the sum hide it.
            previous = self.residual.get(name)
            if previous is None or previous.shape != value.shape or not self.enabled:
                corrected[name] = value
                continue
            work = compute_dtype(value.dtype)
            corrected[name] = value.to(work) + previous.to(work)
        if not self.spec.compressed:
            tensors, metadata = encode_delta(
                {k: v.to(delta[k].dtype) for k, v in corrected.items()}, self.spec
            )
            kept = {k: v for k, v in self.residual.items() if k not in delta}
            return EncodedDelta(tensors, metadata, kept, 0.0, _norm(corrected))
        tensors, metadata = encode_delta(corrected, self.spec)
        decoded = decode_delta(tensors, metadata)
        residual: TensorDict = {
            k: v for k, v in self.residual.items() if k not in delta
        }  # other fragments' residuals stay
        err_sq = 0.0
        for name, value in corrected.items():
            if value.is_complex():
                continue
            diff = value.to(torch.float32) - decoded[name].to(torch.float32)
            err_sq += float(torch.linalg.vector_norm(diff.to(torch.float64))) ** 2
            if self.enabled:
                residual[name] = diff
        norm = _norm(corrected)
        error = math.sqrt(err_sq) / norm if norm > 0 else 0.0
        return EncodedDelta(tensors, metadata, residual, error, norm)

    def commit(self, encoded: EncodedDelta) -> None:
        """The upload of ``encoded`` succeeded: its residual is the one carried forward."""
        self.residual = dict(encoded.residual) if self.enabled else {}

    def reset(self, names: Iterable[str] | None = None) -> None:
        """Drop the residual (of ``names`` only, when given)."""
        if names is None:
            self.residual = {}
            return
        doomed = set(names)
        self.residual = {k: v for k, v in self.residual.items() if k not in doomed}

    def norm(self) -> float:
        """L2 norm of the residual."""
        return _norm(self.residual)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.spec.codec, "residual": dict(self.residual)}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; a residual saved under another codec is kept (it is
        still untransmitted progress) unless this one keeps none."""
        residual = (state or {}).get("residual") or {}
        self.residual = (
            {str(k): v.detach().to("cpu", torch.float32) for k, v in residual.items()}
            if self.enabled
            else {}
        )
