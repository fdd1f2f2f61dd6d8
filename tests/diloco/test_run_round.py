"""Direct, store-free tests of the pure outer round, ``master/round.py:run_round`` (issue 42):
checked delta files on local disk in, a new state out. Property tests over random delta sets:
the round is the averaged pseudo-gradient's Nesterov step (with the outer warm-up of issue 40),
it never changes the state it was given, and every delta is either accepted or refused."""

from __future__ import annotations

from pathlib import Path

import torch
from diloco_fakes import make_net
from hypothesis import given, settings
from hypothesis import strategies as st

from speedtronic_diloco.aggregation import AggregationRules, inspect_delta
from speedtronic_diloco.master.intake import Fetched
from speedtronic_diloco.master.round import OuterPolicy, run_round, warmed
from speedtronic_diloco.master.state import OuterState
from speedtronic_diloco.tensors import cpu_state_dict, floating_only, save_tensors
from speedtronic_diloco.transports import DeltaInfo, delta_path

RULES = dict(outlier_policy="off")


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return cpu_state_dict(make_net().state_dict())


def fetched(directory: Path, node: str, delta: dict[str, torch.Tensor], base: int) -> Fetched:
    fields = {"node_id": node, "local_step": 10, "base_outer_step": base}
    path = save_tensors(directory / f"{node}.safetensors", delta, fields)
    info = DeltaInfo(node, 10, delta_path(node, 10))
    return Fetched(info, inspect_delta(path, info, reference()), f"sha-{node}", (0,), False)


@settings(max_examples=25, deadline=None)
@given(
    nodes=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    lr=st.sampled_from([0.5, 0.7, 1.0]),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    warmup=st.sampled_from([0, 4]),
    completed=st.sampled_from([0, 2, 8]),
)
def test_a_round_is_the_nesterov_step_of_the_averaged_pseudo_gradient(
    tmp_path_factory: object,
    nodes: int,
    seed: int,
    lr: float,
    momentum: float,
    warmup: int,
    completed: int,
) -> None:
    directory = tmp_path_factory.mktemp("round")  # type: ignore[attr-defined]
    start = reference()
    generator = torch.Generator().manual_seed(seed)
    deltas = [
        {
            k: torch.randn(v.shape, generator=generator) * 0.01
            for k, v in floating_only(start).items()
        }
        for _ in range(nodes)
    ]
    state = OuterState(outer_step=completed, global_state=dict(start))
    before = {k: v.clone() for k, v in start.items()}
    outcomes = [fetched(directory, f"n{i}", d, completed) for i, d in enumerate(deltas)]
    rules = AggregationRules(outer_warmup=warmup, **RULES)
    result = run_round(state, outcomes, OuterPolicy(lr, momentum, rules), reason="quorum")

    assert result.outer_step == completed + 1 and result.deltas_included == nodes
    assert set(result.included) | set(result.rejected) == {o.info.key for o in outcomes}
    assert all(torch.equal(state.global_state[k], before[k]) for k in before)  # untouched
    step_lr, step_momentum = warmed(lr, momentum, completed, warmup)
    assert result.momentum == step_momentum
    after = result.state.global_state
    for name, tensor in floating_only(start).items():
        g = sum(d[name] for d in deltas) / nodes  # the mean, first step: buffer = g
        expected = tensor - step_lr * (g + step_momentum * g)
        torch.testing.assert_close(after[name], expected, rtol=1e-5, atol=1e-6)


def test_the_first_warmed_round_is_plain_averaging(tmp_path: Path) -> None:
    start = reference()
    deltas = [
        {k: torch.full(v.shape, float(i + 1)) for k, v in floating_only(start).items()}
        for i in range(3)
    ]
    outcomes = [fetched(tmp_path, f"n{i}", d, 0) for i, d in enumerate(deltas)]
    rules = AggregationRules(outer_warmup=8, **RULES)
    state = OuterState(outer_step=0, global_state=dict(start))
    result = run_round(state, outcomes, OuterPolicy(0.7, 0.9, rules))
    for name, tensor in floating_only(start).items():  # the mean delta is 2: lr 1, no momentum
        torch.testing.assert_close(result.state.global_state[name], tensor - 2.0)
    assert result.momentum == 0.0
