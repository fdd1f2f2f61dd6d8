"""The outer step's staleness handling (issue 29), as properties over many random rounds:
``rounds: sync`` takes only deltas of the open round, async rounds only those at most
``max_staleness`` behind; ``momentum_staleness: inverse`` never adds momentum and keeps all of
it for fresh rounds; a thin round (``momentum_min_nodes``) is plain SGD and leaves the momentum
buffer as it was. And the merge rule of a node that installs a late global: over random
schedules of rounds, every bit of its work is in its weights exactly once, and the final global
holds all of it once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from diloco_fakes import MemoryTransport, dist_config, make_master, make_net, nudge
from hypothesis import given, settings
from hypothesis import strategies as st

from speedtronic_diloco.aggregation import AggregationRules, CheckedDelta, screen_round
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.master.round import nesterov_step, round_momentum
from speedtronic_diloco.tensors import cpu_state_dict
from speedtronic_diloco.transports.base import DeltaInfo


def checked(node: str, step: int, base: int | None, norm: float = 1.0) -> CheckedDelta:
    info = DeltaInfo(node, step, f"nodes/{node}/delta_{step}.safetensors")
    return CheckedDelta(info, Path("unused"), base, norm, {"w": norm})


rounds_of_deltas = st.lists(
    st.one_of(st.none(), st.integers(min_value=0, max_value=30)), min_size=1, max_size=8
)


@settings(max_examples=80, deadline=None)
@given(bases=rounds_of_deltas, current=st.integers(min_value=0, max_value=30))
def test_sync_rounds_take_only_deltas_of_the_open_round(
    bases: list[int | None], current: int
) -> None:
    deltas = [checked(f"n{i}", 1, b) for i, b in enumerate(bases)]
    rules = AggregationRules(rounds="sync", outlier_policy="off", max_staleness=1_000)
    kept, rejected, _ = screen_round(deltas, current, [], rules)
    fresh = {f"n{i}" for i, b in enumerate(bases) if b is None or b >= current}
    assert {c.node_id for c in kept} == fresh
    assert all(c.staleness == 0 for c in kept)
    assert {d.node_id for d, _ in rejected} == {d.node_id for d in deltas} - fresh
    assert {why.reason for _, why in rejected} <= {"late"}


@settings(max_examples=80, deadline=None)
@given(
    bases=rounds_of_deltas,
    current=st.integers(min_value=0, max_value=30),
    limit=st.integers(min_value=0, max_value=20),
)
def test_async_rounds_take_deltas_up_to_max_staleness(
    bases: list[int | None], current: int, limit: int
) -> None:
    deltas = [checked(f"n{i}", 1, b) for i, b in enumerate(bases)]
    rules = AggregationRules(outlier_policy="off", max_staleness=limit)
    kept, rejected, _ = screen_round(deltas, current, [], rules)
    for contribution in kept:
        assert contribution.staleness <= limit
    stale = {f"n{i}" for i, b in enumerate(bases) if b is not None and current - b > limit}
    assert {d.node_id for d, _ in rejected} == stale
    assert {why.reason for _, why in rejected} <= {"stale"}
    assert len(kept) + len(stale) == len(bases)


class Stale:
    def __init__(self, staleness: int) -> None:
        self.staleness = staleness


@settings(max_examples=100, deadline=None)
@given(
    momentum=st.floats(min_value=0.0, max_value=0.99),
    staleness=st.lists(st.integers(min_value=0, max_value=16), min_size=1, max_size=8),
)
def test_staleness_momentum_never_adds_and_keeps_fresh_rounds_whole(
    momentum: float, staleness: list[int]
) -> None:
    contributions = [Stale(s) for s in staleness]
    scaled = round_momentum(momentum, contributions, "inverse")
    assert 0.0 <= scaled <= momentum
    assert round_momentum(momentum, contributions, "none") == momentum
    if not any(staleness):
        assert scaled == momentum
    # Staler rounds never get more momentum.
    staler = round_momentum(momentum, [Stale(s + 1) for s in staleness], "inverse")
    assert staler <= scaled
    assert scaled == pytest.approx(momentum / (1 + sum(staleness) / len(staleness)))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**16),
    lr=st.floats(min_value=0.05, max_value=2.0),
    momentum=st.floats(min_value=0.0, max_value=0.99),
    has_buffer=st.booleans(),
)
def test_a_thin_round_is_plain_sgd_and_keeps_the_buffer(
    seed: int, lr: float, momentum: float, has_buffer: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(5, generator=gen)}
    grads = {"w": torch.randn(5, generator=gen, dtype=torch.float64)}
    buffers = {"w": torch.randn(5, generator=gen, dtype=torch.float64)} if has_buffer else {}
    new, kept = nesterov_step(params, grads, buffers, lr, momentum, use_momentum=False)
    torch.testing.assert_close(new["w"], (params["w"].double() - lr * grads["w"]).float())
    expected = buffers["w"] if has_buffer else torch.zeros(5, dtype=torch.float64)
    torch.testing.assert_close(kept["w"].double(), expected)
    # The next full step after a thin one is the step the thin round never disturbed.
    g2 = {"w": torch.randn(5, generator=gen, dtype=torch.float64)}
    after, _ = nesterov_step(new, g2, kept, lr, momentum)
    direct, _ = nesterov_step(new, g2, buffers, lr, momentum)
    torch.testing.assert_close(after["w"], direct["w"])


# --------------------------------------------------------------------------- the merge rule


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("seed", range(2))
def test_a_late_global_keeps_the_nodes_work_exactly_once(
    tmp_path: Path, seed: int, scale: float
) -> None:
    """One node, outer lr 1 and no momentum: the global is the start plus every aggregated
    delta, so (``own_progress_scale`` 1) at every step the node's weights must be the start
    plus all of its own work (each nudge once: none lost, none twice), whenever the rounds run
    and however late the globals it installs are. With a smaller scale the node keeps less of
    its pending deltas locally, but what it sends is still every nudge exactly once: the final
    global holds all of its work, once."""
    rng = random.Random(seed)
    store = MemoryTransport()
    start = {k: v for k, v in cpu_state_dict(make_net().state_dict()).items()}
    master = make_master(store, tmp_path, lr=1.0, start=start, rules={"outlier_policy": "off"})
    assert master.publish() is not None
    model = make_net()
    node = DumbDiLoCoCoordinator(
        dist_config(
            inner_steps=2,
            keep_own_progress=True,
            install_at="boundary",
            own_progress_scale=scale,
        ),
        model,
        hub=store,
        state_dir=tmp_path / "node",
    )
    node.start()
    work = lag = 0.0
    installs = 0
    for step in range(1, 41):
        amount = rng.uniform(0.001, 0.02)
        nudge(model, amount)
        work += amount
        before = node.last_global_step
        node.after_optimizer_step(model, step)
        installs += node.last_global_step > before
        for name, value in model.state_dict().items():
            if not value.is_floating_point():
                continue
            if scale == 1.0:
                torch.testing.assert_close(value, start[name] + work, msg=f"step {step} {name}")
            else:  # it kept only part of its pending deltas: behind its own work
                lag = max(lag, float((start[name] + work - value).max()))
        if step % 2 == 0 and rng.random() < 0.6:
            master.run_round()  # a round now, or only after a later boundary: late globals
    node.stop()
    master.run_round()
    final = master.snapshot()
    assert final is not None and installs >= 3
    assert (lag > 1e-4) == (scale < 1.0)
    for name, value in final[1].items():
        if value.is_floating_point():
            torch.testing.assert_close(value, start[name] + work)
