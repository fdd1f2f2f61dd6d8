"""Streaming fragments (speedtronic_diloco.fragments): the balanced contiguous layout, the sync
schedule, fragment metadata, per-fragment outer steps and what a node installs."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest
import torch

from speedtronic_diloco.fragments import (
    FragmentError,
    FragmentLayout,
    FragmentPlan,
    FragmentSchedule,
    balanced_partition,
    delta_fragments,
    fragment_metadata,
    fragment_view,
    global_fragment_info,
    layer_of,
    step_fragments,
)
from speedtronic_diloco.master.round import nesterov_step
from speedtronic_diloco.node.fragments import NodeFragments


def best_max(sizes: list[int], count: int) -> int:
    """The smallest possible largest part, by brute force."""
    best = sum(sizes)
    for cuts in itertools.combinations(range(1, len(sizes)), count - 1):
        bounds = [0, *cuts, len(sizes)]
        best = min(best, max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_balanced_partition_is_optimal_contiguous_and_non_empty() -> None:
    assert balanced_partition([1, 1, 1, 1, 100], 2) == [0, 4]
    assert balanced_partition([10, 10, 10, 10], 3) == [0, 2, 3]
    assert balanced_partition([5], 1) == [0]
    assert balanced_partition([0, 0, 3], 3) == [0, 1, 2]
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        sizes = [rng.choice([0, 1, 2, 5, 40]) for _ in range(n)]
        count = rng.randint(1, n)
        starts = balanced_partition(sizes, count)
        assert len(starts) == count and starts[0] == 0
        assert all(a < b for a, b in itertools.pairwise(starts))
        bounds = [*starts, n]
        assert max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)) == best_max(sizes, count)
    with pytest.raises(FragmentError):
        balanced_partition([1, 2], 3)


def model_state() -> dict[str, torch.Tensor]:
    shapes = {
        "tok_emb.weight": (64, 16),
        "blocks.0.attn.qkv.weight": (48, 16),
        "blocks.0.attn.out.weight": (16, 16),
        "blocks.0.mlp.weight": (64, 16),
        "blocks.1.attn.qkv.weight": (48, 16),
        "blocks.1.attn.out.weight": (16, 16),
        "blocks.1.mlp.weight": (64, 16),
        "norm.weight": (16,),
        "head.weight": (64, 16),
    }
    state = {name: torch.zeros(shape) for name, shape in shapes.items()}
    state["blocks.0.steps"] = torch.zeros(1, dtype=torch.int64)  # not floating: no fragment
    return state


def test_layout_groups_layers_contiguously_and_balances_bytes() -> None:
    assert layer_of("blocks.3.attn.q.weight") == "blocks.3"
    assert layer_of("tok_emb.weight") == "tok_emb" and layer_of("scale") == "scale"
    state = model_state()
    layout = FragmentLayout.build(state, 2)
    floating = [n for n in state if state[n].is_floating_point()]
    assert [n for f in layout.fragments for n in f] == floating  # contiguous, in model order
    assert layout.fragments == (
        ("tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.out.weight",
         "blocks.0.mlp.weight"),
        ("blocks.1.attn.qkv.weight", "blocks.1.attn.out.weight", "blocks.1.mlp.weight",
         "norm.weight", "head.weight"),
    )  # fmt: skip
    assert layout.sizes == (192 * 16 * 4, (128 + 64) * 16 * 4 + 16 * 4)
    assert FragmentLayout.build(model_state(), 2) == layout
    assert FragmentLayout.build(model_state(), 2).fingerprint == layout.fingerprint
    assert FragmentLayout.build(state, 3).fingerprint != layout.fingerprint
    assert layout.index["norm.weight"] == 1 and "blocks.0.steps" not in layout.index
    assert layout.covering(["head.weight", "tok_emb.weight"]) == (0, 1)
    assert list(layout.select(state, [0])) == list(layout.fragments[0])
    assert FragmentLayout.build(state, 1).fragments == (tuple(floating),)
    # more fragments than layers: tensors become the units
    assert FragmentLayout.build(state, 6).count == 6
    with pytest.raises(FragmentError, match="only 9 floating tensors"):
        FragmentLayout.build(state, 10)


def test_layers_too_uneven_to_balance_are_cut_between_tensors() -> None:
    sizes = {"emb": 10, "blocks.0.a": 20, "blocks.0.b": 20, "blocks.1.a": 20, "blocks.1.b": 20}
    state = {name: torch.zeros(n) for name, n in {**sizes, "norm.weight": 10}.items()}
    # Whole layers: [10], [40], [40], [10] -> 40 bytes x 4; between tensors the best is 30 x 4,
    # and 40 > LAYER_SLACK (1.25) x 30: tensors win.
    layout = FragmentLayout.build(state, 4)
    assert layout.fragments == (
        ("emb", "blocks.0.a"), ("blocks.0.b",), ("blocks.1.a",), ("blocks.1.b", "norm.weight"),
    )  # fmt: skip
    assert max(layout.sizes) == 30 * 4
    # Two fragments: whole layers ([emb, blocks.0] | [blocks.1, norm], 50 x 4) are the best cut.
    assert FragmentLayout.build(state, 2).fragments == (
        ("emb", "blocks.0.a", "blocks.0.b"), ("blocks.1.a", "blocks.1.b", "norm.weight"),
    )  # fmt: skip


def test_schedule_matches_a_hand_computed_table() -> None:
    schedule = FragmentSchedule(inner_steps=10, count=4)
    assert [schedule.offset(j) for j in range(4)] == [0, 2, 5, 7]
    synced = {step: schedule.due(step) for step in range(1, 31) if schedule.due(step)}
    assert synced == {
        2: (1,), 5: (2,), 7: (3,), 10: (0,),
        12: (1,), 15: (2,), 17: (3,), 20: (0,),
        22: (1,), 25: (2,), 27: (3,), 30: (0,),
    }  # fmt: skip
    assert [schedule.next_sync(j, 10) for j in range(4)] == [20, 12, 15, 17]
    assert schedule.next_sync(0, 0) == 10 and schedule.next_sync(3, 6) == 7
    classic = FragmentSchedule(inner_steps=7)
    assert all((classic.due(s) == (0,)) == (s % 7 == 0) for s in range(1, 50))
    two = FragmentSchedule(inner_steps=5, count=2)
    assert [s for s in range(1, 16) if two.due(s)] == [2, 5, 7, 10, 12, 15]
    with pytest.raises(FragmentError, match="between 1 and inner_steps"):
        FragmentSchedule(inner_steps=3, count=4)


def test_delta_fragment_metadata_round_trips_and_is_checked() -> None:
    layout = FragmentLayout.build(model_state(), 2)
    meta = fragment_metadata([1], layout)
    assert meta == {"fragments": "1", "fragment_count": "2", "fragment_layout": layout.fingerprint}
    assert delta_fragments(meta, layout) == (1,)
    assert delta_fragments({}, layout) == (0, 1)  # a whole-model delta covers every fragment
    assert delta_fragments(fragment_metadata([0, 1], layout), layout) == (0, 1)
    assert fragment_metadata([0], FragmentLayout.build(model_state(), 1)) == {}
    bad = [
        {**meta, "fragment_count": "3"},
        {**meta, "fragment_layout": "0" * 16},
        {**meta, "fragments": "2"},
        {**meta, "fragments": "x"},
        {**meta, "fragments": ""},
    ]
    for entry in bad:
        with pytest.raises(FragmentError):
            delta_fragments(entry, layout)


@dataclass(frozen=True)
class Checked:
    norm: float
    tensor_norms: dict[str, float] = field(default_factory=dict)


def test_fragment_view_takes_the_norm_over_the_fragment() -> None:
    whole = Checked(13.0, {"a": 3.0, "b": 4.0, "c": 12.0})
    view = fragment_view(whole, ["a", "b", "zzz"])
    assert view.norm == 5.0 and view.tensor_norms == {"a": 3.0, "b": 4.0}


def test_per_fragment_outer_steps_and_momentum_match_a_hand_computation() -> None:
    # Two fragments {a} and {b}, lr 0.5, momentum 0.5. Rounds: (a: 1), (b: 2), (a: 1).
    lr, mu = 0.5, 0.5

    def step(params, grads, momentum):
        return nesterov_step(params, grads, momentum, lr, mu)

    params = {"a": torch.tensor([10.0]), "b": torch.tensor([20.0])}
    momentum: dict[str, torch.Tensor] = {}
    steps = [0, 0]
    params, momentum, steps = step_fragments(
        step, params, {0: {"a": torch.tensor([1.0])}}, momentum, steps
    )
    # a: buf = 1; update = 1 + 0.5 * 1 = 1.5; a = 10 - 0.75. b untouched, no momentum yet.
    assert params["a"].item() == 9.25 and params["b"].item() == 20.0
    assert momentum.keys() == {"a"} and momentum["a"].item() == 1.0 and steps == [1, 0]
    params, momentum, steps = step_fragments(
        step, params, {1: {"b": torch.tensor([2.0])}}, momentum, steps
    )
    # b's first step: buf = 2; update = 2 + 1 = 3; b = 20 - 1.5. a and its buffer untouched.
    assert params["b"].item() == 18.5 and params["a"].item() == 9.25
    assert momentum["a"].item() == 1.0 and momentum["b"].item() == 2.0 and steps == [1, 1]
    params, momentum, steps = step_fragments(
        step, params, {0: {"a": torch.tensor([1.0])}}, momentum, steps
    )
    # a's second step: buf = 0.5 * 1 + 1 = 1.5; update = 1 + 0.75 = 1.75; a = 9.25 - 0.875.
    assert params["a"].item() == 8.375 and momentum["a"].item() == 1.5
    assert params["b"].item() == 18.5 and momentum["b"].item() == 2.0 and steps == [2, 1]
    # Both fragments in one round: each steps once.
    params, momentum, steps = step_fragments(
        step, params, {0: {"a": torch.tensor([0.0])}, 1: {"b": torch.tensor([0.0])}}, momentum,
        steps,
    )  # fmt: skip
    assert steps == [3, 2]
    assert momentum["a"].item() == 0.75 and momentum["b"].item() == 1.0


def test_node_installs_only_fragments_that_advanced() -> None:
    layout = FragmentLayout.build(model_state(), 2)
    node = NodeFragments(FragmentPlan(layout, FragmentSchedule(10, 2)))
    fp = layout.fingerprint
    assert node.to_install(((3, 2), fp), allowed=[1]) == (0, 1)  # the first global: everything
    node.mark((0, 1), ((3, 2), fp))
    assert node.installed == [3, 2] and node.generations == [1, 1]
    assert node.to_install(((4, 2), fp)) == (0,)
    assert node.to_install(((4, 3), fp), allowed=[1]) == (1,)
    assert node.pending(((4, 3), fp)) == (0, 1)
    node.mark((1,), ((4, 3), fp))
    assert node.installed == [3, 3] and node.generations == [1, 2]
    assert node.pending(((4, 3), fp)) == (0,)
    assert node.to_install(((4, 3), "other")) == (0, 1)  # another layout: install everything
    assert node.to_install(None) == (0, 1)
    saved = node.state_dict()
    again = NodeFragments(FragmentPlan(layout, FragmentSchedule(10, 2)))
    again.load_state_dict(saved)
    assert again.installed == [3, 3]
    again.load_state_dict({**saved, "count": 3})
    assert again.installed is None


def test_global_fragment_info_parsing() -> None:
    info = {"fragments": {"count": 2, "steps": [1, 1], "versions": [3, 1], "layout": "ab"}}
    assert global_fragment_info(info) == (
        (3, 1),
        "ab",
    )
    assert global_fragment_info({}) is None
    assert global_fragment_info({"fragments": {"versions": ["x"]}}) is None
    assert global_fragment_info(None) is None
