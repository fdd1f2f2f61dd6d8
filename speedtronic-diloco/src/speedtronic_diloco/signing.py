"""Signed contributions: an HMAC-SHA256 inside the safetensors metadata of every delta and
every published global, when ``distributed.signing_key`` (or ``$SPEEDTRONIC_DILOCO_KEY``) is
set.

The signature covers the file's tensor table (names, dtypes, shapes, offsets), every metadata
entry except the signature itself (node id, local step, base outer step, outer step, ...) and
the raw tensor bytes, under a domain tag of this format. It lives in the same file as what it
signs, so the atomic write that publishes the file publishes its signature too. Anyone holding
the key can sign; anyone without it cannot make a file that verifies (see "Signed
contributions" in ``docs/diloco.md`` for what this does and does not protect).

The key never leaves this module's callers as text: :func:`resolve_key` returns bytes, and
nothing here logs, stores or formats it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from speedtronic.checkpoint.fileio import atomic_writer

__all__ = [
    "KEY_ENV",
    "SIGNATURE_KEY",
    "SignatureError",
    "read_header",
    "resolve_key",
    "sign_file",
    "verify_file",
]

KEY_ENV = "SPEEDTRONIC_DILOCO_KEY"
SIGNATURE_KEY = "signature"
_DOMAIN = b"speedtronic-diloco-hmac-v1\0"
_CHUNK = 1 << 20
_MAX_HEADER = 100 << 20  # the safetensors reader's own limit


class SignatureError(ValueError):
    """A file is unsigned, wrongly signed or not a safetensors file; ``reason`` says which
    (``unsigned``, ``bad_signature``, ``malformed``)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


def resolve_key(configured: str | None) -> bytes | None:
    """The signing key: ``distributed.signing_key``, else ``$SPEEDTRONIC_DILOCO_KEY``, else
    None (unsigned run)."""
    value = configured or os.environ.get(KEY_ENV) or None
    return value.encode("utf-8") if value else None


def read_header(path: str | Path) -> tuple[int, dict[str, Any]]:
    """``(header_length, header)`` of a safetensors file (the JSON table, ``__metadata__``
    included); SignatureError ``malformed`` when it is not one."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise SignatureError("malformed", f"{path}: too short for safetensors")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise SignatureError("malformed", f"{path}: header of {length} bytes")
            header = json.loads(handle.read(length).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SignatureError("malformed", f"{path}: unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise SignatureError("malformed", f"{path}: the header is not a JSON object")
    return length, header


def _data_chunks(path: Path, offset: int) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        handle.seek(offset)
        while chunk := handle.read(_CHUNK):
            yield chunk


def _digest(key: bytes, header: Mapping[str, Any], chunks: Iterator[bytes]) -> str:
    metadata = dict(header.get("__metadata__") or {})
    metadata.pop(SIGNATURE_KEY, None)
    table = {name: entry for name, entry in header.items() if name != "__metadata__"}
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    mac.update(json.dumps(table, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    mac.update(b"\0")
    mac.update(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    mac.update(b"\0")
    for chunk in chunks:
        mac.update(chunk)
    return mac.hexdigest()


def sign_file(path: str | Path, key: bytes) -> str:
    """Sign the safetensors file at ``path`` in place (atomically rewritten with the signature
    added to its metadata); returns the signature (hex)."""
    path = Path(path)
    length, header = read_header(path)
    signature = _digest(key, header, _data_chunks(path, 8 + length))
    metadata = dict(header.get("__metadata__") or {})
    metadata[SIGNATURE_KEY] = signature
    signed = {**header, "__metadata__": metadata}
    encoded = json.dumps(signed, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data section stays 8-byte aligned
    with atomic_writer(path) as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for chunk in _data_chunks(path, 8 + length):
            out.write(chunk)
    return signature


def verify_file(path: str | Path, key: bytes) -> dict[str, str]:
    """The metadata of ``path`` when its signature verifies under ``key``; SignatureError
    (``unsigned`` or ``bad_signature``) otherwise."""
    path = Path(path)
    length, header = read_header(path)
    metadata = header.get("__metadata__") or {}
    found = metadata.get(SIGNATURE_KEY) if isinstance(metadata, dict) else None
    if not isinstance(found, str) or not found:
        raise SignatureError("unsigned", f"{path}: not signed")
    expected = _digest(key, header, _data_chunks(path, 8 + length))
    if not hmac.compare_digest(found, expected):
        raise SignatureError(
            "bad_signature", f"{path}: the signature does not match (tampered, or another key)"
        )
    return {str(k): str(v) for k, v in metadata.items()}
