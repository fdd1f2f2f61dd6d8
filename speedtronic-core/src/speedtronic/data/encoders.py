"""Tokenizers for ``speedtronic data prepare``: bytes, or a ``tokenizer.json`` read by the
Hugging Face ``tokenizers`` library (imported only when used; nothing is ever downloaded).

An :class:`EncoderSpec` is what the main process checks and hands to worker processes: plain
data (the tokenizer's JSON text, not a path that could change under us), cheap to pickle.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from speedtronic.data.format import DTYPES, dtype_for_vocab
from speedtronic.errors import DataError

__all__ = ["EOS_CANDIDATES", "EncoderSpec", "import_tokenizers", "load_encoder_spec"]

BYTES_NAME = "bytes"
BYTE_EOS = 256
# Checked in this order when no --eos-token is given.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")
MAX_TOKENIZER_BYTES = 512 << 20
_BYTES_SHA256 = hashlib.sha256(
    b"speedtronic bytes tokenizer: utf-8 bytes 0-255, eos 256"
).hexdigest()


@dataclass(frozen=True)
class EncoderSpec:
    """A checked tokenizer: its identity for ``index.json`` and what a worker needs."""

    kind: str  # "bytes" or "tokenizers"
    name: str
    sha256: str
    vocab_size: int
    eos_id: int | None
    json_text: str | None = None

    @property
    def dtype(self) -> str:
        """The shard dtype for this vocabulary."""
        return dtype_for_vocab(self.vocab_size)

    def describe(self) -> dict[str, Any]:
        """The ``tokenizer`` entry of ``index.json``."""
        return {"kind": self.kind, "name": self.name, "sha256": self.sha256}

    def load(self) -> Encoder:
        """The encoder itself (in the process that will use it)."""
        if self.kind == BYTES_NAME:
            return ByteEncoder(self)
        return HFEncoder(self)


class Encoder:
    """Turns a list of documents into one token array, EOS after each when asked."""

    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]

    def encode(self, texts: list[str], append_eos: bool) -> np.ndarray:
        raise NotImplementedError


class ByteEncoder(Encoder):
    """UTF-8 bytes as ids 0-255; EOS is 256."""

    def encode(self, texts: list[str], append_eos: bool) -> np.ndarray:
        blobs = [text.encode("utf-8") for text in texts]
        raw = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        if not append_eos:
            return raw.astype(self.dtype)
        lengths = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
        out = np.empty(raw.size + len(blobs), dtype=self.dtype)
        eos_at = np.cumsum(lengths + 1) - 1
        keep = np.ones(out.size, dtype=bool)
        keep[eos_at] = False
        out[keep] = raw
        out[eos_at] = BYTE_EOS
        return out


class HFEncoder(Encoder):
    """A ``tokenizers.Tokenizer`` from JSON text; batch encoding runs in Rust."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__(spec)
        tokenizers = import_tokenizers()
        self.tokenizer = tokenizers.Tokenizer.from_str(spec.json_text)
        # encode_batch_fast skips the character offsets we do not need (tokenizers >= 0.20).
        self._encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)

    def encode(self, texts: list[str], append_eos: bool) -> np.ndarray:
        if not texts:
            return np.empty(0, dtype=self.dtype)
        ids = [encoding.ids for encoding in self._encode(texts, add_special_tokens=False)]
        if append_eos:
            eos = self.spec.eos_id
            for row in ids:
                row.append(eos)
        total = sum(map(len, ids))
        return np.fromiter(chain.from_iterable(ids), dtype=self.dtype, count=total)


def import_tokenizers() -> Any:
    """The Hugging Face ``tokenizers`` module, or a DataError naming the extra to install."""
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "a tokenizer.json needs the Hugging Face tokenizers library: "
            "pip install 'speedtronic-core[tokenizers]'"
        ) from None
    return tokenizers


def load_encoder_spec(
    tokenizer: str | os.PathLike[str] = BYTES_NAME,
    eos_token: str | None = None,
    append_eos: bool = True,
) -> EncoderSpec:
    """Check ``tokenizer`` (``bytes`` or a ``tokenizer.json``, or a folder holding one) and find
    its EOS id: ``eos_token`` if given, else the first of :data:`EOS_CANDIDATES` it knows."""
    if str(tokenizer) == BYTES_NAME:
        if eos_token is not None:
            raise DataError(
                "--eos-token applies to a tokenizer.json; the bytes tokenizer's EOS is 256"
            )
        if not append_eos:  # ids 0-255 only: a vocabulary of 256 is enough
            return EncoderSpec(BYTES_NAME, BYTES_NAME, _BYTES_SHA256, BYTE_EOS, None)
        return EncoderSpec(BYTES_NAME, BYTES_NAME, _BYTES_SHA256, BYTE_EOS + 1, BYTE_EOS)
    path = Path(tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"tokenizer not found: {path} (give 'bytes' or the path of a tokenizer.json; "
            "nothing is downloaded)"
        )
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_TOKENIZER_BYTES + 1)
    except OSError as exc:
        raise DataError(f"cannot read tokenizer {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOKENIZER_BYTES:
        raise DataError(f"tokenizer {path} is larger than {MAX_TOKENIZER_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"tokenizer {path} is not UTF-8 JSON") from None
    tokenizers = import_tokenizers()
    try:
        loaded = tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises plain Exceptions
        detail = " ".join(str(exc).split())[:200]
        raise DataError(f"cannot load tokenizer {path}: {detail}") from None
    vocab = loaded.get_vocab(with_added_tokens=True)
    if not vocab:
        raise DataError(f"tokenizer {path} has an empty vocabulary")
    vocab_size = max(vocab.values()) + 1
    if eos_token is not None:
        eos_id = loaded.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(f"--eos-token {eos_token!r} is not in the vocabulary of {path}")
    else:
        eos_id = next(
            (loaded.token_to_id(t) for t in EOS_CANDIDATES if loaded.token_to_id(t) is not None),
            None,
        )
        if eos_id is None and append_eos:
            raise DataError(
                f"tokenizer {path} has none of the usual end-of-text tokens "
                f"({', '.join(EOS_CANDIDATES)}): name one with --eos-token, or pass "
                "--no-append-eos"
            )
    name = f"{path.parent.name}/{path.name}" if path.parent.name else path.name
    return EncoderSpec(
        "tokenizers", name, hashlib.sha256(raw).hexdigest(), vocab_size, eos_id, json_text=text
    )
