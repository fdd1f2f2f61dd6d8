"""The CPU time-per-step estimate: the pure arithmetic, the counted work, the measured rates
(never their values: no timing is asserted), and the warning a long run prints at start."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from core.toy_runs import TINY_TRANSFORMER, tiny_transformer_run, train
from torch import nn

from speedtronic import SpeedtronicConfig, step_estimate
from speedtronic.observe.flops import count_flops_per_token, sample_batch
from speedtronic.observe.step_estimate import (
    LONG_STEP_S,
    OPTIMIZER_PASSES,
    MachineRates,
    StepEstimate,
    StepWork,
    count_step_work,
    estimate_config_step,
    measure_rates,
    seconds_per_step,
)
from speedtronic.registry import build_model_from_hook


def tiny_transformer() -> nn.Module:
    params = {k: v for k, v in TINY_TRANSFORMER.items() if k != "name"}
    return build_model_from_hook("reference_transformer", **params)


# ------------------------------------------------------------------ the arithmetic
def test_a_step_is_its_matmul_flops_at_the_rate_plus_each_other_call_and_element() -> None:
    work = StepWork(matmul_flops=6e12, other_ops=1000, other_elements=2e9)
    rates = MachineRates(matmul_flops_per_s=1e11, op_overhead_s=1e-5, elements_per_s=1e9,
                         threads=1)  # fmt: skip
    assert seconds_per_step(work, rates) == pytest.approx(60 + 0.01 + 2)
    # FLOPs alone, against the rate alone: flops / rate.
    assert seconds_per_step(StepWork(5e9), MachineRates(1e9, threads=1)) == pytest.approx(5.0)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_a_rate_that_is_not_positive_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        seconds_per_step(StepWork(1.0), MachineRates(bad, threads=1))


def estimate(seconds: float, threads: int = 1) -> StepEstimate:
    work = StepWork(matmul_flops=seconds * 1e11, other_ops=3256)
    return StepEstimate(seconds, work, MachineRates(1e11, threads=threads))


def test_a_step_over_the_threshold_is_long_and_its_warning_says_what_to_do() -> None:
    assert not estimate(LONG_STEP_S).long
    assert estimate(LONG_STEP_S * 1.01).long
    line = estimate(240.0).warning(steps=5000)
    assert line.startswith("about 4 min per step on this CPU (1 thread; 2.4e+13 matmul FLOPs at")
    assert "3,256 other operator calls" in line
    assert "5,000 steps take about 14 days" in line
    assert "this config is sized for a GPU" in line and "docs/troubleshooting.md" in line
    assert "(2 threads;" in estimate(1.0, threads=2).describe()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.01234, "0.012 s"), (1.0, "1 s"), (66.4, "66 s"), (246.0, "4.1 min"),
     (7300.0, "2 h"), (2.0e6, "23 days")],
)  # fmt: skip
def test_durations_read_as_a_person_would_say_them(seconds: float, text: str) -> None:
    assert step_estimate._duration(seconds) == text


# ------------------------------------------------------------------ the counted work
def test_the_work_is_the_counted_flops_times_the_tokens_and_scales_with_micro_batches() -> None:
    model = tiny_transformer()
    batch = sample_batch(16)
    per_token = count_flops_per_token(model, batch)
    one = count_step_work(model, batch, micro_batches=1, tokens_per_micro_batch=32)
    four = count_step_work(model, batch, micro_batches=4, tokens_per_micro_batch=32)
    assert one.matmul_flops == pytest.approx(per_token * 32)
    assert four.matmul_flops == pytest.approx(4 * one.matmul_flops)
    assert one.tokens == 32 and four.tokens == 128
    # The optimizer's passes over the parameters are in every step, once.
    parameters = sum(p.numel() for p in model.parameters())
    assert one.other_ops > OPTIMIZER_PASSES and one.other_elements > OPTIMIZER_PASSES * parameters
    model_ops = one.other_ops - OPTIMIZER_PASSES
    assert four.other_ops - OPTIMIZER_PASSES == 4 * model_ops
    # The rate is measured on the model's own weight shapes, applied to a micro-batch's rows.
    assert {rows for rows, *_ in one.matmul_shapes} == {32}
    assert (32, 32, 256) in {shape[:3] for shape in one.matmul_shapes}  # the vocabulary head


def test_the_run_s_own_flop_count_wins_and_compiling_leaves_fewer_other_operators() -> None:
    model, batch = tiny_transformer(), sample_batch(16)
    given = count_step_work(model, batch, micro_batches=2, tokens_per_micro_batch=16,
                            flops_per_token=1000.0)  # fmt: skip
    assert given.matmul_flops == 1000.0 * 32
    plain = count_step_work(model, batch, micro_batches=2, tokens_per_micro_batch=16)
    fused = count_step_work(model, batch, micro_batches=2, tokens_per_micro_batch=16,
                            compiled=True)  # fmt: skip
    assert fused.matmul_flops == plain.matmul_flops
    assert fused.other_ops < plain.other_ops and fused.other_elements < plain.other_elements


def test_the_tally_leaves_views_and_the_flop_counted_operators_out() -> None:
    tally = step_estimate._OperatorTally()
    x = torch.randn(4, 8)
    with tally:
        y = x.t().contiguous()  # a view (not counted) and a copy (counted)
        torch.mm(x, y)  # counted by the FLOPs counter, not here
    assert tally.calls == 1 and tally.elements == 32


class Uncountable(nn.Module):
    """A model whose forward the counter cannot run (a host read of a meta tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("not on this device")


def test_a_model_the_tally_cannot_follow_is_estimated_from_its_flops_alone() -> None:
    work = count_step_work(Uncountable(), sample_batch(4), micro_batches=1,
                           tokens_per_micro_batch=4, flops_per_token=50.0)  # fmt: skip
    assert work.matmul_flops == 200.0
    assert work.other_ops == OPTIMIZER_PASSES  # the optimizer's, still
    assert work.matmul_shapes == ((4, 8, 8, 1),)


# ------------------------------------------------------------------ the measured rates
def test_the_rates_are_positive_and_measured_once_per_process() -> None:
    work = count_step_work(tiny_transformer(), sample_batch(16), micro_batches=1,
                           tokens_per_micro_batch=16)  # fmt: skip
    rates = measure_rates(work)
    assert rates.threads == torch.get_num_threads()
    for value in (rates.matmul_flops_per_s, rates.op_overhead_s, rates.elements_per_s):
        assert 0 < value < math.inf
    cached = dict(step_estimate._RATES)
    assert measure_rates(work) == rates  # the cached figures, nothing measured again
    assert cached == step_estimate._RATES


# ------------------------------------------------------------------ a run and a config
def slow_rates(work: StepWork, dtype: torch.dtype = torch.float32) -> MachineRates:
    """A machine so slow that any step is long (no timing involved)."""
    return MachineRates(matmul_flops_per_s=1.0, op_overhead_s=1.0, elements_per_s=1.0, threads=1)


def test_a_long_cpu_step_is_said_before_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(step_estimate, "measure_rates", slow_rates)
    monkeypatch.setattr(step_estimate, "SLOWEST_RATE", 0.0)  # measure even a tiny step
    caplog.set_level(logging.WARNING, logger="speedtronic.step_estimate")
    config = tiny_transformer_run(tmp_path, run={"max_steps": 2}, checkpoint={"interval": 0})
    _, recorder, trainer = train(config)
    assert trainer.step_estimate is not None and trainer.step_estimate.long
    warnings = [r.getMessage() for r in caplog.records if r.name == "speedtronic.step_estimate"]
    assert len(warnings) == 1
    assert "per step on this CPU" in warnings[0] and "2 steps take about" in warnings[0]
    assert "sized for a GPU" in warnings[0]
    assert recorder.events[0][0] == "train_start"  # said before any step


def test_a_small_cpu_step_is_not_measured_or_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def must_not_measure(*args: object, **kwargs: object) -> MachineRates:
        raise AssertionError("a tiny step needs no measurement")

    monkeypatch.setattr(step_estimate, "measure_rates", must_not_measure)
    config = tiny_transformer_run(tmp_path, run={"max_steps": 1}, checkpoint={"interval": 0})
    _, _, trainer = train(config)
    assert trainer.step_estimate is None
    assert not [r for r in caplog.records if r.name == "speedtronic.step_estimate"]
    monkeypatch.undo()
    forced = step_estimate.estimate_run_step(trainer, always=True)  # what a benchmark asks
    assert forced is not None and not forced.long and forced.work.tokens == 4 * 16


def test_validate_s_line_for_a_config(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SpeedtronicConfig.from_dict(
        {"run": {"device": "cpu"}, "model": dict(TINY_TRANSFORMER), "data": {"micro_batch_size": 2}}
    )
    with torch.device("meta"):
        model = tiny_transformer()
    line = estimate_config_step(config, model)
    assert line.startswith("time per step (estimate): about ")
    assert "per step on this CPU (" in line and "over 5 s" not in line
    monkeypatch.setattr(step_estimate, "measure_rates", slow_rates)
    assert "(over 5 s: sized for a GPU; see docs/troubleshooting.md" in estimate_config_step(
        config, model
    )
    on_gpu = SpeedtronicConfig.from_dict(
        {"run": {"device": "cuda"}, "model": dict(TINY_TRANSFORMER)}
    )
    assert estimate_config_step(on_gpu, model) == (
        "time per step: not estimated on cuda (the estimate is for CPU runs)"
    )
