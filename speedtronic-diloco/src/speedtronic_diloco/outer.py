"""The master's outer loop: collect new deltas, average them, take a Nesterov SGD step on the
global weights, persist, publish.

The outer step is exactly ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum,
nesterov=True)`` applied to the averaged pseudo-gradient::

    buf = g                      (first step)      buf = momentum * buf + g   (later)
    global -= outer_lr * (g + momentum * buf)

State (global weights, momentum, outer step, the ledger of processed deltas) is persisted
under ``state_dir`` as one safetensors file with JSON metadata (no pickle), *before* the new
weights are published: a master that crashes in between finds a local outer step ahead of the
store's on restart and republishes instead of aggregating the same deltas again.

Rounds and what protects the global (see :mod:`speedtronic_diloco.aggregation`): the outer
thread starts a round when the :class:`~speedtronic_diloco.aggregation.RoundPolicy` says so
(``min_deltas`` distinct nodes pending, or ``round_timeout``); every delta is checked on disk
(size, signature, keys, shapes, dtypes, finiteness in the compute dtype, norm), a node's deltas
in one round count once, norm outliers are rejected or clipped, and the mean is a float64
running sum, one delta file at a time. Every rejection is logged, emitted (``delta_rejected``)
and kept in the state file (``rejections``). The candidate global is checked (finite, bounded
update, finite held-out loss when an evaluator is given) before it is kept: a bad candidate
*halts* the loop (nothing more is published, loudly, and the halt survives restarts) with the
previous good global and momentum kept; the last ``keep_history`` states stay in
``state_dir/history/`` for :func:`roll_back` (``speedtronic diloco rollback --to N``).

The processed-delta ledger (which deltas were processed, by content; bounded) and the store
housekeeping after each round (deleting processed deltas ``keep_outer_steps`` old) live in
:mod:`speedtronic_diloco.ledger`; the lease that fences every publication in
:mod:`speedtronic_diloco.lease`. A lost lease, or any error escaping a round, ends the outer
thread with :attr:`MasterOuterLoop.failure` set, which stops the run loudly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from speedtronic.checkpoint.fileio import sha256_file
from speedtronic.errors import SpeedtronicError, TransportError
from speedtronic_diloco.aggregation import (
    AggregationRules,
    CheckedDelta,
    DeltaRejected,
    RoundDecision,
    RoundPolicy,
    aggregate,
    candidate_problem,
    default_max_bytes,
    inspect_delta,
    screen_round,
)
from speedtronic_diloco.codecs import CodecError, decode_delta_file, encode_global, is_compressed
from speedtronic_diloco.fragment_files import (
    FragmentFileError,
    check_fragment_metadata,
    fragment_header,
    fragment_tensors,
)
from speedtronic_diloco.fragments import (
    FragmentError,
    FragmentLayout,
    delta_fragments,
    fragment_view,
    step_fragments,
)
from speedtronic_diloco.ledger import DeltaLedger, Housekeeper, Verdict
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.signing import SignatureError, read_header, sign_file, verify_file
from speedtronic_diloco.tensors import (
    TensorDict,
    TensorFileError,
    compute_dtype,
    floating_only,
    load_tensors,
    save_tensors,
)
from speedtronic_diloco.transports.base import (
    GLOBAL_WEIGHTS,
    DeltaInfo,
    FragmentFile,
    GlobalMetadata,
    Lease,
    LeaseError,
    LeaseLostError,
    PermanentTransportError,
    Transport,
)

log = logging.getLogger("speedtronic.diloco.outer")

STATE_FILE = "outer_state.safetensors"
STATE_FORMAT = "1"
HISTORY_DIR = "history"
NORM_HISTORY = 32  # accepted contribution norms the outlier rule takes its median of
KEEP_REJECTIONS = 200  # rejection records kept in the state file
KEEP_SIGNATURES = 256  # signatures of accepted deltas remembered against replays
LOUD_AFTER = 3  # consecutive rejections of one node before it is logged as a problem
HALT_REMINDER_S = 60.0
Emit = Callable[[str, dict[str, Any]], None]


def nesterov_step(
    params: TensorDict, grads: TensorDict, momentum_buffers: TensorDict, lr: float, momentum: float
) -> tuple[TensorDict, TensorDict]:
    """One SGD step with Nesterov momentum; returns new ``(params, buffers)`` and leaves the
    inputs untouched (readers may still hold them)."""
    new_params = dict(params)
    new_buffers: TensorDict = {}
    for name, grad in grads.items():
        param = params[name]
        work = compute_dtype(param.dtype)
        g = grad.to(work)
        previous = momentum_buffers.get(name)
        buf = g.clone() if previous is None else previous.to(work) * momentum + g
        update = g + momentum * buf if momentum else g
        new_params[name] = (param.to(work) - lr * update).to(param.dtype)
        new_buffers[name] = buf
    return new_params, new_buffers


@dataclass(frozen=True)
class RoundResult:
    """What one outer round did."""

    outer_step: int
    deltas_found: int
    deltas_included: int
    included: tuple[tuple[str, int], ...]
    rejected: tuple[tuple[str, int], ...]
    nodes: tuple[str, ...] = ()  # the nodes whose contributions went in
    base_outer_steps: tuple[int | None, ...] = ()  # per included delta
    staleness: tuple[int, ...] = ()  # per included delta
    waited_s: float = 0.0
    reason: str = "forced"  # quorum | timeout | final | forced
    reasons: tuple[str, ...] = ()  # per rejected delta
    halted: bool = False
    eval_loss: float | None = None


class MasterOuterLoop:
    """The master's outer optimizer over the store's deltas, with persisted state.

    Constructing it loads ``<state_dir>/outer_state.safetensors`` when present. Public reads
    (:meth:`snapshot`) take a lock and return immutable references: each round builds new
    tensors rather than changing published ones in place.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        node_id: str,
        state_dir: str | Path,
        cache_dir: str | Path,
        outer_lr: float,
        outer_momentum: float,
        retry: RetryPolicy | None = None,
        emit: Emit | None = None,
        rules: AggregationRules | None = None,
        evaluate: Callable[[TensorDict], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        keep_outer_steps: int = 4,
        squash_history_every: int = 0,
        cache_keep: int = 2,
    ) -> None:
        self.transport = transport
        self.node_id = node_id
        self.state_dir = Path(state_dir)
        self.cache_dir = Path(cache_dir)
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.retry = retry or RetryPolicy()
        self._emit = emit or (lambda event, payload: None)
        self.rules = rules or AggregationRules()
        self.policy = RoundPolicy(self.rules.min_deltas, self.rules.round_timeout, clock=clock)
        #: ``evaluate(global weights) -> held-out loss``; called before each publication.
        self.evaluate = evaluate
        self.norm_history: deque[float] = deque(maxlen=NORM_HISTORY)
        self.rejections: list[dict[str, Any]] = []
        #: Why the loop stopped publishing (a bad candidate global), or None.
        self.halted: str | None = None
        self.last_published: GlobalMetadata | None = None
        self._streaks: dict[str, int] = {}
        self._signatures: deque[str] = deque(maxlen=KEEP_SIGNATURES)
        self._final_nodes: set[str] = set()
        self._extra: dict[str, Any] = {}
        # Deltas fetched and checked ahead of their round: key -> (etag, CheckedDelta or
        # DeltaRejected); their files wait in cache_dir/deltas.
        self._prefetched: dict[tuple[str, int], tuple[str | None, Any]] = {}
        self._reminded = -math.inf
        self._lock = threading.RLock()
        # Rounds and publications never overlap (the thread and a direct caller share files).
        self._round_lock = threading.RLock()
        self.global_state: TensorDict | None = None
        self.momentum: TensorDict = {}
        self.outer_step = 0
        self.processed = DeltaLedger()
        self._contents: dict[tuple[str, int], str] = {}
        self.housekeeper = Housekeeper(
            transport,
            keep_outer_steps=keep_outer_steps,
            squash_history_every=squash_history_every,
            cache_dir=self.cache_dir / "deltas",
            cache_keep=cache_keep,
            retry=self.retry,
        )
        #: The master's lease (set by :func:`~speedtronic_diloco.startup.prepare_master`).
        self.lease: Any = None
        #: What ended the outer thread (a lost lease, an unexpected error), or None.
        self.failure: BaseException | None = None
        self.published_step = -1
        self.has_local_state = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Fewer bytes per round (issue 17): streaming fragments (:meth:`set_fragments`), the
        # per-fragment outer step counters and versions (the outer step of each fragment's last
        # update), and the codec of published globals (``distributed.global_compression``).
        self.fragments: FragmentLayout | None = None
        self.fragment_steps: list[int] = []
        self.fragment_versions: list[int] = []
        #: The published file of each fragment (None: not published in this lineage yet);
        #: a file is published again only when its fragment's version moved past it.
        self.fragment_files: list[FragmentFile | None] = []
        self.global_compression = "none"
        self._fragment_norms: dict[int, deque[float]] = {}
        self._fragment_info: dict[int, dict[str, Any]] = {}  # outer step -> published info
        self._covers: dict[tuple[str, int], tuple[int, ...]] = {}  # delta -> its fragments
        self._round_groups: dict[int, list[Any]] = {}  # this round: fragment -> contributions
        self._bytes_in = 0  # delta bytes downloaded since the last reported round
        self.load()

    # ----------------------------------------------------------------- state
    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def load(self) -> bool:
        """Load persisted outer state; False (and a warning if unreadable) when there is none."""
        path = self.state_path
        if not path.exists():
            return False
        try:
            tensors, meta = load_tensors(path)
            if meta.get("format") != STATE_FORMAT:
                raise TensorFileError(f"{path}: unknown format {meta.get('format')!r}")
            outer_step = int(meta["outer_step"])
            processed = DeltaLedger.from_state_meta(meta)
            published = int(meta.get("published_step", -1))
            extra = _robust_state_from(meta)
            fragment_state = dict(json.loads(meta.get("fragment_state") or "{}"))
            fragment_steps = [int(s) for s in fragment_state.get("steps") or ()]
            fragment_versions = [int(s) for s in fragment_state.get("versions") or ()]
            fragment_files = _files_from_json(fragment_state.get("files"))
        except (TensorFileError, KeyError, ValueError, TypeError) as exc:
            log.warning("master state %s is unreadable (%s); ignoring it", path, exc)
            return False
        with self._lock:
            self.global_state = {
                k[len("global/") :]: v for k, v in tensors.items() if k.startswith("global/")
            }
            self.momentum = {
                k[len("momentum/") :]: v for k, v in tensors.items() if k.startswith("momentum/")
            }
            self.outer_step = outer_step
            self.processed = processed
            self.published_step = published
            self.has_local_state = True
            self._adopt_robust_state(extra)
            self.fragment_steps = fragment_steps
            self.fragment_versions = fragment_versions
            self.fragment_files = fragment_files
        if self.halted:
            log.error("master state %s: the outer loop is HALTED (%s)", path, self.halted)
        log.info(
            "master state: outer step %d, %d processed deltas (%s)",
            outer_step,
            len(processed),
            path,
        )
        return True

    def save(self) -> None:
        """Persist global weights, momentum, outer step and ledger in one atomic file."""
        with self._lock:
            if self.global_state is None:
                return
            tensors = {f"global/{k}": v for k, v in self.global_state.items()}
            tensors.update({f"momentum/{k}": v for k, v in self.momentum.items()})
            meta = {
                "format": STATE_FORMAT,
                "node_id": self.node_id,
                "outer_step": str(self.outer_step),
                "published_step": str(self.published_step),
                **self.processed.state_meta(),
            }
            meta.update(self._robust_state_meta())
            if self.fragment_steps:
                state: dict[str, Any] = {
                    "steps": self.fragment_steps,
                    "versions": self.fragment_versions,
                }
                if any(entry is not None for entry in self.fragment_files):
                    state["files"] = _files_to_json(self.fragment_files)
                meta["fragment_state"] = json.dumps(state)
            step, halted = self.outer_step, self.halted
        save_tensors(self.state_path, tensors, meta)
        self.has_local_state = True
        if not halted:
            self._keep_history(step)

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable copy of the outer state (tensors, numbers, lists)."""
        with self._lock:
            return {
                "outer_step": self.outer_step,
                "global": dict(self.global_state or {}),
                "momentum": dict(self.momentum),
                "processed": self.processed.to_json(),
                "norm_history": list(self.norm_history),
                "halted": self.halted,
                "fragment_steps": list(self.fragment_steps),
                "fragment_versions": list(self.fragment_versions),
                "fragment_files": _files_to_json(self.fragment_files),
            }

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Adopt checkpointed outer state when it is ahead of what was loaded from disk."""
        step = int(state.get("outer_step", 0))
        if self.has_local_state and step <= self.outer_step:
            return False
        with self._lock:
            self.global_state = dict(state.get("global") or {}) or self.global_state
            self.momentum = dict(state.get("momentum") or {})
            self.outer_step = step
            self.processed = DeltaLedger.from_json(state.get("processed"))
            self.has_local_state = self.global_state is not None
            self.norm_history.extend(float(n) for n in state.get("norm_history") or ())
            self.halted = state.get("halted") or None
            self.fragment_steps = [int(s) for s in state.get("fragment_steps") or ()]
            self.fragment_versions = [int(s) for s in state.get("fragment_versions") or ()]
            self.fragment_files = _files_from_json(state.get("fragment_files"))
        return True

    def has_processed(self, key: tuple[str, int]) -> bool:
        """True when the ledger holds the delta ``(node_id, local_step)``."""
        with self._lock:
            return key in self.processed

    def snapshot(self) -> tuple[int, TensorDict] | None:
        """``(outer_step, global weights)`` under the lock, or None before any state exists."""
        with self._lock:
            if self.global_state is None:
                return None
            return self.outer_step, self.global_state

    def bootstrap(self, weights: TensorDict) -> None:
        """Start from ``weights`` at outer step 0 (nothing local, nothing remote)."""
        with self._lock:
            self.global_state = dict(weights)
            self.momentum = {}
            self.outer_step = 0
            self.published_step = -1
            self.fragment_versions = [0] * len(self.fragment_versions)
            self.fragment_files = [None] * len(self.fragment_versions)
        self.save()

    def adopt(
        self,
        outer_step: int,
        weights: TensorDict,
        processed: Iterable[tuple[str, int, str | None]] = (),
        nodes: dict[str, dict[str, Any]] | None = None,
        remote: GlobalMetadata | None = None,
    ) -> None:
        """Continue from the store's global at ``outer_step``; momentum restarts from zero and
        the store's ledger (``processed`` window and ``nodes`` summary) joins the local one.
        Every fragment's version becomes ``outer_step`` (every node installs it all), unless
        ``remote`` (the adopted global's metadata) lists this layout's fragment files: then
        its versions and files are kept, and only fragments that move are published again."""
        with self._lock:
            self.global_state = dict(weights)
            self.momentum = {}
            self.outer_step = outer_step
            self.published_step = outer_step
            self.processed.merge_published(processed, nodes, outer_step)
            self.fragment_versions = [outer_step] * len(self.fragment_versions)
            self.fragment_files = [None] * len(self.fragment_versions)
            if remote is not None:
                self._adopt_fragment_files(remote)
        self.save()

    def _adopt_fragment_files(self, remote: GlobalMetadata) -> None:
        """Take the versions and files of ``remote`` when they are this layout's (caller
        holds the lock)."""
        if self.fragments is None:
            return
        try:
            versions = check_fragment_metadata(remote, self.fragments)
        except FragmentFileError:
            return
        self.fragment_versions = list(versions)
        self.fragment_files = list(remote.fragment_files)

    def continue_after(self, store_step: int) -> None:
        """The store holds ``store_step`` but its weights could not be fetched: keep the local
        weights, do not republish, and number the next outer step after the store's."""
        with self._lock:
            self.outer_step = max(self.outer_step, store_step)
            self.published_step = self.outer_step
        self.save()

    def mark_unpublished(self) -> None:
        """Publish the current state on the next chance (the store is behind)."""
        with self._lock:
            self.published_step = -1

    # ----------------------------------------------------------------- rounds
    def publish(self, deltas_included: int = 0) -> GlobalMetadata | None:
        """Publish the current global weights and metadata (signed with a key); None (with a
        warning) on failure, and always None while the loop is halted. With streaming
        fragments (and a store that has fragment files) only the fragment files whose
        version moved are written (see :mod:`speedtronic_diloco.fragment_files`)."""
        with self._lock:
            if self.global_state is None:
                return None
            if self.halted:
                self._remind_halted()
                return None
            step, weights = self.outer_step, self.global_state
            extra = dict(self._extra) if self._extra.get("outer_step") == step else {}
            extra.update(self._fragment_extra())
            ledger, nodes = self.processed.published()
            layout = self.fragments if self.transport.supports_fragment_files else None
            versions, known = list(self.fragment_versions), list(self.fragment_files)
        fenced, fence = self._fence(f"publishing outer step {step}")
        if not fenced:
            return None
        failures: list[TransportError] = []
        fields: dict[str, Any] = {
            "published_at": time.time(),
            "master": self.node_id,
            "deltas_included": deltas_included or int(extra.get("deltas_included", 0)),
            "processed": ledger,
            "extra": extra,
            "nodes": nodes,
            "lease_epoch": fence.epoch if fence is not None else None,
            "eval_loss": extra.get("eval_loss"),
        }
        with self._round_lock:
            if layout is not None:
                done, published = self._publish_fragment_files(
                    step, weights, layout, versions, known, fields, failures
                )
            else:
                done, published = self._publish_whole(step, weights, fields, failures)
        if not done:
            self._raise_if_fenced(failures)
            return None
        with self._lock:
            self.published_step = max(self.published_step, step)
            self.last_published = published
            if layout is not None and published is not None:
                self.fragment_files = list(published.fragment_files)
        with contextlib.suppress(OSError):
            self.save()
        log.info("published outer step %d to %s", step, self.transport.description)
        return published

    def _publish_whole(
        self, step: int, weights: TensorDict, fields: dict[str, Any], failures: list[Any]
    ) -> tuple[bool, GlobalMetadata | None]:
        """The whole global in one file (K = 1, or a store without fragment files)."""
        path = self.cache_dir / "publish" / f"global_{step:08d}.safetensors"
        try:
            stored, codec_meta = encode_global(weights, self.global_compression)
            header = {"kind": "global", "outer_step": str(step), "master": self.node_id}
            save_tensors(path, stored, {**header, **codec_meta})
            if self.rules.signing_key is not None:
                sign_file(path, self.rules.signing_key)
            meta = GlobalMetadata.for_file(path, step, **fields)
            return self.retry.attempt(
                f"publishing outer step {step} to {self.transport.description}",
                lambda: self.transport.publish_global(path, meta),
                self._stop,
                then="will retry next round",
                on_failure=failures.append,
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _publish_fragment_files(
        self,
        step: int,
        weights: TensorDict,
        layout: FragmentLayout,
        versions: list[int],
        known: list[FragmentFile | None],
        fields: dict[str, Any],
        failures: list[Any],
    ) -> tuple[bool, GlobalMetadata | None]:
        """Write the files of the fragments whose version moved past their published file
        (all of them when the store does not list this master's files), then publish them
        with metadata listing every fragment's file, in one atomic publication."""
        kept = self._kept_fragment_files(layout, versions, known)
        files: dict[int, Path] = {}
        entries: list[FragmentFile] = []
        try:
            for j in range(layout.count):
                entry = kept.get(j)
                if entry is None:
                    files[j], entry = self._write_fragment_file(step, weights, layout, j, versions)
                entries.append(entry)
            first = entries[min(files)] if files else max(entries, key=lambda e: e.outer_step)
            meta = GlobalMetadata(
                outer_step=step,
                sha256=first.sha256,
                size=first.size,
                model_file=first.file or GLOBAL_WEIGHTS,
                fragment_files=tuple(entries),
                **fields,
            )
            return self.retry.attempt(
                f"publishing outer step {step} (fragment files {sorted(files)}) to "
                f"{self.transport.description}",
                lambda: self.transport.publish_fragments(files, meta),
                self._stop,
                then="will retry next round",
                on_failure=failures.append,
            )
        finally:
            for path in files.values():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _kept_fragment_files(
        self, layout: FragmentLayout, versions: list[int], known: list[FragmentFile | None]
    ) -> dict[int, FragmentFile]:
        """The published fragment files that still hold their fragment's current version:
        this master's own files (``known``) that the store's metadata lists as they are."""
        read, remote = self.retry.attempt(
            f"reading global metadata from {self.transport.description}",
            self.transport.read_global_metadata,
            self._stop,
            then="publishing every fragment file",
        )
        listed = remote.fragment_files if read and remote is not None else ()
        if len(listed) != layout.count or len(known) != layout.count:
            return {}
        return {
            j: entry
            for j, entry in enumerate(known)
            if entry is not None and entry.outer_step == versions[j] and listed[j] == entry
        }

    def _write_fragment_file(
        self, step: int, weights: TensorDict, layout: FragmentLayout, j: int, versions: list[int]
    ) -> tuple[Path, FragmentFile]:
        """Fragment ``j``'s file at its version (encoded, signed), and its entry (its store
        path is named by the transport)."""
        path = self.cache_dir / "publish" / f"fragment{j}_{step:08d}.safetensors"
        stored, codec_meta = encode_global(
            fragment_tensors(weights, layout, j), self.global_compression
        )
        header = fragment_header(j, versions[j], layout, self.node_id)
        save_tensors(path, stored, {**header, **codec_meta})
        if self.rules.signing_key is not None:
            sign_file(path, self.rules.signing_key)
        return path, FragmentFile("", sha256_file(path), path.stat().st_size, versions[j])

    def publish_if_behind(self) -> bool:
        """Publish when the store has not seen the current outer step yet."""
        with self._round_lock:
            with self._lock:
                behind = self.global_state is not None and self.published_step < self.outer_step
            return behind and self.publish() is not None

    def run_round(self, abort: threading.Event | None = None) -> RoundResult | None:
        """Aggregate every new delta into one outer step now, whatever the round policy says;
        None when there was nothing new (or ``abort`` was set before the deltas were all
        fetched)."""
        with self._round_lock:
            return self._run_round(abort)

    def tick(self, abort: threading.Event | None = None) -> RoundResult | None:
        """One turn of the outer thread: list the store, fetch and check the new deltas (kept
        on disk until their round), ask the round policy, and run a round when it says so:
        ``min_deltas`` distinct nodes pending with the same, newest base outer step (the
        quorum), or ``round_timeout`` since the first pending delta."""
        with self._round_lock:
            if self.halted:
                self._remind_halted()
                return None
            listing = self._list()
            if listing is None:
                return None
            new = self._prefetch(listing, abort)
            quorum = self._quorum_nodes(new)
            decision = self.policy.decide((i.node_id for i in new), quorum)
            if not decision.go:
                return None
            result = self._run_round(abort, listing, decision, prefetched=self._prefetched)
            if result is not None:
                self.policy.round_done()
            return result

    def _prefetch(
        self, listing: list[DeltaInfo], abort: threading.Event | None = None
    ) -> list[DeltaInfo]:
        """Fetch and check every new delta of ``listing`` not fetched yet (one at a time, to
        local disk); returns the new deltas."""
        new = self._new_deltas(listing)
        with self._lock:
            reference = self.global_state
        keys = {info.key for info in new}
        for key in [k for k in self._prefetched if k not in keys]:  # processed or gone
            self._drop_prefetched(key)
        for info in new:
            self.policy.saw(info.node_id)
            known = self._prefetched.get(info.key)
            if reference is None or (known is not None and known[0] == info.etag):
                continue
            if abort is not None and abort.is_set():
                break
            outcome = self._fetch_delta(info, reference)
            if outcome is not None:
                self._prefetched[info.key] = (info.etag, outcome)
        return new

    def _drop_prefetched(self, key: tuple[str, int]) -> None:
        _, outcome = self._prefetched.pop(key)
        if isinstance(outcome, CheckedDelta):
            with contextlib.suppress(FileNotFoundError):
                outcome.path.unlink()

    def _quorum_nodes(self, new: list[DeltaInfo]) -> set[str]:
        """The nodes with a checked delta pending whose base outer step is the newest one
        pending (an unknown base counts as the current outer step)."""
        with self._lock:
            current = self.outer_step
        bases: dict[str, int] = {}
        for info in new:
            entry = self._prefetched.get(info.key)
            if entry is None or not isinstance(entry[1], CheckedDelta):
                continue
            delta = entry[1]
            base = current if delta.base_outer_step is None else delta.base_outer_step
            bases[delta.node_id] = max(base, bases.get(delta.node_id, base))
        for node in self.policy.failing():  # a node whose deltas get rejected: not counted
            bases.pop(node, None)
        if not bases:
            return set()
        newest = max(bases.values())
        return {node for node, base in bases.items() if base == newest}

    def _list(self) -> list[DeltaInfo] | None:
        _, listing = self.retry.attempt(
            f"listing deltas on {self.transport.description}",
            self.transport.list_deltas,
            self._stop,
        )
        return listing  # None: failed (logged)

    def _new_deltas(self, listing: list[DeltaInfo]) -> list[DeltaInfo]:
        """The listed deltas the ledger has not processed."""
        with self._lock:
            return self.processed.candidates(listing)

    def _run_round(
        self,
        abort: threading.Event | None,
        listing: list[DeltaInfo] | None = None,
        decision: RoundDecision | None = None,
        reason: str = "forced",
        prefetched: dict[tuple[str, int], tuple[str | None, Any]] | None = None,
    ) -> RoundResult | None:
        """One round over ``listing``'s new deltas; ``prefetched`` maps keys to ``(etag,
        outcome)`` of deltas already fetched and checked (:meth:`finish`)."""
        prefetched = prefetched if prefetched is not None else {}
        with self._lock:
            if self.global_state is None or self.halted:
                return None
            reference = self.global_state
            base = self.outer_step
        if listing is None:
            listing = self._list()
            if listing is None:
                return None
        new = self._new_deltas(listing)
        if not new:
            return None
        checked: list[CheckedDelta] = []
        rejected: list[DeltaInfo] = []
        why: dict[tuple[str, int], DeltaRejected] = {}
        candidate: tuple[TensorDict, TensorDict] | None = None
        problem: str | None = None
        eval_loss: float | None = None
        contributions: list[Any] = []
        try:
            for info in new:
                if abort is not None and abort.is_set():
                    return None
                early = prefetched.pop(info.key, None)
                if early is not None and early[0] == info.etag:
                    outcome = early[1]
                else:
                    outcome = self._fetch_delta(info, reference)
                if outcome is None:
                    continue
                if isinstance(outcome, DeltaRejected):
                    rejected.append(info)
                    why[info.key] = outcome
                else:
                    checked.append(outcome)
            if self.fragments is not None:
                contributions, late, threshold = self._screen_fragments(checked, base)
            else:
                contributions, late, threshold = screen_round(
                    checked, base, list(self.norm_history), self.rules
                )
            for delta, reason_ in late:
                rejected.append(delta.info)
                why[delta.info.key] = reason_
            if contributions:
                if self.fragments is not None:  # one outer step per fragment of the round
                    params, buffers = self._step_fragments(reference)
                else:
                    mean = aggregate(
                        contributions,
                        reference,
                        self.rules.aggregation,
                        self.rules.trimmed_fraction,
                    )
                    params, buffers = nesterov_step(
                        floating_only(reference),
                        mean,
                        self.momentum,
                        self.outer_lr,
                        self.outer_momentum,
                    )
                    del mean
                new_global = {**reference, **params}
                problem = candidate_problem(
                    reference, new_global, buffers, self.rules.max_update_ratio
                )
                if problem is None and self.evaluate is not None:
                    eval_loss = self._evaluate(new_global)
                    if eval_loss is not None and not math.isfinite(eval_loss):
                        problem = f"the new global's held-out loss is {eval_loss}"
                candidate = (new_global, buffers)
        finally:
            for delta in checked:
                with contextlib.suppress(FileNotFoundError):
                    delta.path.unlink()
        if problem is not None:  # never kept, never published; these deltas never again
            for contribution in contributions:
                for delta in contribution.deltas:
                    rejected.append(delta.info)
                    why[delta.info.key] = DeltaRejected("bad_round", problem, contribution.norm)
            contributions, candidate = [], None
        # (a final delta of several fragments is in several contributions: counted once)
        included = list({d.info.key: d.info for c in contributions for d in c.deltas}.values())
        with self._lock:
            if candidate is not None:
                self.global_state, self.momentum = candidate
                self.outer_step += 1
                self._fragments_stepped()
            step = self.outer_step
            self._record_processed(included, rejected, why, checked, step)
            if problem is not None:
                self.halted = f"outer step {step + 1} refused: {problem}"
            for contribution in contributions:
                self.norm_history.append(contribution.typical)
                self._streaks[contribution.node_id] = 0
                for delta in contribution.deltas:
                    if delta.signature:
                        self._signatures.append(delta.signature)
                    if delta.final:
                        self._final_nodes.add(delta.node_id)
        for info in rejected:
            self._record_rejection(info, why[info.key], step)
            self.policy.rejected(info.node_id)
        for contribution in contributions:
            self.policy.accepted(contribution.node_id)
        if not included and not rejected:
            return None
        deltas = [d for c in contributions for d in c.deltas]
        waited = decision.waited_s if decision is not None else 0.0
        round_reason = decision.reason if decision is not None else reason
        result = RoundResult(
            step,
            len(new),
            len(included),
            tuple(i.key for i in included),
            tuple(i.key for i in rejected),
            nodes=tuple(c.node_id for c in contributions),
            base_outer_steps=tuple(d.base_outer_step for d in deltas),
            staleness=tuple(d.staleness(base) for d in deltas),
            waited_s=waited,
            reason=round_reason,
            reasons=tuple(why[i.key].reason for i in rejected),
            halted=problem is not None,
            eval_loss=eval_loss,
        )
        if problem is not None:
            self._announce_halt(step)
        if included:
            self._extra = {
                "outer_step": step,
                "deltas_included": len(included),
                "round": {
                    "nodes": list(result.nodes),
                    "base_outer_steps": list(result.base_outer_steps),
                    "waited_s": round(waited, 3),
                    "reason": round_reason,
                },
                **({"eval_loss": eval_loss} if eval_loss is not None else {}),
            }
        with contextlib.suppress(OSError):
            self.save()  # before publishing: see the module docstring
        if included:
            self._report_round(result, contributions, threshold)
            self.publish(len(included))
        self._tidy_store(listing)
        return result

    # ----------------------------------------------------------------- ledger, store, lease
    def _record_processed(
        self,
        included: list[DeltaInfo],
        rejected: list[DeltaInfo],
        why: dict[tuple[str, int], DeltaRejected],
        checked: list[CheckedDelta],
        step: int,
    ) -> None:
        """Note the round's deltas in the ledger, by content (caller holds the lock)."""
        seen = {delta.info.key: delta for delta in checked}
        for info, accepted in [(i, True) for i in included] + [(i, False) for i in rejected]:
            delta, reason = seen.get(info.key), why.get(info.key)
            norm = delta.norm if delta is not None else (reason.norm if reason else None)
            self.processed.record(
                info,
                self._contents.pop(info.key, None) or f"etag:{info.etag}",
                outer_step=step,
                accepted=accepted,
                reason=None if reason is None else f"{reason.reason}: {reason}",
                base_outer_step=delta.base_outer_step if delta is not None else None,
                norm=norm,
            )
        self._contents.clear()

    def _tidy_store(self, listing: list[DeltaInfo]) -> None:
        """Delete the processed deltas the store no longer needs (fenced), squash when due."""
        fence = self.lease.check() if self.lease is not None else None
        if self.lease is not None and self.lease.supported and fence is None:
            return  # not holding the lease (yet): delete nothing
        with self._lock:
            step = self.outer_step
        self.housekeeper.after_round(self.processed, listing, step, fence=fence, stop=self._stop)

    def _fence(self, what: str) -> tuple[bool, Lease | None]:
        """``(True, lease to fence with)``, ``(True, None)`` for a store without leases, or
        ``(False, None)`` while the lease cannot be taken (the store is unreachable); a lost or
        held lease raises."""
        if self.lease is None:
            return True, None
        try:
            return True, self.lease.ensure(self._stop)
        except LeaseError:
            raise
        except TransportError as exc:
            log.warning("%s waits for the master lease (%s); trying again next round", what, exc)
            return False, None

    def _raise_if_fenced(self, failures: list[TransportError]) -> None:
        if failures and isinstance(failures[-1], LeaseLostError):
            if self.lease is not None:
                self.lease.mark_lost(str(failures[-1]))
            raise failures[-1]

    def _report_round(self, result: RoundResult, contributions: list[Any], threshold: Any) -> None:
        parts = [
            f"{n}@{s} base {b if b is not None else '?'}"
            for (n, s), b in zip(result.included, result.base_outer_steps)
        ]
        clipped = [c.node_id for c in contributions if c.scale < 1.0 or min(c.delta_scales) < 1.0]
        log.info(
            "outer step %d: %d node%s (%s), waited %.1f s (%s)%s%s",
            result.outer_step,
            len(result.nodes),
            "" if len(result.nodes) == 1 else "s",
            ", ".join(parts),
            result.waited_s,
            result.reason,
            f", {len(result.rejected)} rejected" if result.rejected else "",
            f", clipped {','.join(clipped)}" if clipped else "",
        )
        self._emit(
            "outer_step",
            {
                "outer_step": result.outer_step,
                "deltas_found": result.deltas_found,
                "deltas_included": result.deltas_included,
                "deltas_rejected": len(result.rejected),
                "included": ",".join(f"{n}@{s}" for n, s in result.included),
                "nodes": ",".join(result.nodes),
                "nodes_included": len(result.nodes),
                "base_outer_steps": ",".join(
                    "?" if b is None else str(b) for b in result.base_outer_steps
                ),
                "staleness": ",".join(str(s) for s in result.staleness),
                "waited_s": round(result.waited_s, 3),
                "reason": result.reason,
                "norms": ",".join(f"{c.norm:.4g}" for c in contributions),
                "norm_threshold": threshold,
                "clipped": ",".join(clipped),
                "bytes_received": self._take_bytes_in(),
                **(
                    {"fragments": ",".join(str(j) for j in sorted(self._round_groups))}
                    if self.fragments is not None
                    else {}
                ),
            },
        )
        if result.eval_loss is not None:
            loss = result.eval_loss
            self._emit(
                "outer_eval",
                {
                    "outer_step": result.outer_step,
                    "loss": loss,
                    "ppl": math.exp(loss) if loss < 700 else math.inf,
                },
            )

    def _evaluate(self, weights: TensorDict) -> float | None:
        assert self.evaluate is not None
        try:
            return float(self.evaluate(weights))
        except Exception as exc:  # an evaluation problem must not stop the outer loop
            log.warning("evaluating the new global failed (%s: %s)", type(exc).__name__, exc)
            return None

    def _fetch_delta(self, info: DeltaInfo, reference: TensorDict) -> Any:
        """A checked delta on local disk (the round deletes it), a DeltaRejected, or None
        (download failed: tried again next round)."""
        limit = self.rules.max_delta_bytes or default_max_bytes(reference)
        if info.size is not None and info.size > limit:
            return DeltaRejected("too_large", f"{info.size} bytes > max_delta_bytes {limit}")
        dest = self.cache_dir / "deltas" / info.node_id / f"delta_{info.local_step}.safetensors"
        done, _ = self.retry.attempt(
            f"downloading {info.path}",
            lambda: self.transport.download_delta(info, dest),
            self._stop,
            then="trying again next round",
        )
        if not done:
            return None
        content = sha256_file(dest)
        with self._lock:
            known = self.processed.verdict(info) is Verdict.CHECK and (
                self.processed.same_content(info, content)
            )
        if known:  # the same bytes as a processed delta (touched, copied back): not again
            with contextlib.suppress(FileNotFoundError):
                dest.unlink()
            return None
        self._contents[info.key] = content
        with contextlib.suppress(OSError):
            self._bytes_in += dest.stat().st_size
        try:
            path, reference, signature = self._decode_delta(info, dest, reference)
            checked = inspect_delta(
                path,
                info,
                reference,
                max_bytes=limit if path == dest else None,
                key=self.rules.signing_key if path == dest else None,
            )
            if path != dest:  # the signature was checked on the compressed file
                checked = replace(checked, signature=signature)
        except DeltaRejected as exc:
            for leftover in (dest, dest.with_suffix(".decoded")):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
            return exc
        if checked.signature and checked.signature in self._signatures:
            with contextlib.suppress(FileNotFoundError):
                dest.unlink()
            return DeltaRejected("replayed", "the same signed delta was aggregated before")
        return checked

    # ----------------------------------------------------------------- codecs, fragments
    def set_fragments(self, layout: FragmentLayout | None) -> None:
        """Run with streaming fragments (see :mod:`speedtronic_diloco.fragments`); None or one
        fragment: the classic whole-model rounds. Counters saved for another count restart at
        zero, every fragment's version at the current outer step."""
        with self._lock:
            if layout is None or layout.count == 1:
                self.fragments = None
                return
            self.fragments = layout
            if len(self.fragment_steps) != layout.count:
                self.fragment_steps = [0] * layout.count
            if len(self.fragment_versions) != layout.count:
                self.fragment_versions = [self.outer_step] * layout.count
            if len(self.fragment_files) != layout.count:
                self.fragment_files = [None] * layout.count
            self._fragment_norms = {j: deque(maxlen=NORM_HISTORY) for j in range(layout.count)}
            self._fragment_info[self.outer_step] = self._fragment_extra()["fragments"]

    def fragment_info_at(self, outer_step: int) -> tuple[tuple[int, ...], str] | None:
        """``(fragment versions, layout)`` of the global of ``outer_step`` (None: unknown)."""
        with self._lock:
            info = self._fragment_info.get(outer_step)
        return None if info is None else (tuple(info["versions"]), str(info["layout"]))

    def _fragment_extra(self) -> dict[str, Any]:
        """The ``fragments`` entry of the published metadata's ``extra`` (caller may hold the
        lock); empty without fragments."""
        if self.fragments is None:
            return {}
        return {
            "fragments": {
                "count": self.fragments.count,
                "layout": self.fragments.fingerprint,
                "steps": list(self.fragment_steps),
                "versions": list(self.fragment_versions),
            }
        }

    def _decode_delta(
        self, info: DeltaInfo, dest: Path, reference: TensorDict
    ) -> tuple[Path, TensorDict, str | None]:
        """``(file to inspect, reference it must match, signature)`` for the downloaded delta
        ``dest``: a compressed delta is checked against the signing key as it is, then decoded
        into a plain file in the compute dtype; with fragments, the reference is the global's
        tensors of the fragments the delta covers. DeltaRejected names the file."""
        try:
            _, header = read_header(dest)
        except SignatureError as exc:
            raise DeltaRejected("unreadable", f"{info.path}: {exc}") from None
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise DeltaRejected("unreadable", f"{info.path}: bad metadata")
        if self.fragments is not None:
            try:
                covers = delta_fragments(metadata, self.fragments)
            except FragmentError as exc:
                raise DeltaRejected("fragments", f"{info.path}: {exc}") from None
            self._covers[info.key] = covers
            reference = self.fragments.select(reference, covers)
        if not is_compressed(metadata):
            return dest, reference, None
        key, signature = self.rules.signing_key, None
        if key is not None:
            try:
                signature = verify_file(dest, key).get("signature")
            except SignatureError as exc:
                raise DeltaRejected(exc.reason, f"{info.path}: {exc}") from None
        decoded = dest.with_suffix(".decoded")
        try:
            decode_delta_file(dest, decoded)
        except CodecError as exc:
            raise DeltaRejected("codec", f"{info.path}: {exc}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                dest.unlink()
        return decoded, reference, signature

    def _screen_fragments(
        self, checked: list[CheckedDelta], base: int
    ) -> tuple[list[Any], list[tuple[CheckedDelta, DeltaRejected]], float | None]:
        """:func:`screen_round` per fragment (each with its own norm history, over each delta's
        tensors of that fragment). A delta rejected in one fragment is rejected in all."""
        assert self.fragments is not None
        groups: dict[int, list[Any]] = {}
        late: list[tuple[CheckedDelta, DeltaRejected]] = []
        thresholds: list[float] = []
        for j in range(self.fragments.count):
            names = self.fragments.fragments[j]
            mine = [
                fragment_view(d, names)
                for d in checked
                if j in self._covers.get(d.info.key, range(self.fragments.count))
            ]
            if not mine:
                continue
            history = list(self._fragment_norms.get(j, ()))
            kept, rejected, threshold = screen_round(mine, base, history, self.rules)
            late.extend(rejected)
            if threshold is not None:
                thresholds.append(threshold)
            if kept:
                groups[j] = kept
        refused = {d.info.key for d, _ in late}
        self._round_groups = {
            j: [c for c in group if not {d.info.key for d in c.deltas} & refused]
            for j, group in groups.items()
        }
        self._round_groups = {j: g for j, g in self._round_groups.items() if g}
        self._covers.clear()
        unique = {d.info.key: (d, why) for d, why in late}
        contributions = [c for group in self._round_groups.values() for c in group]
        return contributions, list(unique.values()), max(thresholds) if thresholds else None

    def _step_fragments(self, reference: TensorDict) -> tuple[TensorDict, TensorDict]:
        """One Nesterov step per fragment of this round, each on its own tensors and momentum
        buffers. Returns the new floating weights and the whole momentum."""
        assert self.fragments is not None
        grads: dict[int, TensorDict] = {}
        for j, group in self._round_groups.items():
            ref_j = self.fragments.select(floating_only(reference), [j])
            grads[j] = aggregate(group, ref_j, self.rules.aggregation, self.rules.trimmed_fraction)

        def step(params: TensorDict, g: TensorDict, m: TensorDict) -> tuple[TensorDict, TensorDict]:
            return nesterov_step(params, g, m, self.outer_lr, self.outer_momentum)

        params, momentum, _ = step_fragments(
            step, floating_only(reference), grads, self.momentum, self.fragment_steps
        )
        return params, momentum

    def _fragments_stepped(self) -> None:
        """The round's candidate was kept (caller holds the lock): count the fragments' outer
        steps, version them with the new outer step, remember their norms."""
        if self.fragments is None:
            return
        for j, group in self._round_groups.items():
            self.fragment_steps[j] += 1
            self.fragment_versions[j] = self.outer_step
            for contribution in group:  # what the outlier rule's history records
                typical = getattr(contribution, "typical", 0.0)
                norm = typical or contribution.norm * contribution.scale
                self._fragment_norms[j].append(norm)
        self._fragment_info[self.outer_step] = self._fragment_extra()["fragments"]
        for old in sorted(self._fragment_info)[:-16]:
            del self._fragment_info[old]

    def _take_bytes_in(self) -> int:
        taken, self._bytes_in = self._bytes_in, 0
        return taken

    def _record_rejection(self, info: DeltaInfo, why: DeltaRejected, outer_step: int) -> None:
        norm = why.norm if why.norm is None or math.isfinite(why.norm) else None
        log.error("rejected delta %s (%s): %s", info.path, why.reason, why)
        with self._lock:
            streak = self._streaks.get(info.node_id, 0) + 1
            self._streaks[info.node_id] = streak
            self.rejections.append(
                {
                    "node": info.node_id,
                    "step": info.local_step,
                    "reason": why.reason,
                    "message": str(why)[:200],
                    "norm": norm,
                    "outer_step": outer_step,
                    "at": time.time(),
                }
            )
            del self.rejections[:-KEEP_REJECTIONS]
        if streak >= LOUD_AFTER and (streak == LOUD_AFTER or streak % 10 == 0):
            log.error(
                "!!! node %r: its last %d deltas were all rejected (latest: %s). It is not "
                "contributing; check that node (a bug, a wrong key, diverged weights, or a "
                "hostile writer).",
                info.node_id,
                streak,
                why.reason,
            )
        self._emit(
            "delta_rejected",
            {
                "node": info.node_id,
                "delta_step": info.local_step,
                "reason": why.reason,
                "norm": norm,
                "consecutive": streak,
                "message": str(why)[:200],
            },
        )

    # ----------------------------------------------------------------- halting
    def _announce_halt(self, outer_step: int) -> None:
        log.critical(
            "!!! DumbDiLoCo master HALTED: %s. Nothing more is published; the global stays at "
            "outer step %d (the last good one, with its momentum). Inspect the rejected "
            "deltas, then roll back with `speedtronic diloco rollback --state-dir %s --to N` "
            "(N: %s) and restart the master.",
            self.halted,
            outer_step,
            self.state_dir,
            ", ".join(str(s) for s in history_steps(self.state_dir)) or outer_step,
        )
        self._reminded = time.monotonic()
        self._emit("outer_halted", {"outer_step": outer_step, "reason": self.halted or ""})

    def _remind_halted(self) -> None:
        now = time.monotonic()
        if now - self._reminded >= HALT_REMINDER_S:
            self._reminded = now
            log.error(
                "DumbDiLoCo master is HALTED (%s): not aggregating or publishing; see "
                "`speedtronic diloco rollback --help`",
                self.halted,
            )

    def check_current(self) -> None:
        """Halt (loudly) when the current global itself is not finite (a store or state file
        written by something else)."""
        with self._lock:
            state = self.global_state
            if state is None or self.halted:
                return
            bad = [k for k, v in floating_only(state).items() if not bool(v.isfinite().all())]
            if not bad:
                return
            self.halted = f"the global of outer step {self.outer_step} is not finite ({bad[0]})"
            step = self.outer_step
        self._announce_halt(step)

    # ----------------------------------------------------------------- the end
    def finish(self, timeout: float) -> GlobalMetadata | None:
        """End of training (the thread is stopped): wait at most ``timeout`` seconds for the
        final deltas of the nodes seen recently, aggregate everything pending, publish, and
        name the final global. Returns its published metadata (None if none)."""
        deadline = time.monotonic() + max(0.0, timeout)
        # Deltas are fetched and checked as they come (their metadata says which is a node's
        # final one), then aggregated in one round: one outer step, not one per straggler.
        prefetched = self._prefetched
        with self._round_lock:
            try:
                listing = None
                while not self.halted:
                    seen = self._list()
                    listing = seen if seen is not None else listing
                    finals = set(self._final_nodes)
                    if seen is not None:
                        self._prefetch(seen)
                    for _, outcome in prefetched.values():
                        if isinstance(outcome, CheckedDelta) and outcome.final:
                            finals.add(outcome.node_id)
                    expected = self.policy.recent_nodes() - {self.node_id} - finals
                    if not expected or time.monotonic() >= deadline:
                        break
                    time.sleep(0.2)
                if listing is not None and not self.halted:
                    self._run_round(None, listing, reason="final", prefetched=prefetched)
                    self.policy.round_done()
            finally:
                for key in list(prefetched):
                    self._drop_prefetched(key)
            if self.halted:
                self._remind_halted()
            else:
                self.publish_if_behind()
        with self._lock:
            step, published = self.outer_step, self.last_published
        if published is not None and published.outer_step == step:
            where = f"{self.transport.description.rstrip('/')}/{published.model_file}"
        else:
            where = f"not published; local state {self.state_path}"
        log.info("final global: outer step %d, path %s", step, where)
        self._emit("final_global", {"outer_step": step, "path": where})
        return published if published is not None and published.outer_step == step else None

    # ----------------------------------------------------------------- robust state
    def _robust_state_meta(self) -> dict[str, str]:
        return {
            "norm_history": json.dumps(list(self.norm_history)),
            "rejections": json.dumps(self.rejections[-KEEP_REJECTIONS:]),
            "halted": self.halted or "",
            "signatures": json.dumps(list(self._signatures)),
        }

    def _adopt_robust_state(self, extra: dict[str, Any]) -> None:
        self.norm_history.clear()
        self.norm_history.extend(extra["norm_history"])
        self.rejections = extra["rejections"]
        self.halted = extra["halted"]
        self._signatures.clear()
        self._signatures.extend(extra["signatures"])

    def _keep_history(self, step: int) -> None:
        """Keep the state file just written as ``history/outer_<step>.safetensors`` (a hard
        link where possible) and prune to ``keep_history``."""
        keep = self.rules.keep_history
        if keep <= 0:
            return
        directory = self.state_dir / HISTORY_DIR
        try:
            directory.mkdir(parents=True, exist_ok=True)
            target = directory / f"outer_{step:08d}.safetensors"
            tmp = directory / f".outer_{step:08d}.{os.getpid()}.{threading.get_ident()}.tmp"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            try:
                os.link(self.state_path, tmp)
            except OSError:
                shutil.copyfile(self.state_path, tmp)
            os.replace(tmp, target)
            for old in history_steps(self.state_dir)[:-keep]:
                with contextlib.suppress(FileNotFoundError):
                    (directory / f"outer_{old:08d}.safetensors").unlink()
        except OSError as exc:
            log.warning("keeping outer step %d for rollback failed: %s", step, exc)

    # ----------------------------------------------------------------- thread
    def start(self, interval: float) -> None:
        """Run publish-if-behind and :meth:`tick` every ``interval`` seconds in a daemon
        thread."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(interval,), name="diloco-outer", daemon=True
        )
        self._thread.start()

    def _loop(self, interval: float) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.publish_if_behind()
                    self.tick(abort=self._stop)
                except LeaseError:  # another master took over: this one must stop
                    raise
                except Exception:  # the outer thread must outlive one bad round
                    log.exception("outer round failed")
                self._stop.wait(max(interval, 0.05))
        except BaseException as exc:  # never end silently: the coordinator stops the run
            self.failure = exc
            log.critical(
                "!!! DumbDiLoCo master: the outer loop stopped (%s: %s); nothing more is "
                "aggregated or published, and the run stops",
                type(exc).__name__,
                exc,
            )

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the thread to stop after its current round; True when it ended in time."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def raise_if_failed(self) -> None:
        """Raise :class:`OuterLoopStopped` once the outer thread has died (the coordinator
        calls this at every step, so a dead master loop stops the run loudly)."""
        failure = self.failure
        if failure is not None:
            raise OuterLoopStopped(
                f"DumbDiLoCo master {self.node_id!r}: the outer loop stopped "
                f"({type(failure).__name__}: {failure}); stopping the run"
            ) from failure


class OuterLoopStopped(SpeedtronicError):
    """The master's outer thread died (a lost lease, an unexpected error): the run stops."""


def history_steps(state_dir: str | Path) -> list[int]:
    """The outer steps kept for rollback under ``state_dir/history``, oldest first."""
    directory = Path(state_dir) / HISTORY_DIR
    steps = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for path in directory.glob("outer_*.safetensors"):
            with contextlib.suppress(ValueError):
                steps.append(int(path.stem[len("outer_") :]))
    return sorted(steps)


def roll_back(state_dir: str | Path, to_step: int) -> int:
    """Make the master state in ``state_dir`` continue from the global and momentum of outer
    step ``to_step`` (a kept history entry, or the current step), as a *new* outer step (the
    current one + 1, so every node installs it); the ledger is kept (deltas processed since are
    not aggregated again) and a halt is cleared; with streaming fragments every fragment's
    version becomes the new outer step, so every fragment file is published again and every
    node installs all of it. The master must not be running. Returns the new outer step; the
    restarted master publishes it."""
    state_dir = Path(state_dir)
    path = state_dir / STATE_FILE
    try:
        tensors, meta = load_tensors(path)
        current = int(meta["outer_step"])
    except (TensorFileError, KeyError, ValueError) as exc:
        raise SpeedtronicError(f"no readable master state at {path} ({exc})") from None
    if to_step == current:
        source = tensors
    else:
        kept = history_steps(state_dir)
        if to_step not in kept:
            raise SpeedtronicError(
                f"outer step {to_step} is not kept in {state_dir / HISTORY_DIR} "
                f"(kept: {', '.join(map(str, kept)) or 'none'}; current: {current})"
            )
        try:
            source, _ = load_tensors(state_dir / HISTORY_DIR / f"outer_{to_step:08d}.safetensors")
        except TensorFileError as exc:
            raise SpeedtronicError(str(exc)) from None
    weights = {k: v for k, v in source.items() if k.startswith(("global/", "momentum/"))}
    if not any(k.startswith("global/") for k in weights):
        raise SpeedtronicError(f"outer step {to_step}: no global weights in the kept state")
    new_step = current + 1
    updated = dict(meta)
    updated.update(
        outer_step=str(new_step),
        published_step="-1",
        halted="",
        rolled_back=json.dumps({"to": to_step, "from": current, "at": time.time()}),
    )
    if meta.get("fragment_state"):
        updated["fragment_state"] = _rolled_back_fragments(meta["fragment_state"], new_step)
    save_tensors(path, weights, updated)
    log.warning(
        "master state %s: rolled back to the global of outer step %d, as outer step %d "
        "(published when the master starts)",
        path,
        to_step,
        new_step,
    )
    return new_step


def _rolled_back_fragments(raw: str, new_step: int) -> str:
    """The ``fragment_state`` of a rolled-back master: every fragment's version is the new
    outer step (every node installs all of it) and no fragment file is kept (all are
    published again)."""
    try:
        state = dict(json.loads(raw))
        count = len(state.get("versions") or ())
    except (ValueError, TypeError):
        return json.dumps({})
    return json.dumps({"steps": state.get("steps") or [], "versions": [new_step] * count})


def _files_to_json(files: Iterable[FragmentFile | None]) -> list[dict[str, Any] | None]:
    return [None if entry is None else entry.to_json() for entry in files]


def _files_from_json(data: Any) -> list[FragmentFile | None]:
    """Fragment file entries saved by :func:`_files_to_json`; an unreadable one is None (its
    fragment is then published again)."""
    if not isinstance(data, list):
        return []
    out: list[FragmentFile | None] = []
    for entry in data:
        try:
            out.append(None if entry is None else FragmentFile.from_json(entry, STATE_FILE))
        except PermanentTransportError:
            out.append(None)
    return out


def _robust_state_from(meta: dict[str, str]) -> dict[str, Any]:
    def listed(key: str) -> list[Any]:
        value = json.loads(meta.get(key) or "[]")
        if not isinstance(value, list):
            raise ValueError(f"{key} is not a list")
        return value

    return {
        "norm_history": [float(n) for n in listed("norm_history")],
        "rejections": [r for r in listed("rejections") if isinstance(r, dict)],
        "halted": meta.get("halted") or None,
        "signatures": [str(s) for s in listed("signatures")],
    }
