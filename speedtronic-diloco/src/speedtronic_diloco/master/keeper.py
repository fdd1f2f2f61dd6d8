"""The master's persisted state in memory: :class:`OuterStateKeeper` holds the
:class:`~speedtronic_diloco.master.state.OuterState` under a lock, loads and saves it through
its one codec (state file and trainer checkpoint), keeps the history for rollback, and moves
it where startup says (bootstrap, adopt the store's global, continue after it)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from speedtronic_diloco.fragment_files import FragmentFileError, check_fragment_metadata
from speedtronic_diloco.fragments import FragmentLayout, FragmentPlan
from speedtronic_diloco.master.fragments import MasterFragments
from speedtronic_diloco.master.history import keep_history
from speedtronic_diloco.master.state import (
    NORM_HISTORY,
    STATE_FILE,
    OuterState,
    from_checkpoint,
    load_state,
    save_state,
    to_checkpoint,
)
from speedtronic_diloco.tensors import TensorDict, TensorFileError, floating_only
from speedtronic_diloco.transports.base import GlobalMetadata

__all__ = ["OuterStateKeeper"]

log = logging.getLogger("speedtronic.diloco.outer")


def _field(name: str, doc: str) -> Any:
    """A read-write view of one field of the loop's :class:`OuterState`."""

    def get(self: OuterStateKeeper) -> Any:
        return getattr(self.state, name)

    def put(self: OuterStateKeeper, value: Any) -> None:
        with self.lock:
            setattr(self.state, name, value)

    return property(get, put, doc=doc)


class OuterStateKeeper:
    """The master's :class:`OuterState`, guarded by a lock and persisted under ``state_dir``
    (constructing it loads the state file when there is one). ``lock`` is held by whoever
    reads several fields as one or replaces the state."""

    outer_step = _field("outer_step", "The current outer step.")
    global_state = _field("global_state", "The current global weights (None before any).")
    momentum = _field("momentum", "The Nesterov momentum buffers.")
    processed = _field("processed", "The processed-delta ledger.")
    published_step = _field("published_step", "The newest outer step the store has.")
    rejections = _field("rejections", "Recent rejection records (kept in the state).")
    norm_history = _field("norm_history", "Recent accepted contribution norms.")
    halted = _field("halted", "Why the loop stopped publishing (a bad candidate), or None.")

    def __init__(
        self, node_id: str, state_dir: str | Path, keep: int, fragments: FragmentLayout | None
    ) -> None:
        self.node_id = node_id
        self.state_dir = Path(state_dir)
        self.keep_history = keep
        self.has_local_state = False
        self.state = OuterState()
        self.lock = threading.RLock()
        self.load()
        self.set_fragments(fragments)

    @property
    def fragments(self) -> MasterFragments:
        return self.state.fragments

    @property
    def fragment_steps(self) -> list[int]:
        return self.state.fragments.steps

    @property
    def fragment_versions(self) -> list[int]:
        return self.state.fragments.versions

    @property
    def fragment_files(self) -> list[Any]:
        return self.state.fragments.files

    def set_fragments(self, layout: FragmentLayout | None) -> None:
        """Run with streaming fragments (see :mod:`speedtronic_diloco.fragments`); None or one
        fragment: a book of one. Counters saved for another count restart at zero, every
        fragment's version at the current outer step."""
        with self.lock:
            old = self.state.fragments
            book = MasterFragments(
                FragmentPlan(layout), steps=old.steps, versions=old.versions, files=old.files
            )
            book.start(self.state.outer_step, NORM_HISTORY)
            self.state.fragments = book

    def fragment_info_at(self, outer_step: int) -> tuple[tuple[int, ...], str] | None:
        """``(fragment versions, layout)`` of the global of ``outer_step`` (None: unknown)."""
        with self.lock:
            return self.state.fragments.info_at(outer_step)

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
            loaded = load_state(path)
        except TensorFileError as exc:
            log.warning("master state %s is unreadable (%s); ignoring it", path, exc)
            return False
        with self.lock:
            self.state = self._keeping_layout(loaded)
            self.has_local_state = True
        if loaded.halted:
            log.error("master state %s: the outer loop is HALTED (%s)", path, loaded.halted)
        log.info(
            "master state: outer step %d, %d processed deltas (%s)",
            loaded.outer_step,
            len(loaded.processed),
            path,
        )
        return True

    def _keeping_layout(self, loaded: OuterState) -> OuterState:
        """``loaded`` with this run's fragment layout around its saved counters."""
        saved = loaded.fragments
        plan = self.state.fragments.plan
        book = MasterFragments(plan, steps=saved.steps, versions=saved.versions, files=saved.files)
        book.start(loaded.outer_step, NORM_HISTORY)
        return replace(loaded, fragments=book)

    def save(self) -> None:
        """Persist the state in one atomic file, and keep it in the history."""
        with self.lock:
            if self.state.global_state is None:
                return
            state = replace(self.state)
        save_state(self.state_path, state, self.node_id)
        self.has_local_state = True
        if not state.halted:
            keep_history(self.state_dir, state.outer_step, self.keep_history)

    def state_dict(self) -> dict[str, Any]:
        """The state for trainer checkpoints: the state file's encoding."""
        with self.lock:
            return to_checkpoint(self.state, self.node_id)

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Adopt checkpointed outer state when it is ahead of what was loaded from disk. The
        published step stays the state file's: the store, not the checkpoint, says what it
        has."""
        saved = from_checkpoint(state)
        if self.has_local_state and saved.outer_step <= self.outer_step:
            return False
        with self.lock:
            saved = replace(
                self._keeping_layout(saved),
                global_state=saved.global_state or self.state.global_state,
                published_step=self.state.published_step,
            )
            self.state = saved
            self.has_local_state = saved.global_state is not None
        return True

    def has_processed(self, key: tuple[str, int]) -> bool:
        """True when the ledger holds the delta ``(node_id, local_step)``."""
        with self.lock:
            return key in self.state.processed

    def known_nodes(self) -> dict[str, int]:
        """Every node of the processed-delta ledger and its highest processed local step."""
        with self.lock:
            return {node: record.high for node, record in self.state.processed.nodes.items()}

    def snapshot(self, published: bool = False) -> tuple[int, TensorDict] | None:
        """``(outer_step, global weights)`` under the lock, or None before any state exists
        (and, with ``published``, while the current step is not published yet)."""
        with self.lock:
            state = self.state
            behind = published and state.published_step < state.outer_step
            if state.global_state is None or behind:
                return None
            return state.outer_step, state.global_state

    def bootstrap(self, weights: TensorDict) -> None:
        """Start from ``weights`` at outer step 0 (nothing local, nothing remote)."""
        with self.lock:
            self.state = replace(
                self.state, global_state=dict(weights), momentum={}, outer_step=0, published_step=-1
            )
            self.state.fragments.restart_versions(0)
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
        with self.lock:
            self.state = replace(
                self.state,
                global_state=dict(weights),
                momentum={},
                outer_step=outer_step,
                published_step=outer_step,
            )
            self.state.processed.merge_published(processed, nodes, outer_step)
            book = self.state.fragments
            book.restart_versions(outer_step)
            if remote is not None:
                with contextlib.suppress(FragmentFileError):
                    book.adopt_published(
                        lambda layout: check_fragment_metadata(remote, layout),
                        remote.fragment_files,
                    )
        self.save()

    def adopt_state(self, stored: OuterState, remote: GlobalMetadata | None = None) -> None:
        """Continue exactly from the outer state the store keeps for its current global
        (:mod:`~speedtronic_diloco.master.store_state`): a successor master's next outer step
        is the one its predecessor would have made. The fragment files are those ``remote``
        (the global's metadata) lists: the state was written before they were published."""
        with self.lock:
            self.state = self._keeping_layout(replace(stored, published_step=stored.outer_step))
            if remote is not None:
                with contextlib.suppress(FragmentFileError):
                    self.state.fragments.adopt_published(
                        lambda layout: check_fragment_metadata(remote, layout),
                        remote.fragment_files,
                    )
        self.save()

    def continue_after(self, store_step: int) -> None:
        """The store holds ``store_step`` but its weights could not be fetched: keep the local
        weights, do not republish, and number the next outer step after the store's."""
        with self.lock:
            self.state.outer_step = max(self.state.outer_step, store_step)
            self.state.published_step = self.state.outer_step
        self.save()

    def mark_unpublished(self) -> None:
        """Publish the current state on the next chance (the store is behind)."""
        with self.lock:
            self.state.published_step = -1

    def halt_if_not_finite(self) -> str | None:
        """Halt when the current global is not finite (a store or state file written by
        something else); returns why, or None (also when already halted)."""
        with self.lock:
            state = self.state
            if state.global_state is None or state.halted:
                return None
            floating = floating_only(state.global_state)
            bad = [k for k, v in floating.items() if not bool(v.isfinite().all())]
            if not bad:
                return None
            state.halted = f"the global of outer step {state.outer_step} is not finite ({bad[0]})"
            return state.halted
