"""Trainer behaviour: model/batch contracts, accumulation, GradScaler skips, compile fallback,
gradient checkpointing, hooks, host syncs, data exhaustion and the bounded result."""

from __future__ import annotations

import copy
import json
import logging
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from core import toy_runs
from core.toy_runs import SEQ, VOCAB, ClosingSink, merge_sections, toy_trainer
from torch import nn

from speedtronic import DataError, SpeedtronicConfig, SpeedtronicError, hookimpl, plugins
from speedtronic.engine.trainer import Trainer


class Bigram(toy_runs.Bigram):
    """The shared bigram, noting the train mode of each call and returning its loss in the
    form ``output`` names."""

    def __init__(self, output: str = "dict") -> None:
        super().__init__()
        self.output = output
        self.training_flags: list[bool] = []

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.training_flags.append(self.training)
        return super().loss(input_ids, labels)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        loss = self.loss(input_ids, labels)
        if self.output == "tensor":
            return loss
        if self.output == "tuple":
            return loss, None
        return {"loss": loss, "logits": None}


def make_config(tmp_path: Any, **sections: Any) -> SpeedtronicConfig:
    """A small CPU fp32 run; ``sections`` are merged into the defaults per section."""
    data: dict[str, Any] = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": str(tmp_path / "run")},
        "data": {"micro_batch_size": 4},
        "optimizer": {"lr": 0.05},
        "scheduler": {"name": "constant"},
        "precision": {"mode": "fp32"},
        "checkpoint": {"interval": 0, "save_final": False},
        "logging": {"log_every": 1},
    }
    return SpeedtronicConfig.from_dict(merge_sections(data, sections))


def make_trainer(
    model: nn.Module, config: SpeedtronicConfig, events: list | None = None, **kwargs: Any
) -> Trainer:
    """:func:`toy_trainer` whose only sink appends ``(event, payload)`` to ``events``."""
    hooks = []
    if events is not None:
        hooks.append(lambda event, payload: events.append((event, dict(payload))))
    return toy_trainer(model, config, hooks, **kwargs)


def step_losses(events: list) -> list[float]:
    return [payload["loss"] for event, payload in events if event == "step"]


# ------------------------------------------------------------------ model and batch contracts
@pytest.mark.parametrize("output", ["tensor", "dict", "tuple"])
def test_any_loss_output_form_trains_and_model_is_put_in_train_mode(tmp_path, output):
    torch.manual_seed(0)
    model = Bigram(output)
    model.eval()
    events: list = []
    result = make_trainer(model, make_config(tmp_path), events).fit()
    assert result.steps == 4
    assert model.training_flags and all(model.training_flags)
    losses = step_losses(events)
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_tuple_batches_are_passed_as_inputs_and_labels(tmp_path):
    seen: list[tuple[torch.Size, torch.Size]] = []

    class Positional(Bigram):
        def forward(self, inputs, labels):  # positional names differ from the dict keys
            if self is model:  # not the FLOP count's shadow copy at train start
                seen.append((inputs.shape, labels.shape))
            return self.loss(inputs, labels)

    inputs = torch.randint(0, VOCAB, (2, SEQ))
    batches = [(inputs, (inputs + 1) % VOCAB)] * 3
    model = Positional()
    result = make_trainer(model, make_config(tmp_path), data=batches).fit()
    assert result.steps == 4  # a list is re-iterated once it runs out
    assert seen == [(torch.Size([2, SEQ]), torch.Size([2, SEQ]))] * 4


def test_tensor_batches_are_passed_as_the_only_argument(tmp_path):
    class Autoencoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x):
            return F.mse_loss(self.linear(x), x)

    torch.manual_seed(0)
    result = make_trainer(
        Autoencoder(), make_config(tmp_path), data=[torch.randn(5, 3) for _ in range(4)]
    ).fit()
    assert result.steps == 4
    assert result.samples == 20  # batch size from the tensor's first dimension


def test_bad_model_outputs_raise_clear_errors(tmp_path):
    class NoLoss(Bigram):
        def forward(self, input_ids, labels):
            return {"logits": self.table(input_ids)}

    class VectorLoss(Bigram):
        def forward(self, input_ids, labels):
            return F.cross_entropy(
                self.table(input_ids).view(-1, VOCAB), labels.reshape(-1), reduction="none"
            )

    with pytest.raises(SpeedtronicError, match="without a 'loss' key"):
        make_trainer(NoLoss(), make_config(tmp_path)).fit()
    with pytest.raises(SpeedtronicError, match="must be a scalar"):
        make_trainer(VectorLoss(), make_config(tmp_path)).fit()


# ------------------------------------------------------------------ gradient accumulation
def test_accumulation_matches_one_big_batch(tmp_path):
    """micro 2 x 4 accumulation == micro 8 x 1 on the same data: same loss curve, same weights.

    Plain SGD without clipping, because its update is proportional to the gradient: AdamW
    would hide a wrongly scaled accumulated gradient.
    """
    runs = {}
    torch.manual_seed(0)
    initial = Bigram().state_dict()
    for micro in (2, 8):
        model = Bigram()
        model.load_state_dict(copy.deepcopy(initial))
        events: list = []
        config = make_config(
            tmp_path,
            run={"max_steps": 5},
            optimizer={"grad_clip": None},
            data={"micro_batch_size": micro, "target_batch_size": 8},
        )
        trainer = make_trainer(
            model, config, events, optimizer=torch.optim.SGD(model.parameters(), lr=5.0)
        )
        result = trainer.fit()
        runs[micro] = (trainer.accumulation_steps, step_losses(events), model, result)
    assert runs[2][0] == 4 and runs[8][0] == 1
    assert runs[2][1] == pytest.approx(runs[8][1], rel=1e-5)
    assert runs[2][3].samples == runs[8][3].samples == 40
    assert torch.allclose(runs[2][2].table.weight, runs[8][2].table.weight, atol=1e-6)


# ------------------------------------------------------------------ GradScaler overflow
class Overflowing(Bigram):
    """Returns an infinite loss on the chosen forward calls (1-based)."""

    def __init__(self, bad_calls: set[int]) -> None:
        super().__init__("tensor")
        self.bad_calls = bad_calls
        self.calls = 0

    def forward(self, input_ids, labels):
        self.calls += 1
        loss = self.loss(input_ids, labels)
        return loss * float("inf") if self.calls in self.bad_calls else loss


class StepRecorder:
    def __init__(self, returns: dict[int, bool] | None = None) -> None:
        self.returns = returns or {}
        self.steps: list[int] = []
        self.adam_steps: list[int] = []
        self.events: list[str] = []
        self.started = 0
        self.ended: list[Any] = []

    @hookimpl
    def on_train_start(self, trainer):
        self.started += 1

    @hookimpl
    def after_optimizer_step(self, trainer, model, step):
        self.steps.append(step)
        state = trainer.optimizer.state.get(model.table.weight, {})
        self.adam_steps.append(int(state["step"]) if "step" in state else 0)
        return self.returns.get(step)

    @hookimpl
    def on_metric(self, event, payload):
        self.events.append(event)

    @hookimpl
    def on_train_end(self, trainer, error):
        self.ended.append(error)


@pytest.fixture
def recorder():
    made: list[str] = []

    def register(returns: dict[int, bool] | None = None) -> StepRecorder:
        plugin = StepRecorder(returns)
        made.append(plugins.register(plugin, name=f"test-trainer-recorder-{len(made)}"))
        return plugin

    yield register
    for name in made:
        plugins.unregister(name)


def test_gradscaler_overflow_skips_without_advancing(tmp_path, recorder):
    plugin = recorder()
    model = Overflowing(bad_calls={2})
    events: list = []
    config = make_config(tmp_path, scheduler={"name": "cosine", "warmup_steps": 2})
    trainer = make_trainer(model, config, events)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = model.table.weight.detach().clone()
    result = trainer.fit()

    skipped = [payload for event, payload in events if event == "optimizer_step_skipped"]
    assert len(skipped) == 1 and skipped[0]["step"] == 1
    assert skipped[0]["scale"] == 512.0  # backed off once
    assert model.calls == 5  # four real steps plus the skipped attempt
    assert result.steps == trainer.step == 4
    assert plugin.steps == [1, 2, 3, 4]  # no plugin boundary for the skipped attempt
    assert plugin.adam_steps == [1, 2, 3, 4]  # no optimizer update either
    assert trainer.scheduler.last_epoch == 4
    assert result.samples == 5 * 4  # consumed samples still count (data position)
    lrs = [payload["lr"] for event, payload in events if event == "step"]
    assert lrs[0] == pytest.approx(0.05)  # warmup ended after step 1, skip did not advance it
    assert not torch.equal(model.table.weight, before)
    assert all(torch.isfinite(model.table.weight).flatten())


def test_endless_overflow_stops_with_an_error(tmp_path):
    model = Overflowing(bad_calls=set(range(1, 1000)))
    trainer = make_trainer(model, make_config(tmp_path))
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.raises(SpeedtronicError, match="in a row were skipped"):
        trainer.fit()
    assert trainer.step == 0


# ------------------------------------------------------------------ hooks
def test_hooks_fire_and_a_true_result_resets_optimizer_state(tmp_path, recorder):
    plugin = recorder(returns={2: True})
    events: list = []
    trainer = make_trainer(Bigram(), make_config(tmp_path), events)
    result = trainer.fit()
    assert plugin.started == 1 and plugin.ended == [None]
    assert plugin.steps == [1, 2, 3, 4]
    # Adam's step count restarts after the reset that followed step 2.
    assert plugin.adam_steps == [1, 2, 1, 2]
    assert result.summary["weights_replaced"] == 1
    # on_metric sees exactly what the metric sinks see.
    assert plugin.events == [event for event, _ in events]
    assert plugin.events[0] == "train_start" and plugin.events[-1] == "train_end"
    assert plugin.events.count("step") == 4


def test_plugin_can_keep_optimizer_state_on_weight_replace(tmp_path, recorder):
    plugin = recorder(returns={2: True})
    trainer = make_trainer(Bigram(), make_config(tmp_path))
    trainer.reset_optimizer_on_weight_replace = False
    trainer.fit()
    assert plugin.adam_steps == [1, 2, 3, 4]


def test_train_end_hook_and_sinks_see_the_error(tmp_path, recorder):
    plugin = recorder()

    class Failing(Bigram):
        def forward(self, input_ids, labels):
            if len(self.training_flags) == 2:
                raise ValueError("broken batch")
            return self.loss(input_ids, labels)

    sink = ClosingSink()
    trainer = toy_trainer(Failing(), make_config(tmp_path), [sink])
    with pytest.raises(ValueError, match="broken batch"):
        trainer.fit()
    assert len(plugin.ended) == 1 and isinstance(plugin.ended[0], ValueError)
    assert sink.closes == 1


# ------------------------------------------------------------------ compile
class GraphBreaking(Bigram):
    """Fine in eager mode; torch.compile(fullgraph=True) refuses the explicit graph break."""

    def forward(self, input_ids, labels):
        torch._dynamo.graph_break()
        return self.loss(input_ids, labels)


COMPILE = {"enabled": True, "backend": "eager", "fullgraph": True}


def test_compile_failure_falls_back_to_eager_with_one_warning(tmp_path, caplog):
    torch.manual_seed(0)
    initial = Bigram().state_dict()
    eager, compiled = GraphBreaking(), GraphBreaking()
    eager.load_state_dict(copy.deepcopy(initial))
    compiled.load_state_dict(copy.deepcopy(initial))
    eager_events: list = []
    compiled_events: list = []
    make_trainer(eager, make_config(tmp_path), eager_events).fit()
    trainer = make_trainer(compiled, make_config(tmp_path, compile=COMPILE), compiled_events)
    assert trainer.compiled.active
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        result = trainer.fit()
    warnings = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warnings) == 1 and "Unsupported" in warnings[0].getMessage()
    assert not trainer.compiled.active
    assert result.steps == 4
    assert step_losses(compiled_events) == pytest.approx(step_losses(eager_events))
    assert torch.allclose(compiled.table.weight, eager.table.weight)


def test_compile_keeps_a_genuine_model_error(tmp_path, caplog):
    class Wrong(Bigram):
        def forward(self, input_ids, labels):
            return self.loss(input_ids[:, :-1], labels)  # shapes disagree, eager fails too

    trainer = make_trainer(
        Wrong(), make_config(tmp_path, compile={"enabled": True, "backend": "eager"})
    )
    with caplog.at_level(logging.WARNING, logger="speedtronic"), pytest.raises(ValueError) as info:
        trainer.fit()
    assert "batch_size" in str(info.value) or "size" in str(info.value)
    assert "torch._dynamo" not in type(info.value).__module__
    assert not any("continuing eagerly" in r.getMessage() for r in caplog.records)


def test_compile_success_stays_compiled(tmp_path):
    trainer = make_trainer(
        Bigram(),
        make_config(tmp_path, run={"max_steps": 2}, compile={"enabled": True, "backend": "eager"}),
    )
    trainer.fit()
    assert trainer.compiled.active
    assert type(trainer.compiled.compiled).__name__ == "OptimizedModule"


def test_compile_unavailable_trains_eagerly(tmp_path, monkeypatch, caplog):
    def unavailable(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", unavailable)
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        trainer = make_trainer(Bigram(), make_config(tmp_path, compile={"enabled": True}))
    assert not trainer.compiled.active
    assert any("no compiler here" in r.getMessage() for r in caplog.records)
    assert trainer.fit().steps == 4


# ------------------------------------------------------------------ gradient checkpointing
def test_gradient_checkpointing_is_switched_on_or_warned_about(tmp_path, caplog):
    class Checkpointable(Bigram):
        def __init__(self) -> None:
            super().__init__()
            self.requests: list[bool] = []

        def set_gradient_checkpointing(self, enabled: bool) -> None:
            self.requests.append(enabled)

    model = Checkpointable()
    make_trainer(model, make_config(tmp_path, gradient_checkpointing=True))
    assert model.requests == [True]
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        make_trainer(Bigram(), make_config(tmp_path, gradient_checkpointing=True))
    assert any("set_gradient_checkpointing" in r.getMessage() for r in caplog.records)
    model = Checkpointable()
    make_trainer(model, make_config(tmp_path))
    assert model.requests == []


# ------------------------------------------------------------------ host syncs
def test_no_host_sync_per_micro_batch(tmp_path, monkeypatch):
    """The loop reads the loss (and grad norm) once per log interval, never per micro-batch."""
    reads: list[str] = []
    package = "speedtronic" + ("\\" if sys.platform == "win32" else "/")

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if package in caller and "speedtronic_" not in caller:
                reads.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "__float__", "__bool__", "__int__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    config = make_config(
        tmp_path,
        # max_nan_steps large here: its count is read every max_nan_steps // 2 steps (below).
        run={"max_steps": 8, "max_nan_steps": 1000},
        logging={"log_every": 4},
        data={"micro_batch_size": 2, "target_batch_size": 8},
    )
    trainer = make_trainer(Bigram(), config)
    trainer.fit()
    # 8 steps x 4 micro-batches, two log events: one loss read and one grad-norm read each.
    assert sorted(reads) == ["item"] * 4
    reads.clear()
    config = make_config(
        tmp_path / "nan",
        run={"max_steps": 8, "max_nan_steps": 8},
        logging={"log_every": 4},
        data={"micro_batch_size": 2, "target_batch_size": 8},
    )
    make_trainer(Bigram(), config).fit()
    # ... plus one read of the non-finite-step count every 8 // 2 = 4 steps.
    assert sorted(reads) == ["item"] * 6


# ------------------------------------------------------------------ data and result
def test_one_shot_iterator_running_out_is_a_data_error(tmp_path):
    batches = (
        {
            "input_ids": torch.zeros(2, SEQ, dtype=torch.long),
            "labels": torch.zeros(2, SEQ, dtype=torch.long),
        }
        for _ in range(3)
    )
    with pytest.raises(DataError, match="ran out at step 3"):
        make_trainer(Bigram(), make_config(tmp_path, run={"max_steps": 5}), data=batches).fit()


def test_result_summary_stays_bounded(tmp_path):
    short = make_trainer(Bigram(), make_config(tmp_path, run={"max_steps": 2})).fit()
    long = make_trainer(Bigram(), make_config(tmp_path, run={"max_steps": 40})).fit()
    assert long.steps == 40 and long.final_loss is not None
    assert long.samples == 160 and long.tokens == 160 * SEQ
    assert set(short.summary) == set(long.summary)
    assert all(not isinstance(v, (list, dict, tuple)) for v in long.summary.values())
    assert abs(len(json.dumps(long.summary)) - len(json.dumps(short.summary))) < 20
