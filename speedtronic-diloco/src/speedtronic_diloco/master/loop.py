"""The master's outer loop: a tick, the final round and halting (its thread is an
:class:`~speedtronic_diloco.master.outer_thread.OuterThread`, its state its keeper's). It calls the
rooms in the order a delta travels: :mod:`~speedtronic_diloco.master.intake` (list, fetch,
check), :mod:`~speedtronic_diloco.master.round` (the pure outer step), the state file
(:mod:`~speedtronic_diloco.master.state`, with :mod:`~speedtronic_diloco.master.history`),
:mod:`~speedtronic_diloco.master.publish` (fenced), :mod:`~speedtronic_diloco.master.report`.

State is persisted *before* the new weights are published: a master that crashes in between
finds a local outer step ahead of the store's on restart and republishes instead of
aggregating the same deltas again. A bad candidate global *halts* the loop (nothing more is
published, loudly, and the halt survives restarts) with the previous good global and momentum
kept. The processed-delta ledger and the store housekeeping live in
:mod:`speedtronic_diloco.ledger`, the lease that fences every publication in
:mod:`speedtronic_diloco.lease`. A lost lease, or any error escaping a round, ends the outer
thread with :attr:`MasterOuterLoop.failure` set, which stops the run loudly; the thread looks at
its lease at every poll, so a lost lease stops it within ``poll_interval`` of being noticed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedtronic.errors import SpeedtronicError
from speedtronic_diloco.aggregation import AggregationRules
from speedtronic_diloco.fragments import FragmentLayout
from speedtronic_diloco.ledger import Housekeeper, Verdict
from speedtronic_diloco.master.intake import Fetched, Intake, Intaken, Refused
from speedtronic_diloco.master.keeper import OuterStateKeeper
from speedtronic_diloco.master.outer_thread import OuterThread
from speedtronic_diloco.master.publish import Publication, Publisher
from speedtronic_diloco.master.report import Emit, Reporter
from speedtronic_diloco.master.round import OuterPolicy, RoundResult, guarded, run_round
from speedtronic_diloco.master.round_policy import RoundDecision, RoundPolicy
from speedtronic_diloco.membership import Membership
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.tensors import TensorDict
from speedtronic_diloco.transports.base import DeltaInfo, GlobalMetadata, Transport

__all__ = ["MasterOuterLoop", "OuterLoopStopped"]

log = logging.getLogger("speedtronic.diloco.outer")


class OuterLoopStopped(SpeedtronicError):
    """The master's outer thread died (a lost lease, an unexpected error): the run stops."""


class MasterOuterLoop:
    """The master's outer optimizer over the store's deltas, with persisted state.

    Constructing it loads ``<state_dir>/outer_state.safetensors`` when present: the state is
    its ``keeper``'s (:class:`~speedtronic_diloco.master.keeper.OuterStateKeeper`, which also
    starts it: bootstrap, adopt, continue after the store). The loop offers the reads a caller
    needs most (:attr:`outer_step`, :attr:`global_state`, :meth:`snapshot`, the checkpoint
    state); they take the keeper's lock and return immutable references: each round builds new
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
        fragments: FragmentLayout | None = None,
        global_compression: str = "none",
        lease: Any = None,
    ) -> None:
        self.transport = transport
        self.cache_dir = Path(cache_dir)
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.rules = rules or AggregationRules()
        self.node_id = node_id
        self.keeper = OuterStateKeeper(node_id, state_dir, self.rules.keep_history, fragments)
        self.policy = RoundPolicy.of(self.rules, clock)
        self.membership = Membership(transport)  # the nodes that left: not waited for
        #: ``evaluate(global weights) -> held-out loss``; called before each publication.
        self.evaluate = evaluate
        #: The master's lease (:class:`~speedtronic_diloco.lease.LeaseKeeper`), or None.
        self.lease: Any = lease
        self.last_published: GlobalMetadata | None = None
        # Rounds and publications never overlap (the thread and a direct caller share files).
        self._round_lock = threading.RLock()
        self.thread = OuterThread(self._turn, lambda: self.lease)
        self._extra: dict[str, Any] = {}  # the last round's entry of the published `extra`
        self._final_nodes: set[str] = set()
        self._bytes_in = 0  # delta bytes downloaded since the last reported round
        retry = retry or RetryPolicy()
        self.intake = Intake(
            transport, cache_dir=self.cache_dir, rules=self.rules, retry=retry, stop=self._stopper
        )
        self.publisher = Publisher(
            transport,
            node_id=node_id,
            cache_dir=self.cache_dir,
            retry=retry,
            stop=self._stopper,
            lease=lambda: self.lease,
            signing_key=self.rules.signing_key,
            compression=global_compression,
        )
        self.reporter = Reporter(emit, self.keeper.state_dir)
        self.housekeeper = Housekeeper(
            transport,
            keep_outer_steps=keep_outer_steps,
            squash_history_every=squash_history_every,
            cache_dir=self.cache_dir / "deltas",
            cache_keep=cache_keep,
            retry=retry,
        )

    def _stopper(self) -> threading.Event:
        return self.thread.stop_event

    # ----------------------------------------------------------------- the state's reads
    @property
    def outer_step(self) -> int:
        """The current outer step (the keeper's)."""
        return self.keeper.outer_step

    @property
    def global_state(self) -> TensorDict | None:
        """The current global weights, None before any (the keeper's)."""
        return self.keeper.global_state

    @property
    def halted(self) -> str | None:
        """Why the loop stopped publishing (a bad candidate), or None."""
        return self.keeper.halted

    def snapshot(self, published: bool = False) -> tuple[int, TensorDict] | None:
        """The keeper's snapshot (``published``: once the store has the current step)."""
        return self.keeper.snapshot(published)

    def state_dict(self) -> dict[str, Any]:
        """The outer state for trainer checkpoints (:meth:`OuterStateKeeper.state_dict`)."""
        return self.keeper.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Adopt checkpointed outer state ahead of the state file's
        (:meth:`OuterStateKeeper.load_state_dict`)."""
        return self.keeper.load_state_dict(state)

    # ----------------------------------------------------------------- settings
    @property
    def retry(self) -> RetryPolicy:
        return self.intake.retry

    @retry.setter
    def retry(self, value: RetryPolicy) -> None:
        self.intake.retry = self.publisher.retry = value

    # ----------------------------------------------------------------- publication
    def publish(self, deltas_included: int = 0) -> GlobalMetadata | None:
        """Publish the current global weights and metadata (signed with a key); None (with a
        warning) on failure, and always None while the loop is halted."""
        with self.keeper.lock:
            state = self.keeper.state
            if state.global_state is None:
                return None
            if state.halted:
                self.reporter.still_halted(state.halted)
                return None
            step = state.outer_step
            extra = dict(self._extra) if self._extra.get("outer_step") == step else {}
            item = Publication.of(state, self.node_id, extra, deltas_included, self.transport)
        with self._round_lock:
            published = self.publisher.publish(item)
        if published is None:
            return None
        with self.keeper.lock:
            self.keeper.state.published_step = max(self.keeper.state.published_step, step)
            self.last_published = published
            if published.fragment_files:  # published one file per fragment
                self.keeper.state.fragments.files = list(published.fragment_files)
        with contextlib.suppress(OSError):
            self.keeper.save()
        log.info("published outer step %d to %s", step, self.transport.description)
        return published

    def publish_if_behind(self) -> bool:
        """Publish when the store has not seen the current outer step yet."""
        with self._round_lock:
            with self.keeper.lock:
                state = self.keeper.state
                behind = state.global_state is not None and state.published_step < state.outer_step
            return behind and self.publish() is not None

    # ----------------------------------------------------------------- rounds
    def run_round(self, abort: threading.Event | None = None) -> RoundResult | None:
        """Aggregate every new delta into one outer step now, whatever the round policy says;
        None when there was nothing new (or ``abort`` was set before the deltas were all
        fetched)."""
        with self._round_lock:
            return self._round(abort)

    def tick(self, abort: threading.Event | None = None) -> RoundResult | None:
        """One turn of the outer thread: list the store, fetch and check the new deltas (kept
        on disk until their round), ask the round policy, and run a round when it says so:
        ``min_deltas`` (at most the live nodes: :mod:`~speedtronic_diloco.membership`) nodes
        pending with the same, newest base outer step (the quorum), or ``round_timeout`` since
        the first pending delta. With ``rounds: sync``: every live node has a delta computed
        from the current global pending, or ``round_timeout`` since the first such delta."""
        with self._round_lock:
            if self.keeper.halted:
                self.reporter.still_halted(self.keeper.halted)
                return None
            listing = self.intake.list_deltas()
            if listing is None:
                return None
            new = self._prefetch(listing, abort)
            decision = _decide(self.intake, self.policy, new, self.keeper.outer_step)
            if not decision.go:
                return None
            result = self._round(abort, listing, decision, waiting=True)
            if result is not None:
                self.policy.round_done(waiting_for(result))
            return result

    def _new_deltas(self, listing: list[DeltaInfo]) -> list[DeltaInfo]:
        with self.keeper.lock:
            return self.keeper.state.processed.candidates(listing)

    def _fetch(self, info: DeltaInfo, reference: TensorDict) -> Intaken | None:
        with self.keeper.lock:
            book, signatures = self.keeper.state.fragments, tuple(self.keeper.state.signatures)
        outcome = self.intake.fetch(
            info, reference, book, processed=self._seen, signatures=signatures
        )
        if outcome is not None:
            self._bytes_in += outcome.size
        if isinstance(outcome, Refused):  # told now: its round may be round_timeout away
            self.reporter.refused(outcome.info, outcome.why)
        return outcome

    def _seen(self, info: DeltaInfo, content: str) -> bool:
        """The same bytes as a processed delta (touched, copied back)."""
        with self.keeper.lock:
            ledger = self.keeper.state.processed
            return ledger.verdict(info) is Verdict.CHECK and ledger.same_content(info, content)

    def _prefetch(
        self, listing: list[DeltaInfo], abort: threading.Event | None = None
    ) -> list[DeltaInfo]:
        """Fetch and check every new delta of ``listing`` ahead of its round; returns the new
        deltas."""
        new = self._new_deltas(listing)
        for info in new:
            self.policy.saw(info.node_id)
        self.policy.left(self.membership.gone(listing))
        reference = self.keeper.global_state
        if reference is not None:
            self.intake.prefetch(new, lambda info: self._fetch(info, reference), abort)
            for node in self.intake.only_refused(new):  # not waited for: see Intake
                self.policy.rejected(node)
        return new

    def _round(
        self,
        abort: threading.Event | None,
        listing: list[DeltaInfo] | None = None,
        decision: RoundDecision | None = None,
        reason: str = "forced",
        waiting: bool = False,
    ) -> RoundResult | None:
        """One round over ``listing``'s new deltas (taking those fetched ahead when
        ``waiting``): intake, the pure round, then keep, record, save, report, publish."""
        with self.keeper.lock:
            state = self.keeper.state
            if state.global_state is None or state.halted:
                return None
        listing = listing if listing is not None else self.intake.list_deltas()
        new = self._new_deltas(listing) if listing is not None else []
        if not new:
            return None
        outcomes: list[Intaken] = []
        try:
            for info in new:
                if abort is not None and abort.is_set():
                    return None
                outcome = self.intake.take(info) if waiting else None
                outcome = outcome or self._fetch(info, state.global_state)
                if outcome is not None:
                    outcomes.append(outcome)
            result = run_round(
                state,
                outcomes,
                OuterPolicy(self.outer_lr, self.outer_momentum, self.rules, guarded(self.evaluate)),
                reason=decision.reason if decision is not None else reason,
                waited_s=decision.waited_s if decision is not None else 0.0,
                found=len(new),
            )
        finally:
            for outcome in outcomes:
                if isinstance(outcome, Fetched):
                    with contextlib.suppress(FileNotFoundError):
                        outcome.delta.path.unlink()
        return self._keep(result, outcomes, listing or [])

    def _keep(
        self, result: RoundResult, outcomes: list[Intaken], listing: list[DeltaInfo]
    ) -> RoundResult | None:
        """Adopt the round's state, note its deltas in the ledger, tell, save, publish."""
        after = result.state
        assert after is not None
        step = after.outer_step
        with self.keeper.lock:
            if step > self.keeper.state.outer_step:
                after.fragments.after_round(result.groups, step)
            self.keeper.state = after
            result.record(after.processed, {o.info.key: o.content for o in outcomes})
            included = [d for c in result.contributions for d in c.deltas]
            self._final_nodes.update(d.node_id for d in included if d.final)
        for contribution in result.contributions:
            self.reporter.accepted(contribution.node_id)
        for info, why in result.refusals:
            record = self.reporter.rejected(info, why, step)
            with self.keeper.lock:
                self.keeper.state.rejections = [*self.keeper.state.rejections, record]
                self.keeper.state.trimmed()
            if why.reason != "late":  # a late node is still live: the next round waits for it
                self.policy.rejected(info.node_id)
        for contribution in result.contributions:
            self.policy.accepted(contribution.node_id)
        if not result.accepted and not result.refusals:
            return None
        if result.problem is not None:
            self.reporter.halted(after.halted or "", step)
        if result.accepted:
            self._extra = result.published_extra()
        with contextlib.suppress(OSError):
            self.keeper.save()  # before publishing: see the module docstring
        if result.accepted:
            fields = {
                "bytes_received": self._bytes_in,
                **after.fragments.plan.fragment_field(sorted(result.groups)),
            }
            self._bytes_in = 0
            self.reporter.round(result, fields)
            self.publish(len(result.accepted))
        self._tidy_store(listing)
        return result

    def _tidy_store(self, listing: list[DeltaInfo]) -> None:
        """Delete the processed deltas the store no longer needs (fenced), squash when due."""
        fence = self.lease.check() if self.lease is not None else None
        if self.lease is not None and self.lease.supported and fence is None:
            return  # not holding the lease (yet): delete nothing
        with self.keeper.lock:
            ledger, step = self.keeper.state.processed, self.keeper.state.outer_step
        stop = self.thread.stop_event
        self.housekeeper.after_round(ledger, listing, step, fence=fence, stop=stop)

    # ----------------------------------------------------------------- halting, the end
    def check_current(self) -> None:
        """Halt (loudly) when the current global itself is not finite (a store or state file
        written by something else)."""
        reason = self.keeper.halt_if_not_finite()
        if reason is not None:
            self.reporter.halted(reason, self.keeper.outer_step)

    def finish(self, timeout: float) -> GlobalMetadata | None:
        """End of training (the thread is stopped): wait at most ``timeout`` seconds for the
        final deltas of the nodes seen recently, aggregate everything pending, publish, and
        name the final global. Returns its published metadata (None if none)."""
        deadline = time.monotonic() + max(0.0, timeout)
        # Deltas are fetched and checked as they come (their metadata says which is a node's
        # final one), then aggregated in one round: one outer step, not one per straggler.
        with self._round_lock:
            try:
                listing = None
                while not self.keeper.halted:
                    seen = self.intake.list_deltas()
                    listing = seen if seen is not None else listing
                    if seen is not None:
                        self._prefetch(seen)
                    finals = set(self._final_nodes)
                    for outcome in self.intake.waiting():
                        if isinstance(outcome, Fetched) and outcome.delta.final:
                            finals.add(outcome.delta.node_id)
                    expected = self.policy.recent_nodes() - {self.node_id} - finals
                    if not expected or time.monotonic() >= deadline:
                        break
                    time.sleep(0.2)
                if listing is not None and not self.keeper.halted:
                    self._round(None, listing, reason="final", waiting=True)
                    self.policy.round_done()
            finally:
                self.intake.drop_all()
            if self.keeper.halted:
                self.reporter.still_halted(self.keeper.halted)
            else:
                self.publish_if_behind()
        with self.keeper.lock:
            step, published = self.keeper.state.outer_step, self.last_published
        final = published if published is not None and published.outer_step == step else None
        if final is not None:
            where = f"{self.transport.description.rstrip('/')}/{final.model_file}"
        else:
            where = f"not published; local state {self.keeper.state_path}"
        self.reporter.final(step, where)
        return final

    # ----------------------------------------------------------------- thread
    def start(self, interval: float) -> None:
        """Run publish-if-behind and :meth:`tick` every ``interval`` seconds in a daemon
        thread (:class:`~speedtronic_diloco.master.outer_thread.OuterThread`)."""
        self.thread.start(interval)

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the thread to stop after its current round; True when it ended in time."""
        return self.thread.stop(timeout)

    @property
    def running(self) -> bool:
        return self.thread.running

    @property
    def failure(self) -> BaseException | None:
        """What ended the outer thread (a lost lease, an unexpected error), or None."""
        return self.thread.failure

    def _turn(self, stop: threading.Event) -> None:
        self.publish_if_behind()
        self.tick(abort=stop)

    def raise_if_failed(self) -> None:
        """Raise :class:`OuterLoopStopped` once the outer thread has died (the coordinator
        calls this at every step, so a dead master loop stops the run loudly)."""
        failure = self.failure
        if failure is not None:
            raise OuterLoopStopped(
                f"DumbDiLoCo master {self.node_id!r}: the outer loop stopped "
                f"({type(failure).__name__}: {failure}); stopping the run"
            ) from failure


def waiting_for(result: RoundResult) -> set[str]:
    """The nodes that wait for ``result``'s global: those that went in (but for the ones whose
    final delta it was), and those refused ``late`` (their round closed without them; they
    install this global and come back)."""
    late = {info.node_id for info, why in result.refusals if why.reason == "late"}
    ended = {d.node_id for c in result.contributions for d in c.deltas if d.final}
    return (set(result.nodes) - ended) | late


def _decide(
    intake: Intake, policy: RoundPolicy, new: list[DeltaInfo], current: int
) -> RoundDecision:
    """The round policy's decision over the new deltas ``new`` at outer step ``current``
    (what counts is the policy's round mode's: :mod:`~speedtronic_diloco.round_mode`)."""
    pending, quorum = policy.mode.round_inputs(intake, new, current, policy.failing())
    return policy.decide(pending, quorum)
