"""What protects the global (issue 18): every rejection rule on a hand-made round, clipping,
the robust combinations against torch references, staleness weights, one vote per node per
round, streaming aggregation, the fault-injection regressions (overflow in the compute dtype,
a bad global halts the master, roll back), and signed contributions."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import MemoryTransport, make_master, make_net

from speedtronic.cli import main as cli_main
from speedtronic.errors import SpeedtronicError
from speedtronic_diloco import aggregation
from speedtronic_diloco.aggregation import (
    AggregationRules,
    aggregate,
    inspect_delta,
    lower_median,
    screen_round,
)
from speedtronic_diloco.master.history import history_steps, roll_back
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.master.round_policy import RoundPolicy
from speedtronic_diloco.signing import SignatureError, sign_file, verify_file
from speedtronic_diloco.tensors import cpu_state_dict, load_tensors, save_tensors
from speedtronic_diloco.transports import DeltaInfo, delta_path
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

KEY = b"test-key-0123456789"


def weights() -> dict[str, torch.Tensor]:
    return cpu_state_dict(make_net().state_dict())


def floating() -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights().items() if v.is_floating_point()}


def delta_like(value: float | None = None, seed: int = 0, scale: float = 0.01) -> dict:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in floating().items():
        if value is None:
            out[name] = torch.randn(tensor.shape, generator=generator) * scale
        else:
            out[name] = torch.full(tensor.shape, float(value))
    return out


def put(
    store: MemoryTransport,
    tmp_path: Path,
    node: str,
    step: int,
    delta: dict[str, torch.Tensor],
    base: int | None = 0,
    key: bytes | None = None,
    **meta: Any,
) -> None:
    """Upload ``delta`` as node ``node``'s delta of ``step`` (as a coordinator would)."""
    fields = {"node_id": node, "local_step": step, **meta}
    if base is not None:
        fields["base_outer_step"] = base
    path = save_tensors(tmp_path / "up" / f"{node}_{step}.safetensors", delta, fields)
    if key is not None:
        sign_file(path, key)
    store.upload_delta(node, step, path)


def make_loop(
    store: MemoryTransport, tmp_path: Path, events: list | None = None, **rules: Any
) -> MasterOuterLoop:
    return make_master(store, tmp_path, events=events, rules=rules, start=weights())


def checked(tmp_path: Path, node: str, step: int, delta: dict, base: int | None = 0) -> Any:
    fields = {"node_id": node, "local_step": step}
    if base is not None:
        fields["base_outer_step"] = base
    path = save_tensors(tmp_path / "c" / f"{node}_{step}.safetensors", delta, fields)
    return inspect_delta(path, DeltaInfo(node, step, delta_path(node, step)), weights())


# --------------------------------------------------------------------------- round policy


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_round_policy_on_a_fake_clock() -> None:
    clock = FakeClock()
    policy = RoundPolicy(2, round_timeout=30.0, clock=clock)
    assert policy.decide([]).reason == "idle"
    first = policy.decide(["a"])
    assert not first.go and first.reason == "waiting" and first.need == 2 and first.have == 1
    clock.now += 29.0
    assert not policy.decide(["a", "a"]).go  # two deltas of one node are one node
    clock.now += 1.0
    timed_out = policy.decide(["a"])
    assert timed_out.go and timed_out.reason == "timeout" and timed_out.waited_s == 30.0
    policy.round_done()
    clock.now += 100.0
    quorum = policy.decide(["a", "b"])
    assert quorum.go and quorum.reason == "quorum" and quorum.waited_s == 0.0

    # Default: every node seen in the last 2 x round_timeout, or 1 before any is known.
    auto = RoundPolicy(None, round_timeout=10.0, clock=clock)
    assert auto.needed() == 1
    for node in ("a", "b", "c"):
        auto.saw(node)
    assert auto.needed() == 3
    assert not auto.decide(["a", "b"]).go
    clock.now += 10.0
    assert auto.decide(["a", "b"]).reason == "timeout"
    auto.round_done()
    auto.saw("a")
    auto.saw("b")
    clock.now += 15.0  # c was last seen 25 s ago: no longer expected
    assert auto.needed() == 2
    assert auto.decide(["a", "b"]).reason == "quorum"


def test_outer_thread_tick_waits_for_quorum_then_times_out(tmp_path: Path) -> None:
    store = MemoryTransport()
    clock = FakeClock()
    loop = make_master(store, tmp_path, rules={"min_deltas": 2, "round_timeout": 5.0}, clock=clock)
    loop.keeper.bootstrap(weights())
    put(store, tmp_path, "a", 5, delta_like(seed=1))
    assert loop.tick() is None  # one node of two: wait
    put(store, tmp_path, "b", 5, delta_like(seed=2))
    result = loop.tick()
    assert result is not None and result.reason == "quorum" and set(result.nodes) == {"a", "b"}
    assert result.base_outer_steps == (0, 0) and result.staleness == (0, 0)
    put(store, tmp_path, "a", 10, delta_like(seed=3), base=1)
    assert loop.tick() is None
    clock.now += 5.0
    late = loop.tick()
    assert late is not None and late.reason == "timeout" and late.nodes == ("a",)
    assert late.waited_s == 5.0
    assert store.metadata.extra["round"]["nodes"] == ["a"]


# --------------------------------------------------------------------------- rejection rules


@pytest.mark.parametrize(
    ("reason", "plant"),
    [
        ("keys", lambda d: {k: v for k, v in d.items() if k != "b.bias"}),
        ("shape", lambda d: {**d, "a.weight": torch.zeros(2, 2)}),
        ("dtype", lambda d: {**d, "b.bias": torch.zeros(1, dtype=torch.int64)}),
        ("non_finite", lambda d: {**d, "b.bias": torch.tensor([float("nan")])}),
        # Finite in float64, infinite in the float32 the outer step computes in.
        ("non_finite", lambda d: {k: v.double() * 0 + 1e39 for k, v in d.items()}),
        ("non_finite", lambda d: {k: v.double() * 0 + 1e300 for k, v in d.items()}),
        ("norm_outlier", lambda d: {k: v * 1e6 for k, v in d.items()}),
    ],
)
def test_each_rejection_rule(tmp_path: Path, reason: str, plant: Any) -> None:
    store = MemoryTransport()
    events: list = []
    loop = make_loop(store, tmp_path, events)
    put(store, tmp_path, "h1", 5, delta_like(seed=1))
    put(store, tmp_path, "h2", 5, delta_like(seed=2))
    put(store, tmp_path, "bad", 5, plant(delta_like(seed=3)))
    result = loop.run_round()
    assert result is not None and result.included == (("h1", 5), ("h2", 5))
    assert result.rejected == (("bad", 5),) and result.reasons == (reason,)
    (event,) = [p for e, p in events if e == "delta_rejected"]
    assert event["node"] == "bad" and event["delta_step"] == 5 and event["reason"] == reason
    assert loop.keeper.rejections[-1]["reason"] == reason  # kept in the state file too
    _, meta = load_tensors(loop.keeper.state_path)
    assert reason in meta["rejections"]
    assert all(torch.isfinite(v).all() for v in loop.global_state.values() if v.is_floating_point())


def test_size_limit_stale_and_name_mismatch(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path, max_staleness=2)
    limit = aggregation.default_max_bytes(weights())
    store.files[delta_path("big", 5)] = b"x" * (limit + 1)
    put(store, tmp_path, "h", 5, delta_like(seed=1), base=5)
    put(store, tmp_path, "liar", 5, delta_like(seed=2), node_id="h")  # claims to be h
    loop.keeper.outer_step = 5  # pretend five outer steps happened
    put(store, tmp_path, "old", 5, delta_like(seed=3), base=2)  # 3 behind, max 2
    put(store, tmp_path, "ok", 5, delta_like(seed=4), base=3)
    result = loop.run_round()
    reasons = dict(zip(result.rejected, result.reasons))
    assert reasons == {
        ("big", 5): "too_large",
        ("liar", 5): "name_mismatch",
        ("old", 5): "stale",
    }
    assert set(result.included) == {("h", 5), ("ok", 5)}
    assert set(result.staleness) == {0, 2}  # recorded per delta
    assert store.count("download_delta") == 4  # the oversized file was never downloaded


def test_a_node_rejected_again_and_again_is_logged_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryTransport()
    events: list = []
    loop = make_loop(store, tmp_path, events)
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        for step in (5, 10, 15):
            put(store, tmp_path, "h", step, delta_like(seed=step))
            put(
                store,
                tmp_path,
                "nan",
                step,
                {**delta_like(seed=1), "b.bias": torch.tensor([math.inf])},
            )
            loop.run_round()
    assert "node 'nan': its last 3 deltas were all rejected" in caplog.text
    assert [p["consecutive"] for e, p in events if e == "delta_rejected"] == [1, 2, 3]


# --------------------------------------------------------------------------- norms and combos


def test_first_rounds_use_the_rounds_lower_median_then_history(tmp_path: Path) -> None:
    assert lower_median([1.0, 1e6]) == 1.0 and lower_median([3.0, 1.0, 2.0]) == 2.0
    store = MemoryTransport()
    loop = make_loop(store, tmp_path)
    honest = delta_like(seed=1)
    put(store, tmp_path, "h", 5, honest)
    put(store, tmp_path, "bad", 5, {k: v * 1e6 for k, v in honest.items()})
    # Two deltas and no history: the lower median is the honest norm.
    assert loop.run_round().rejected == (("bad", 5),)
    for step in (10, 15):
        put(store, tmp_path, "h", step, delta_like(seed=step))
        put(store, tmp_path, "h2", step, delta_like(seed=step + 1))
        loop.run_round()
    assert len(loop.keeper.norm_history) >= 3
    # Alone in its round, the outlier is now measured against history.
    put(store, tmp_path, "bad", 20, {k: v * 50 for k, v in honest.items()})
    assert loop.run_round().reasons == ("norm_outlier",)


def test_clip_scales_exactly_to_the_threshold(tmp_path: Path) -> None:
    rules = AggregationRules(outlier_policy="clip", max_norm_ratio=4.0)
    small = [checked(tmp_path, f"h{i}", 5, delta_like(seed=i)) for i in range(3)]
    big = checked(tmp_path, "big", 5, delta_like(seed=9, scale=10.0))
    contributions, rejected, threshold = screen_round([*small, big], 0, [], rules)
    assert not rejected and len(contributions) == 4
    assert threshold == pytest.approx(4.0 * lower_median([c.norm for c in [*small, big]]))
    (clipped,) = [c for c in contributions if c.node_id == "big"]
    (factor,) = clipped.factors()
    assert big.norm * factor == pytest.approx(threshold, rel=1e-12)
    mean = aggregate(contributions, weights())
    big_tensors, _ = load_tensors(big.path)
    for name, value in mean.items():
        parts = [load_tensors(d.path)[0][name].double() for d in small]
        expected = (sum(parts) + big_tensors[name].double() * factor) / 4
        torch.testing.assert_close(value, expected)
    scaled = math.sqrt(sum(float((big_tensors[k].double() * factor).pow(2).sum()) for k in mean))
    assert scaled == pytest.approx(threshold, rel=1e-9)


@pytest.mark.parametrize("count", [4, 5])
def test_median_and_trimmed_mean_match_torch(tmp_path: Path, count: int) -> None:
    rules = AggregationRules(outlier_policy="off")
    deltas = [checked(tmp_path, f"n{i}", 5, delta_like(seed=i)) for i in range(count)]
    contributions, _, _ = screen_round(deltas, 0, [], rules)
    stacks = {
        name: torch.stack([load_tensors(d.path)[0][name].double() for d in deltas])
        for name in floating()
    }
    median = aggregate(contributions, weights(), "median")
    trimmed = aggregate(contributions, weights(), "trimmed_mean", trimmed_fraction=0.25)
    for name, stack in stacks.items():
        torch.testing.assert_close(median[name], torch.quantile(stack, 0.5, dim=0))
        cut = math.floor(count * 0.25)
        expected = torch.sort(stack, dim=0).values[cut : count - cut].mean(dim=0)
        torch.testing.assert_close(trimmed[name], expected)


def test_inverse_staleness_weights_are_renormalised(tmp_path: Path) -> None:
    rules = AggregationRules(outlier_policy="off", staleness_weighting="inverse")
    fresh = checked(tmp_path, "fresh", 5, delta_like(1.0), base=4)  # s = 0
    stale = checked(tmp_path, "stale", 5, delta_like(4.0), base=1)  # s = 3
    contributions, _, _ = screen_round([fresh, stale], 4, [], rules)
    weights_by_node = {c.node_id: c.weight for c in contributions}
    assert weights_by_node == {"fresh": 1.0, "stale": 0.25}
    mean = aggregate(contributions, weights())
    expected = (1.0 * 1.0 + 0.25 * 4.0) / 1.25
    for value in mean.values():
        torch.testing.assert_close(value, torch.full_like(value, expected))


def test_one_node_one_vote_per_round(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path)
    unit = delta_like(1.0)
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in unit.values()))
    for step in range(1, 51):  # 50 deltas of one node (a Sybil), each unremarkable
        put(store, tmp_path, "spam", step, unit)
    put(store, tmp_path, "honest", 1, delta_like(-1.0))
    start = loop.global_state
    result = loop.run_round()
    assert result.deltas_included == 51 and result.nodes == ("honest", "spam")
    # Summed (as one cumulative upload would be), then capped at a typical delta's norm: the 50
    # deltas weigh what the honest node's one delta weighs, so the opposite push cancels it and
    # never reverses it (capped at the outlier threshold instead, it would: (4 - 1) / 2).
    for name in floating():
        update = start[name] - loop.global_state[name]  # lr 0.7, no momentum
        torch.testing.assert_close(update, torch.zeros_like(update), atol=1e-6, rtol=0)
    # Without the cap (outlier_policy: off) the sum would count in full.
    uncapped = make_loop(MemoryTransport(), tmp_path / "off", outlier_policy="off")
    contributions, _, _ = screen_round(
        [checked(tmp_path, "spam", s, unit) for s in range(1, 4)], 0, [], uncapped.rules
    )
    assert contributions[0].norm == pytest.approx(3 * norm) and contributions[0].scale == 1.0


def test_a_round_where_every_node_sent_several_deltas_keeps_their_whole_progress(
    tmp_path: Path,
) -> None:
    """Issue 40: when the master's rounds lag the nodes' inner loops, every node's part is a
    sum of several deltas; none is shrunk to one delta's norm (only the one above the middle
    node's part is capped), and a node alone keeps its sum up to k typical norms."""
    rules = AggregationRules()
    deltas = [
        checked(tmp_path, node, step, delta_like(seed=10 * i + step))
        for i, node in enumerate(("a", "b", "c"))
        for step in (1, 2, 3)
    ]
    contributions, rejected, _ = screen_round(deltas, 0, [], rules)
    assert not rejected and [len(c.deltas) for c in contributions] == [3, 3, 3]
    parts = sorted(c.norm * c.scale for c in contributions)
    single = deltas[0].norm
    assert parts[0] > 1.5 * single  # a sum of 3 random deltas: about sqrt(3) x one
    assert sum(c.scale == 1.0 for c in contributions) >= 2  # at most the top one is capped
    assert parts[2] == pytest.approx(parts[1])
    # Alone, with a history of typical norms: capped at 3 typical norms, not at one.
    alone, _, _ = screen_round(deltas[:3], 0, [single] * 4, rules)
    (part,) = alone
    assert part.scale == 1.0 or part.norm * part.scale == pytest.approx(3 * single)
    assert part.norm * part.scale > 1.5 * single
    tiny = [single / 100] * 4  # history of far smaller deltas: 3 of those at most
    (capped,), _, _ = screen_round(deltas[:3], 0, tiny, AggregationRules(outlier_policy="clip"))
    assert capped.norm * capped.scale == pytest.approx(3 * single / 100)


@pytest.mark.parametrize("history", [[], [50.0, 50.0, 50.0, 50.0]])
@pytest.mark.parametrize("aggregation", ["mean", "median", "trimmed_mean"])
def test_a_sybil_never_outweighs_an_honest_node(
    tmp_path: Path, history: list[float], aggregation: str
) -> None:
    """However many deltas one node sends (each as large as the outlier rule allows), its part
    of the round is no larger than the honest node's; history that remembers larger deltas
    does not raise that cap."""
    honest = checked(tmp_path, "honest", 1, delta_like(seed=1))
    big = {k: -v * 3.9 for k, v in load_tensors(honest.path)[0].items()}  # just under 4 x
    sybil = [checked(tmp_path, "sybil", step, big) for step in range(1, 51)]
    rules = AggregationRules(aggregation=aggregation)
    contributions, rejected, _ = screen_round([honest, *sybil], 0, history, rules)
    assert not rejected
    weight = {c.node_id: c.norm * c.scale for c in contributions}
    assert weight["sybil"] <= weight["honest"] * (1 + 1e-9)
    # The combined step still points the honest node's way, or is zero: never reversed.
    combined = aggregate(contributions, weights(), aggregation)
    honest_tensors = load_tensors(honest.path)[0]
    dot = sum(float((combined[k] * honest_tensors[k].double()).sum()) for k in combined)
    assert dot >= -1e-9


def test_mean_streams_one_delta_file_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_now = peak = 0
    real = aggregation.safe_open

    class Counting:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real(*args, **kwargs)

        def __enter__(self) -> Any:
            nonlocal open_now, peak
            open_now += 1
            peak = max(peak, open_now)
            return self.inner.__enter__()

        def __exit__(self, *exc: Any) -> None:
            nonlocal open_now
            open_now -= 1
            self.inner.__exit__(*exc)

    deltas = [checked(tmp_path, f"n{i % 7}", i, delta_like(seed=i)) for i in range(30)]
    contributions, _, _ = screen_round(deltas, 0, [], AggregationRules(outlier_policy="off"))
    monkeypatch.setattr(aggregation, "safe_open", Counting)
    aggregate(contributions, weights())
    assert peak == 1


# --------------------------------------------------------------------------- bad globals


def test_float32_overflow_never_reaches_the_store_and_halts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryTransport()
    events: list = []
    loop = make_loop(store, tmp_path, events)
    put(store, tmp_path, "h", 5, delta_like(seed=1))
    loop.run_round()
    good_step, good = loop.outer_step, loop.global_state
    published = store.metadata
    # Two float32 deltas of 2e38: their float32 sum overflows; the mean does not (float64),
    # but the outer step's result does.
    put(store, tmp_path, "a", 10, delta_like(2e38), base=1)
    put(store, tmp_path, "b", 10, delta_like(2e38), base=1)
    with caplog.at_level(logging.CRITICAL, "speedtronic.diloco"):
        result = loop.run_round()
    assert result.halted and set(result.reasons) == {"bad_round"}
    assert "HALTED" in caplog.text and "rollback" in caplog.text
    assert loop.outer_step == good_step and loop.global_state is good
    assert store.metadata is published  # nothing more was published
    assert [e for e, _ in events].count("outer_halted") == 1
    # Halted: honest deltas wait, nothing is aggregated or published, across a restart too.
    put(store, tmp_path, "h", 15, delta_like(seed=2), base=1)
    assert loop.run_round() is None and loop.tick() is None
    again = make_loop(store, tmp_path)
    assert again.halted and again.run_round() is None
    # Roll back (the master is stopped) to the kept good step: a new outer step, unhalted.
    assert good_step in history_steps(loop.keeper.state_dir)
    new_step = roll_back(loop.keeper.state_dir, good_step)
    assert new_step == good_step + 1
    resumed = make_loop(store, tmp_path)
    assert not resumed.halted and resumed.outer_step == new_step
    for name, value in good.items():
        torch.testing.assert_close(resumed.global_state[name], value)
    assert resumed.publish_if_behind() and store.metadata.outer_step == new_step
    result = resumed.run_round()
    assert result.included == (("h", 15),)  # the honest delta that waited
    assert not ({("a", 10), ("b", 10)} & set(result.included))


def test_update_ratio_bounds_the_change_of_the_global(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path, max_update_ratio=0.5)
    put(store, tmp_path, "h", 5, delta_like(10.0))  # finite, but moves the global a lot
    assert loop.run_round().halted
    assert "max_update_ratio" in loop.halted


def test_rollback_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path)
    for step in (5, 10, 15):
        put(store, tmp_path, "h", step, delta_like(seed=step), base=loop.outer_step)
        loop.run_round()
    state = str(loop.keeper.state_dir)
    assert cli_main(["diloco", "rollback", "--state-dir", state, "--list"]) == 0
    assert "kept for rollback: 0, 1, 2, 3" in capsys.readouterr().out
    assert cli_main(["diloco", "rollback", "--state-dir", state, "--to", "1"]) == 0
    assert "outer step 4 is the global of outer step 1" in capsys.readouterr().out
    assert cli_main(["diloco", "rollback", "--state-dir", state, "--to", "99"]) != 0
    assert "not kept" in capsys.readouterr().err


# --------------------------------------------------------------------------- signatures


def test_sign_and_verify(tmp_path: Path) -> None:
    path = save_tensors(tmp_path / "d.safetensors", delta_like(seed=1), {"node_id": "a"})
    with pytest.raises(SignatureError) as unsigned:
        verify_file(path, KEY)
    assert unsigned.value.reason == "unsigned"
    sign_file(path, KEY)
    assert verify_file(path, KEY)["node_id"] == "a"
    tensors, meta = load_tensors(path)  # still a plain safetensors file
    assert meta["node_id"] == "a" and set(tensors) == set(floating())
    with pytest.raises(SignatureError) as other_key:
        verify_file(path, b"another key")
    assert other_key.value.reason == "bad_signature"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of one tensor
    path.write_bytes(bytes(data))
    with pytest.raises(SignatureError) as tampered:
        verify_file(path, KEY)
    assert tampered.value.reason == "bad_signature"


def test_master_rejects_unsigned_wrongly_signed_tampered_and_replayed(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path, signing_key=KEY)
    put(store, tmp_path, "good", 5, delta_like(seed=1), key=KEY)
    put(store, tmp_path, "unsigned", 5, delta_like(seed=2))
    put(store, tmp_path, "wrong", 5, delta_like(seed=3), key=b"not the key")
    put(store, tmp_path, "tampered", 5, delta_like(seed=4), key=KEY)
    data = bytearray(store.files[delta_path("tampered", 5)])
    data[-1] ^= 1
    store.files[delta_path("tampered", 5)] = bytes(data)
    put(store, tmp_path, "renamed", 5, delta_like(seed=5), key=KEY, node_id="good")
    result = loop.run_round()
    assert result.included == (("good", 5),)
    assert dict(zip(result.rejected, result.reasons)) == {
        ("unsigned", 5): "unsigned",
        ("wrong", 5): "bad_signature",
        ("tampered", 5): "bad_signature",
        ("renamed", 5): "name_mismatch",  # signed as good@5: cannot pass for another node
    }
    # Globals are signed for their outer step.
    weights_file = tmp_path / "global.safetensors"
    weights_file.write_bytes(store.files["global/latest.safetensors"])
    assert verify_file(weights_file, KEY)["outer_step"] == str(loop.outer_step)


def test_a_replayed_signed_delta_is_not_aggregated_again(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    loop = make_loop(store, tmp_path, signing_key=KEY)  # type: ignore[arg-type]
    put(store, tmp_path, "good", 5, delta_like(seed=1), key=KEY)  # type: ignore[arg-type]
    assert loop.run_round().included == (("good", 5),)
    stored = tmp_path / "store" / delta_path("good", 5)
    copy = stored.read_bytes()
    time.sleep(0.01)
    stored.write_bytes(copy)  # the same signed bytes again: a new mtime, a new etag
    os.utime(stored, ns=(time.time_ns(), time.time_ns() + 10**9))
    result = loop.run_round()
    assert result is None or (not result.included and result.reasons == ("replayed",))
    assert loop.outer_step == 1


def test_load_state_dict_refuses_another_nodes_state(tmp_path: Path) -> None:
    from diloco_fakes import dist_config

    from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator

    store = MemoryTransport()
    worker = DumbDiLoCoCoordinator(dist_config(node_id="w1"), make_net(), hub=store)
    state = worker.state_dict()
    master = DumbDiLoCoCoordinator(dist_config(node_id="w1", role="master"), make_net(), hub=store)
    with pytest.raises(SpeedtronicError, match=r"belongs to worker 'w1'.*this process is master"):
        master.load_state_dict(state)
    other = DumbDiLoCoCoordinator(dist_config(node_id="w2"), make_net(), hub=store)
    with pytest.raises(SpeedtronicError, match=r"same distributed\.role and distributed\.node_id"):
        other.load_state_dict(state)
