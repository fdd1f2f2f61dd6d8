"""The master's ledger of processed deltas, and the store housekeeping it drives.

**What the ledger answers.** Is this delta file one the master already processed (aggregated
or rejected)? A delta is identified by its node, its local step and its *content* (the sha256 of
the file), never by size and mtime: a ``touch`` of an aggregated delta must not count it twice,
while a restarted worker that uploads new bytes under a step number it used before contributes
again. The listing's etag (which changes whenever the file does) only saves downloads: a file
whose etag is the recorded one is not looked at again; a file whose etag changed is downloaded
once and compared by content (:attr:`Verdict.CHECK`).

**Bounded.** Per node the ledger keeps the ``window`` highest processed local steps (with their
content ids) and the highest local step it ever processed (``high``). A delta at or below
``high`` that is not in the window is one processed long ago (:attr:`Verdict.OLD`), so a file
that went missing from a listing and came back (a node's folder moved away and back) is never
aggregated again, although the ledger forgets nothing by absence and stays bounded. The cost: a
worker restarted from a checkpoint more than ``window`` uploads back re-uses step numbers below
``high``; those deltas are skipped (logged) until it passes ``high``. The master keeps
:data:`LOCAL_WINDOW` entries per node in its state file; the published metadata carries the
newest :data:`PUBLISHED_WINDOW` of them plus the per-node summary, so ``step_count.json`` has a
constant size per node however long the run, and a master that lost its state still
recognises every old delta.

**Housekeeping** (:class:`Housekeeper`): after each round the master deletes the delta files it
processed ``keep_outer_steps`` or more outer steps ago (one deletion per round, fenced by its
lease), squashes the Hub history every ``squash_history_every`` outer steps, and trims its
download cache.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedtronic.errors import TransportError
from speedtronic_diloco.cache import prune_files
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.transports.base import (
    DeltaInfo,
    Lease,
    LeaseLostError,
    Transport,
    UnsupportedOperation,
)

__all__ = [
    "LOCAL_WINDOW",
    "MAX_REASON",
    "PUBLISHED_WINDOW",
    "DeltaLedger",
    "Housekeeper",
    "NodeRecord",
    "Verdict",
    "bounded_reason",
    "delta_norm",
]

log = logging.getLogger("speedtronic.diloco.ledger")

LOCAL_WINDOW = 64
"""Processed deltas per node the master remembers exactly (with content ids) in its state."""
PUBLISHED_WINDOW = 8
"""Processed deltas per node the published metadata carries exactly."""
LEDGER_FORMAT = 1
MAX_REASON = 2000
"""Characters of a rejection reason kept (in the ledger, the state, events). Reasons name
the store path and quote file contents shortly, so a real one stays well below this; the
bound is for a summary read back from a store someone else wrote."""


def bounded_reason(text: str) -> str:
    """``text`` cut to :data:`MAX_REASON` characters, saying so when it was cut."""
    if len(text) <= MAX_REASON:
        return text
    cut = MAX_REASON - 40
    return f"{text[:cut]}... ({len(text) - cut} more characters)"


class Verdict(enum.Enum):
    """What the ledger says about one listed delta file."""

    NEW = "new"  # never processed: download, check, aggregate
    CHECK = "check"  # a processed name whose file changed: download and compare its content
    KNOWN = "known"  # processed, and the file is the one that was processed
    OLD = "old"  # at or below the node's highest processed step, older than the window


@dataclass
class Entry:
    """One processed delta: its content id, the listing's etag, the outer step of its round."""

    content: str | None
    etag: str | None
    outer_step: int
    accepted: bool = True


@dataclass
class NodeRecord:
    """What the ledger knows about one node: the window of processed steps and a summary."""

    high: int = -1
    entries: dict[int, Entry] = field(default_factory=dict)
    #: The newest outer step among the entries that left the window (-1: none left yet).
    evicted_outer: int = -1
    accepted: int = 0
    rejected: int = 0
    last_step: int | None = None
    last_at: float | None = None
    base_outer_step: int | None = None
    norm: float | None = None
    last_reason: str | None = None

    def summary(self) -> dict[str, Any]:
        """The published, constant-size summary (no window)."""
        return {
            "high": self.high,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "last_step": self.last_step,
            "last_at": self.last_at,
            "base_outer_step": self.base_outer_step,
            "norm": self.norm,
            "last_reason": self.last_reason,
        }

    def adopt_summary(self, data: Mapping[str, Any]) -> None:
        """Take a published summary's values where they are ahead of this record's."""
        self.high = max(self.high, _int(data.get("high"), -1))
        self.accepted = max(self.accepted, _int(data.get("accepted"), 0))
        self.rejected = max(self.rejected, _int(data.get("rejected"), 0))
        last_at = _float(data.get("last_at"))
        if last_at is not None and (self.last_at is None or last_at > self.last_at):
            self.last_at = last_at
            self.last_step = _int(data.get("last_step"), None)
            self.base_outer_step = _int(data.get("base_outer_step"), None)
            self.norm = _float(data.get("norm"))
            reason = data.get("last_reason")
            self.last_reason = bounded_reason(str(reason)) if reason is not None else None


class DeltaLedger:
    """The processed deltas, by node (see the module docstring). Not thread-safe: the outer
    loop uses it under its own lock.

    Iterating yields the ``(node_id, local_step)`` keys in the windows; ``key in ledger`` is
    True for those keys.
    """

    def __init__(self, window: int = LOCAL_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self.window = window
        self.nodes: dict[str, NodeRecord] = {}
        self._explained: set[str] = set()

    # ------------------------------------------------------------------ questions
    def verdict(self, info: DeltaInfo) -> Verdict:
        """What to do with the listed file ``info`` (see :class:`Verdict`)."""
        record = self.nodes.get(info.node_id)
        if record is None:
            return Verdict.NEW
        entry = record.entries.get(info.local_step)
        if entry is not None:
            if info.etag is not None and info.etag in (entry.etag, entry.content):
                return Verdict.KNOWN
            return Verdict.CHECK
        if info.local_step <= record.high:
            return Verdict.OLD
        return Verdict.NEW

    def candidates(self, listing: Iterable[DeltaInfo]) -> list[DeltaInfo]:
        """The listed files to download: :attr:`Verdict.NEW` and :attr:`Verdict.CHECK`."""
        out = []
        for info in listing:
            verdict = self.verdict(info)
            if verdict in (Verdict.NEW, Verdict.CHECK):
                out.append(info)
            elif verdict is Verdict.OLD and info.node_id not in self._explained:
                self._explained.add(info.node_id)
                log.info(
                    "%s: treated as processed: node %r's deltas at or below local step %d that "
                    "the ledger's window no longer holds are old (a worker restarted from an "
                    "older checkpoint contributes again once it passes that step)",
                    info.path,
                    info.node_id,
                    self.nodes[info.node_id].high,
                )
        return out

    def same_content(self, info: DeltaInfo, content: str) -> bool:
        """After downloading a :attr:`Verdict.CHECK` file: True (and the new etag recorded)
        when its content is the processed one, so it is not processed again."""
        record = self.nodes.get(info.node_id)
        entry = record.entries.get(info.local_step) if record is not None else None
        if entry is None:
            return False
        if entry.content is None or entry.content == content:  # None: legacy, keep it safe
            entry.etag = info.etag
            entry.content = entry.content or content
            return True
        return False

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        record = self.nodes.get(key[0])
        return record is not None and key[1] in record.entries

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for node, record in sorted(self.nodes.items()):
            for step in sorted(record.entries):
                yield node, step

    def __len__(self) -> int:
        return sum(len(record.entries) for record in self.nodes.values())

    # ------------------------------------------------------------------ recording
    def record(
        self,
        info: DeltaInfo,
        content: str | None,
        *,
        outer_step: int,
        accepted: bool,
        reason: str | None = None,
        base_outer_step: int | None = None,
        norm: float | None = None,
        now: float | None = None,
    ) -> None:
        """Note that the round producing ``outer_step`` processed ``info`` (content id
        ``content``): aggregated when ``accepted``, else rejected for ``reason``."""
        record = self.nodes.setdefault(info.node_id, NodeRecord())
        record.entries[info.local_step] = Entry(content, info.etag, outer_step, accepted)
        record.high = max(record.high, info.local_step)
        if accepted:
            record.accepted += 1
        else:
            record.rejected += 1
            record.last_reason = bounded_reason(reason or "rejected")
        if record.last_step is None or info.local_step >= record.last_step:
            record.last_step = info.local_step
            record.last_at = time.time() if now is None else now
            if base_outer_step is not None:  # a rejected delta may not tell: keep the last
                record.base_outer_step = base_outer_step
            if norm is not None:
                record.norm = norm if math.isfinite(norm) else None
        self._trim(record)

    def _trim(self, record: NodeRecord) -> None:
        while len(record.entries) > self.window:
            gone = record.entries.pop(min(record.entries))
            record.evicted_outer = max(record.evicted_outer, gone.outer_step)

    # ------------------------------------------------------------------ storage
    def deletable(
        self, listing: Iterable[DeltaInfo], outer_step: int, keep: int
    ) -> list[DeltaInfo]:
        """The listed files that are processed and at least ``keep`` outer steps old, and the
        processed files a later delta of the same node went into the same round with (the
        round summed them: only the newest is kept): what the store no longer needs. A file
        older than the window counts as processed when the newest entry that left the window
        was. The store thus holds at most ``keep`` rounds of one processed delta per node."""
        doomed, kept = [], []
        newest: dict[tuple[str, int], int] = {}  # (node, outer step) -> newest local step
        for info in listing:
            record = self.nodes.get(info.node_id)
            if record is None:
                continue
            entry = record.entries.get(info.local_step)
            if entry is None:
                if info.local_step <= record.high and record.evicted_outer <= outer_step - keep:
                    doomed.append(info)
            elif info.etag not in (entry.etag, entry.content):
                continue  # replaced since it was processed: not ours to delete
            elif entry.outer_step <= outer_step - keep:
                doomed.append(info)
            else:
                kept.append((info, entry.outer_step))
                key = (info.node_id, entry.outer_step)
                newest[key] = max(newest.get(key, info.local_step), info.local_step)
        folded = [i for i, step in kept if i.local_step < newest[(i.node_id, step)]]
        return doomed + folded

    # ------------------------------------------------------------------ published form
    def published(
        self, window: int = PUBLISHED_WINDOW
    ) -> tuple[tuple[tuple[str, int, str | None], ...], dict[str, dict[str, Any]]]:
        """``(processed triples, nodes summary)`` for ``step_count.json``: per node the newest
        ``window`` entries and the summary; constant size per node."""
        triples: list[tuple[str, int, str | None]] = []
        for node, record in sorted(self.nodes.items()):
            for step in sorted(record.entries)[-window:]:
                triples.append((node, step, record.entries[step].content))
        return tuple(triples), {node: r.summary() for node, r in sorted(self.nodes.items())}

    def merge_published(
        self,
        processed: Iterable[Sequence[Any]],
        nodes: Mapping[str, Mapping[str, Any]] | None = None,
        outer_step: int = -1,
    ) -> None:
        """Join a published ledger (a fresh master continuing from the store at
        ``outer_step``, which is when its deltas count as processed for deletion). Metadata
        without ``nodes`` is of the older, unbounded format, whose third element was the
        listing's etag, not the content: those entries count as processed whatever their
        content."""
        legacy = not nodes
        for node, summary in (nodes or {}).items():
            record = self.nodes.setdefault(node, NodeRecord())
            record.adopt_summary(summary)
            record.evicted_outer = max(record.evicted_outer, outer_step)
        for node, step, ident in processed:
            record = self.nodes.setdefault(str(node), NodeRecord())
            step = int(step)
            record.high = max(record.high, step)
            record.evicted_outer = max(record.evicted_outer, outer_step)
            if step not in record.entries:
                content = None if legacy else ident
                record.entries[step] = Entry(content, ident, outer_step)
            self._trim(record)

    # ------------------------------------------------------------------ local state
    def to_json(self) -> dict[str, Any]:
        """The whole ledger as JSON-compatible data (the master's state file, checkpoints)."""
        return {
            "format": LEDGER_FORMAT,
            "window": self.window,
            "nodes": {
                node: {
                    **record.summary(),
                    "evicted_outer": record.evicted_outer,
                    "entries": [
                        [step, e.content, e.etag, e.outer_step, e.accepted]
                        for step, e in sorted(record.entries.items())
                    ],
                }
                for node, record in sorted(self.nodes.items())
            },
        }

    @classmethod
    def from_json(cls, data: Any, window: int = LOCAL_WINDOW) -> DeltaLedger:
        """Parse :meth:`to_json` output, or the older list of ``[node, step, etag]``
        triples; ValueError when malformed."""
        ledger = cls(window)
        if not data:
            return ledger
        if isinstance(data, (list, tuple)):  # the unbounded format of earlier versions
            ledger.merge_published(data)
            return ledger
        if not isinstance(data, Mapping) or not isinstance(data.get("nodes"), Mapping):
            raise ValueError("the ledger is neither a mapping with nodes nor a list")
        for node, item in data["nodes"].items():
            record = NodeRecord()
            record.adopt_summary(item)
            record.last_step = _int(item.get("last_step"), None)
            record.evicted_outer = _int(item.get("evicted_outer"), -1)
            for step, content, etag, outer, accepted in item.get("entries") or ():
                record.entries[int(step)] = Entry(
                    None if content is None else str(content),
                    None if etag is None else str(etag),
                    int(outer),
                    bool(accepted),
                )
                record.high = max(record.high, int(step))
            ledger._trim(record)
            ledger.nodes[str(node)] = record
        return ledger

    def state_meta(self) -> dict[str, str]:
        """The string entries of the master's safetensors state file: ``processed`` (the
        window as ``[node, step, content]`` triples, readable by hand) and ``ledger``."""
        triples = [[node, step, self.nodes[node].entries[step].content] for node, step in self]
        return {"processed": json.dumps(triples), "ledger": json.dumps(self.to_json())}

    @classmethod
    def from_state_meta(cls, meta: Mapping[str, str]) -> DeltaLedger:
        """Parse :meth:`state_meta` (or a state file that only has ``processed``)."""
        if "ledger" in meta:
            return cls.from_json(json.loads(meta["ledger"]))
        return cls.from_json(json.loads(meta.get("processed") or "[]"))


def delta_norm(tensors: Mapping[str, Any]) -> float:
    """The L2 norm of a delta over all its tensors (float64 accumulation)."""
    total = 0.0
    for tensor in tensors.values():
        total += float(tensor.double().pow(2).sum())
    return math.sqrt(total)


class Housekeeper:
    """Keeps the store and the master's cache bounded, after every round.

    * Deletes the delta files the ledger says are processed and ``keep_outer_steps`` outer steps
      old, in one :meth:`~speedtronic_diloco.transports.base.Transport.delete_deltas` call (one
      Hub commit, separate from the publication), fenced by the lease when there is one.
    * Every ``squash_history_every`` outer steps (0: never), squashes the store's history.
    * Trims ``cache_dir`` (the master's downloaded deltas, normally deleted right after use) to
      ``cache_keep`` files, which only matters after a crash left some behind.

    Store failures are warnings (the next round tries again), except a lost lease, which is
    raised: a master that lost its lease must stop.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        keep_outer_steps: int,
        squash_history_every: int = 0,
        cache_dir: Path | None = None,
        cache_keep: int = 2,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.transport = transport
        self.keep_outer_steps = keep_outer_steps
        self.squash_history_every = squash_history_every
        self.cache_dir = cache_dir
        self.cache_keep = cache_keep
        self.retry = retry or RetryPolicy()
        self.deleted = 0
        self.squashed_at: int | None = None
        self._can_delete = True

    def after_round(
        self,
        ledger: DeltaLedger,
        listing: Sequence[DeltaInfo],
        outer_step: int,
        *,
        fence: Lease | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """Delete what the store no longer needs, squash when due, trim the cache."""
        doomed = ledger.deletable(listing, outer_step, self.keep_outer_steps)
        if doomed and self._can_delete:
            self._delete(doomed, fence, stop)
        every = self.squash_history_every
        if every and outer_step > 0 and outer_step % every == 0 and self.squashed_at != outer_step:
            self.squashed_at = outer_step
            self._attempt(
                f"squashing the history of {self.transport.description}",
                self.transport.squash_history,
                stop,
            )
        if self.cache_dir is not None:
            with contextlib.suppress(OSError):
                prune_files(self.cache_dir, self.cache_keep, "**/*.safetensors")

    def _delete(
        self, doomed: list[DeltaInfo], fence: Lease | None, stop: threading.Event | None
    ) -> None:
        unsupported: list[UnsupportedOperation] = []

        def delete() -> int:
            try:
                return self.transport.delete_deltas(doomed, fence=fence)
            except UnsupportedOperation as exc:
                unsupported.append(exc)
                return 0

        done, count = self._attempt(
            f"deleting {len(doomed)} processed deltas from {self.transport.description}",
            delete,
            stop,
        )
        if unsupported:
            self._can_delete = False
            log.info("%s; processed deltas stay in the store", unsupported[0])
        elif done and count:
            self.deleted += count
            log.info(
                "deleted %d processed deltas at least %d outer steps old from %s",
                count,
                self.keep_outer_steps,
                self.transport.description,
            )

    def _attempt(self, what: str, fn: Any, stop: threading.Event | None) -> tuple[bool, Any]:
        failures: list[TransportError] = []
        done, result = self.retry.attempt(
            what, fn, stop, then="trying again next round", on_failure=failures.append
        )
        if failures and isinstance(failures[-1], LeaseLostError):
            raise failures[-1]
        return done, result


def _int(value: Any, default: Any) -> Any:
    try:
        return default if value is None else int(value)
    except (TypeError, ValueError):
        return default


def _float(value: Any) -> float | None:
    try:
        number = None if value is None else float(value)
    except (TypeError, ValueError):
        return None
    return number if number is None or math.isfinite(number) else None
