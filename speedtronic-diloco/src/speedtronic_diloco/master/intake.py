"""The master's intake: list the store's deltas, download each to local disk, verify it
(size, signature) *before* decoding it, decode a compressed one, and inspect it against the
global (keys, shapes, dtypes, finiteness, norm). Every delta ends as a typed value: a
:class:`Fetched` (checked, its file waiting on disk for its round), a :class:`Refused` (with
the :class:`Rejection` that says why), or None (not fetched now: tried again next round, or
the same bytes as a delta already processed).

Deltas are fetched ahead of their round (:meth:`Intake.prefetch`) and wait in the intake until
a round takes them (:meth:`Intake.take`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from speedtronic.checkpoint.fileio import sha256_file
from speedtronic_diloco.aggregation import (
    AggregationRules,
    CheckedDelta,
    DeltaRejected,
    default_max_bytes,
    inspect_delta,
)
from speedtronic_diloco.codecs import CodecError, decode_delta_file, is_compressed
from speedtronic_diloco.fragments import FragmentError
from speedtronic_diloco.ledger import bounded_reason
from speedtronic_diloco.master.fragments import MasterFragments
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.signing import SignatureError, read_header, verify_file
from speedtronic_diloco.tensors import TensorDict
from speedtronic_diloco.transports.base import DeltaInfo, Transport

__all__ = ["Fetched", "Intake", "Intaken", "Refused", "Rejection"]

log = logging.getLogger("speedtronic.diloco.outer")


@dataclass(frozen=True)
class Rejection:
    """Why a delta is not aggregated: a short ``reason`` (``non_finite``, ``norm_outlier``,
    ``replayed``...), a message and, when known, its norm."""

    reason: str
    message: str
    norm: float | None = None

    @classmethod
    def of(cls, exc: DeltaRejected) -> Rejection:
        return cls(exc.reason, bounded_reason(str(exc)), exc.norm)

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Fetched:
    """A checked delta on local disk (``delta.path``; the round deletes it)."""

    info: DeltaInfo
    delta: CheckedDelta
    content: str  # sha256 of the downloaded bytes: the delta's identity in the ledger
    covers: tuple[int, ...]  # the fragments it covers
    compressed: bool  # decoded from a compressed upload (its signature was checked first)
    size: int = 0  # bytes downloaded


@dataclass(frozen=True)
class Refused:
    """A delta that will not be aggregated."""

    info: DeltaInfo
    why: Rejection
    content: str | None = None
    size: int = 0  # bytes downloaded (0: refused before downloading)


Intaken = Fetched | Refused


class Intake:
    """Fetches and checks deltas for the master (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        *,
        cache_dir: Path,
        rules: AggregationRules,
        retry: RetryPolicy,
        stop: Callable[[], threading.Event],
    ) -> None:
        self.transport = transport
        self.directory = cache_dir / "deltas"
        self.rules = rules
        self.retry = retry
        self._stop = stop
        # Deltas fetched and checked ahead of their round: key -> (etag, outcome).
        self._waiting: dict[tuple[str, int], tuple[str | None, Intaken]] = {}

    def list_deltas(self) -> list[DeltaInfo] | None:
        """The store's listing; None when listing failed (logged)."""
        _, listing = self.retry.attempt(
            f"listing deltas on {self.transport.description}",
            self.transport.list_deltas,
            self._stop(),
        )
        return listing

    # ----------------------------------------------------------------- ahead of a round
    def prefetch(
        self,
        new: Iterable[DeltaInfo],
        fetch: Callable[[DeltaInfo], Intaken | None],
        abort: threading.Event | None = None,
    ) -> list[Intaken]:
        """Fetch (with ``fetch``) every delta of ``new`` not waiting yet (one at a time);
        deltas that left the listing are dropped. Returns what was fetched now."""
        new = list(new)
        keys = {info.key for info in new}
        for key in [k for k in self._waiting if k not in keys]:  # processed or gone
            self.drop(key)
        fetched = []
        for info in new:
            known = self._waiting.get(info.key)
            if known is not None and known[0] == info.etag:
                continue
            if abort is not None and abort.is_set():
                break
            outcome = fetch(info)
            if outcome is not None:
                self._waiting[info.key] = (info.etag, outcome)
                fetched.append(outcome)
        return fetched

    def waiting(self, keys: Iterable[tuple[str, int]] | None = None) -> list[Intaken]:
        """The outcomes waiting for ``keys`` (None: all of them)."""
        if keys is None:
            return [outcome for _, outcome in self._waiting.values()]
        return [self._waiting[k][1] for k in keys if k in self._waiting]

    def quorum(self, new: Iterable[DeltaInfo], current: int, excluded: Collection[str]) -> set[str]:
        """The nodes (but ``excluded``) with a checked delta of ``new`` waiting whose base
        outer step is the newest one waiting (an unknown base counts as ``current``)."""
        bases: dict[str, int] = {}
        for outcome in self.waiting(info.key for info in new):
            if isinstance(outcome, Fetched):
                delta = outcome.delta
                base = current if delta.base_outer_step is None else delta.base_outer_step
                bases[delta.node_id] = max(base, bases.get(delta.node_id, base))
        for node in excluded:  # a node whose deltas get rejected: not counted
            bases.pop(node, None)
        if not bases:
            return set()
        newest = max(bases.values())
        return {node for node, base in bases.items() if base == newest}

    def only_refused(self, new: Iterable[DeltaInfo]) -> set[str]:
        """The nodes whose deltas of ``new`` waiting are all refused: the outer thread does not
        wait for them (as after a round that rejected them), so bad deltas never hold a round
        up for ``round_timeout``."""
        waiting = self.waiting(info.key for info in new)
        good = {o.delta.node_id for o in waiting if isinstance(o, Fetched)}
        return {o.info.node_id for o in waiting if isinstance(o, Refused)} - good

    def fresh(self, new: Iterable[DeltaInfo], current: int, excluded: Collection[str]) -> set[str]:
        """``rounds: sync``: the nodes (but ``excluded``) with a checked delta of ``new``
        waiting that was computed from the ``current`` global (an unknown base counts as
        ``current``): the ones delivered for the round now open."""
        nodes = set()
        for outcome in self.waiting(info.key for info in new):
            if isinstance(outcome, Fetched):
                delta = outcome.delta
                if delta.base_outer_step is None or delta.base_outer_step >= current:
                    nodes.add(delta.node_id)
        return nodes - set(excluded)

    def take(self, info: DeltaInfo) -> Intaken | None:
        """The waiting outcome of ``info`` (removed), if it was fetched at its listed etag."""
        early = self._waiting.pop(info.key, None)
        return early[1] if early is not None and early[0] == info.etag else None

    def drop(self, key: tuple[str, int]) -> None:
        entry = self._waiting.pop(key, None)
        if entry is not None and isinstance(entry[1], Fetched):
            with contextlib.suppress(FileNotFoundError):
                entry[1].delta.path.unlink()

    def drop_all(self) -> None:
        for key in list(self._waiting):
            self.drop(key)

    # ----------------------------------------------------------------- one delta
    def fetch(
        self,
        info: DeltaInfo,
        reference: TensorDict,
        book: MasterFragments,
        *,
        processed: Callable[[DeltaInfo, str], bool],
        signatures: Collection[str],
    ) -> Intaken | None:
        """Download, verify, decode and inspect ``info`` against ``reference``. None when the
        download failed (tried again next round) or ``processed(info, sha256)`` says these
        bytes were processed already."""
        limit = self.rules.max_delta_bytes or default_max_bytes(reference)
        if info.size is not None and info.size > limit:
            why = Rejection("too_large", f"{info.size} bytes > max_delta_bytes {limit}")
            return Refused(info, why)
        dest = self.directory / info.node_id / f"delta_{info.local_step}.safetensors"
        done, _ = self.retry.attempt(
            f"downloading {info.path}",
            lambda: self.transport.download_delta(info, dest),
            self._stop(),
            then="trying again next round",
        )
        if not done:
            return None
        content = sha256_file(dest)
        if processed(info, content):  # the same bytes as a processed delta: not again
            with contextlib.suppress(FileNotFoundError):
                dest.unlink()
            return None
        size = 0
        with contextlib.suppress(OSError):
            size = dest.stat().st_size
        try:
            covers, metadata = self._metadata(info, dest, book)
            reference = book.plan.select(reference, covers)
            compressed = is_compressed(metadata)
            signature = self._verify_compressed(info, dest) if compressed else None
            path = self._decode(info, dest) if compressed else dest
            checked = inspect_delta(
                path,
                info,
                reference,
                max_bytes=None if compressed else limit,
                key=None if compressed else self.rules.signing_key,
            )
            if compressed:  # the signature was checked on the compressed file
                checked = replace(checked, signature=signature)
        except DeltaRejected as exc:
            for leftover in (dest, dest.with_suffix(".decoded")):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
            return Refused(info, self._rejection(info, exc), content, size)
        if checked.signature and checked.signature in signatures:
            with contextlib.suppress(FileNotFoundError):
                checked.path.unlink()
            why = Rejection("replayed", "the same signed delta was aggregated before")
            return Refused(info, why, content, size)
        return Fetched(info, checked, content, covers, compressed, size)

    def _rejection(self, info: DeltaInfo, exc: DeltaRejected) -> Rejection:
        """``exc`` as a Rejection whose message names the delta by its store path
        (``info.path``) and never by where this master keeps its copy: the reason is logged,
        sent as an event and published in the store's metadata (``nodes``)."""
        message = re.sub(re.escape(str(self.directory)) + r"[^\s'\":]*", info.path, str(exc))
        message = message.replace(f"{info.path}: {info.path}", info.path)
        if not message.startswith(info.path):
            message = f"{info.path}: {message}"
        return Rejection(exc.reason, bounded_reason(message), exc.norm)

    @staticmethod
    def _metadata(
        info: DeltaInfo, dest: Path, book: MasterFragments
    ) -> tuple[tuple[int, ...], dict[str, str]]:
        """``(fragments covered, metadata)`` of the downloaded file, read from its header."""
        try:
            _, header = read_header(dest)
        except SignatureError as exc:
            raise DeltaRejected("unreadable", f"{info.path}: {exc}") from None
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise DeltaRejected("unreadable", f"{info.path}: bad metadata")
        try:
            return book.covers(metadata), metadata
        except FragmentError as exc:
            raise DeltaRejected("fragments", f"{info.path}: {exc}") from None

    def _verify_compressed(self, info: DeltaInfo, dest: Path) -> str | None:
        """A compressed delta's signature, checked on the file as it came (before decoding)."""
        key = self.rules.signing_key
        if key is None:
            return None
        try:
            return verify_file(dest, key).get("signature")
        except SignatureError as exc:
            raise DeltaRejected(exc.reason, f"{info.path}: {exc}") from None

    @staticmethod
    def _decode(info: DeltaInfo, dest: Path) -> Path:
        """Decode a compressed delta into a plain file in the compute dtype."""
        decoded = dest.with_suffix(".decoded")
        try:
            decode_delta_file(dest, decoded)
        except CodecError as exc:
            raise DeltaRejected("codec", f"{info.path}: {exc}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                dest.unlink()
        return decoded
