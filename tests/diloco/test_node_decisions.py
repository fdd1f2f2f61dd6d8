"""The decisions a node's rooms return and the one applier that puts them into effect
(:mod:`speedtronic_diloco.node.decisions`), on a real coordinator's context: what each one
changes, and the rules that turn a late decision down (the baseline generation, each
fragment's generation, the feedback epoch, the upload id)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import MemoryTransport, dist_config, make_net, nudge

from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.node.boundary import cut
from speedtronic_diloco.node.decisions import (
    Decision,
    Deferred,
    Dispatched,
    Installed,
    Landed,
    NotSent,
    Rebaselined,
    Resolved,
    Restored,
    Stepped,
    UploadFailed,
    apply,
)
from speedtronic_diloco.node.deltas import UploadJob
from speedtronic_diloco.node.state import NodeState
from speedtronic_diloco.tensors import TensorDict, cpu_state_dict


def node(tmp_path: Path, **options: Any) -> DumbDiLoCoCoordinator:
    """A worker that was never started: its rooms and applier, no threads."""
    return DumbDiLoCoCoordinator(
        dist_config(**options), make_net(), hub=MemoryTransport(), state_dir=tmp_path
    )


def plus(tensors: TensorDict, amount: float) -> TensorDict:
    return {k: v + amount if v.is_floating_point() else v.clone() for k, v in tensors.items()}


def same(a: TensorDict, b: TensorDict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def dispatch(coordinator: DumbDiLoCoCoordinator, step: int = 2) -> UploadJob:
    """Move the model and cut its delta at ``step``, applied: the outstanding upload."""
    nudge(coordinator.model)
    decision = cut(coordinator.ctx, coordinator.model, step, (0,), final=False)
    assert isinstance(decision, Dispatched)
    assert coordinator.settle(decision)
    return decision.job


def test_a_room_changes_nothing_until_its_decision_is_applied(tmp_path: Path) -> None:
    coordinator = node(tmp_path)
    state = coordinator.ctx.state
    before = state.baseline
    nudge(coordinator.model)
    decision = cut(coordinator.ctx, coordinator.model, 2, (0,), final=False)
    assert isinstance(decision, Dispatched)
    assert state.pending is None and state.baseline is before  # nothing changed yet
    assert decision.pending["upload_id"] == decision.job.upload_id
    assert coordinator.settle(decision)
    assert state.pending == decision.pending

    outcome = coordinator.uploads.send(decision.job)  # the store took it
    assert isinstance(outcome, Landed)
    assert state.baseline is before and state.last_uploaded_step is None
    assert coordinator.settle(outcome)
    assert same(state.baseline, decision.job.target)
    assert state.last_uploaded_step == 2 and state.pending is None


def test_an_upload_measured_from_an_older_generation_does_not_move_the_baseline(
    tmp_path: Path,
) -> None:
    coordinator = node(tmp_path)
    state = coordinator.ctx.state
    job = dispatch(coordinator)
    fresh = plus(state.baseline, 5.0)
    assert coordinator.settle(Rebaselined(fresh))  # a new generation while it was in flight
    assert state.generation == job.generation + 1
    landed = Landed(job, None, coordinator.ctx.feedback_epoch, 10)
    assert not coordinator.settle(landed)  # refused: the baseline stays
    assert state.baseline is fresh
    assert state.last_uploaded_step == job.local_step  # it did land
    assert state.pending is None


def test_an_upload_of_a_reinstalled_fragment_does_not_move_that_baseline(tmp_path: Path) -> None:
    coordinator = node(tmp_path)
    ctx = coordinator.ctx
    job = dispatch(coordinator)
    weights = plus(ctx.state.baseline, 1.0)
    installed = Installed(1, weights, (0,), None, weights, None)
    assert coordinator.settle(installed)  # fragment 0 installed again: its generation moves
    assert ctx.state.generation == job.generation  # the baseline's generation did not
    assert not coordinator.settle(Landed(job, None, ctx.feedback_epoch, 10))
    assert same(ctx.state.baseline, weights)


def test_a_residual_encoded_before_a_reset_is_not_committed(tmp_path: Path) -> None:
    coordinator = node(tmp_path, compression="int8", error_feedback=True)
    ctx = coordinator.ctx
    job = dispatch(coordinator)
    encoded = ctx.feedback.encode(job.delta)
    assert encoded.residual
    assert coordinator.settle(Landed(job, encoded, ctx.feedback_epoch - 1, 10))
    assert ctx.feedback.residual == {}  # encoded before the last reset: not carried on
    job = dispatch(coordinator, step=4)
    encoded = ctx.feedback.encode(job.delta)
    assert coordinator.settle(Landed(job, encoded, ctx.feedback_epoch, 10))
    assert same(ctx.feedback.residual, encoded.residual)


def test_only_the_outstanding_upload_is_forgotten(tmp_path: Path) -> None:
    coordinator = node(tmp_path)
    state = coordinator.ctx.state
    job = dispatch(coordinator)
    assert not coordinator.settle(NotSent("another upload"))
    assert state.pending is not None
    assert coordinator.settle(NotSent(job.upload_id))
    assert state.pending is None
    assert not coordinator.settle(NotSent(job.upload_id))  # nothing left to forget


def test_a_failed_upload_gives_the_baseline_back_what_the_model_keeps(tmp_path: Path) -> None:
    coordinator = node(tmp_path, install_at="boundary", keep_own_progress=True)
    ctx, own = coordinator.ctx, coordinator._own
    assert own.enabled
    job = dispatch(coordinator)
    assert own.steps() == [job.local_step]
    with ctx.lock:
        global_weights = plus(ctx.state.baseline, 1.0)
        kept = own.apply(global_weights, aggregated=set())  # the install keeps the own delta
    assert coordinator.settle(Installed(1, global_weights, (0,), None, kept, None))
    # The install already ended it as the outstanding upload: nothing to forget (False).
    assert not coordinator.settle(UploadFailed(job))
    assert own.steps() == []
    # The model keeps the delta the store never got: the next boundary sends it again.
    expected = {k: kept[k] + job.delta[k] if k in job.delta else kept[k] for k in kept}
    assert all(torch.allclose(ctx.state.baseline[k], expected[k]) for k in expected)
    assert ctx.state.pending is None


def test_an_install_rebaselines_and_ends_the_upload_it_covers(tmp_path: Path) -> None:
    coordinator = node(tmp_path)
    state = coordinator.ctx.state
    dispatch(coordinator)
    weights = plus(state.baseline, 2.0)
    assert coordinator.settle(Installed(3, weights, (0,), None, weights, None))
    assert same(state.baseline, weights) and state.last_global_step == 3
    assert state.pending is None  # that upload no longer moves its baseline
    assert coordinator.installer.ready is None


def test_a_global_with_fragments_still_to_install_waits_ready(tmp_path: Path) -> None:
    coordinator = node(tmp_path, fragments=2, inner_steps=4)
    ctx, installer = coordinator.ctx, coordinator.installer
    plan = ctx.fragments.plan
    first = ((1, 1), plan.fingerprint)
    with ctx.lock:
        baseline = dict(ctx.state.baseline)
    assert coordinator.settle(Installed(1, baseline, plan.everything(), first, baseline, None))
    assert ctx.state.last_global_step == 1
    newer = plus(baseline, 1.0)
    info = ((2, 2), plan.fingerprint)
    part = plan.select(newer, (0,))
    names = plan.names((0,))
    assert coordinator.settle(Installed(2, newer, (0,), info, part, names))
    assert ctx.state.last_global_step == 1  # fragment 1 is still to install
    assert installer.ready is not None and installer.ready[0] == 2
    assert not coordinator.settle(Deferred(2, newer, info))  # the same global: already ready
    assert coordinator.settle(Deferred(3, newer, ((3, 3), plan.fingerprint)))
    assert installer.ready is not None and installer.ready[0] == 3
    assert not coordinator.settle(Deferred(4, newer, first))  # nothing left to install


def test_a_checkpoint_restores_counters_and_keeps_a_newer_installed_global(
    tmp_path: Path,
) -> None:
    coordinator = node(tmp_path)
    state = coordinator.ctx.state
    weights = plus(state.baseline, 1.0)
    assert coordinator.settle(Installed(5, weights, (0,), None, weights, None))
    older = NodeState(
        "w1",
        "worker",
        local_step=7,
        last_global_step=2,
        last_uploaded_step=6,
        baseline=plus(weights, 3.0),
        pending={"local_step": 6, "upload_id": "x"},
    )
    assert not coordinator.settle(Restored(older, started=True))
    assert state.local_step == 7 and state.last_uploaded_step == 6
    assert same(state.baseline, weights) and state.last_global_step == 5
    assert state.pending is None
    generation = state.generation
    assert coordinator.settle(Restored(older, started=False))  # before start: it wins
    assert state.baseline is older.baseline and state.last_global_step == 2
    assert state.pending == older.pending and state.generation == generation + 1


def test_a_resolved_upload_moves_the_baseline_to_its_target(tmp_path: Path) -> None:
    coordinator = node(tmp_path)
    state = coordinator.ctx.state
    pending = {"local_step": 4, "upload_id": "x"}
    coordinator.settle(
        Restored(NodeState(local_step=4, baseline=state.baseline, pending=pending), False)
    )
    base, generation = state.baseline, state.generation
    delta = {k: torch.full_like(v, 0.5) for k, v in base.items() if v.is_floating_point()}
    assert coordinator.settle(Resolved(4, None))  # never arrived: the baseline stays
    assert state.pending is None and state.baseline is base and state.generation == generation
    assert coordinator.settle(Resolved(4, delta))  # arrived: baseline minus what it carried
    assert all(torch.allclose(state.baseline[k], base[k] - 0.5) for k in delta)
    assert state.generation == generation + 1 and state.last_uploaded_step == 4
    weights = cpu_state_dict(coordinator.model.state_dict())
    assert coordinator.settle(Resolved(4, delta, weights))  # still at that step: its weights
    assert state.baseline is weights
    assert coordinator.settle(Stepped(5))
    assert coordinator.settle(Resolved(4, delta, plus(weights, 1.0)))  # trained on since
    assert all(torch.allclose(state.baseline[k], weights[k] - 0.5) for k in delta)


def test_decisions_are_applied_under_the_lock_only(tmp_path: Path) -> None:
    coordinator = node(tmp_path)
    ctx = coordinator.ctx
    with pytest.raises(RuntimeError, match="lock"):
        apply(Stepped(3), ctx, coordinator._own, coordinator.installer)
    assert ctx.state.local_step == 0
    outcome: list[bool] = []

    def other_thread() -> None:  # the lock held here does not count for another thread
        try:
            apply(Stepped(4), ctx, coordinator._own, coordinator.installer)
        except RuntimeError:
            outcome.append(False)

    with ctx.lock:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert apply(Stepped(3), ctx, coordinator._own, coordinator.installer)
    assert outcome == [False] and ctx.state.local_step == 3
    assert not coordinator.settle(None)


def test_an_upload_applies_what_came_of_it_and_counts_its_bytes(tmp_path: Path) -> None:
    coordinator = node(tmp_path)
    state = coordinator.ctx.state
    job = dispatch(coordinator)
    assert coordinator.uploads.upload(job)  # send, then the applier
    assert state.pending is None and same(state.baseline, job.target)
    assert coordinator.uploads.bytes_sent > 0
    decisions: list[Decision] = [NotSent(job.upload_id), Stepped(9)]
    assert [coordinator.settle(d) for d in decisions] == [False, True]
