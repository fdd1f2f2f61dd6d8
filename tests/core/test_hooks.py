"""Every hook is documented and exercised through a real plugin registered with the plugin
manager; the trainer's hooks are driven by tiny real training runs."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from core.toy_runs import Bigram, merge_sections
from torch import nn

import speedtronic
from speedtronic import cli, hookimpl, hookspecs, plugins
from speedtronic.config import SpeedtronicConfig
from speedtronic.config import sections as config_sections
from speedtronic.data import build_dataloader
from speedtronic.engine.runtime import build_runtime, train_from_config
from speedtronic.errors import ConfigError
from speedtronic.registry import register_model, unregister_model
from speedtronic.schema import Section, option

DOCS = Path(__file__).parents[2] / "docs"
TINY = "core_hooks_tiny"


@dataclass
class RecorderConfig(Section):
    """The in-test plugin's own config section."""

    label: str = option("unset", help="Echoed back by the plugin.")


def tiny_config(output_dir: Path, **sections: Any) -> SpeedtronicConfig:
    data: dict[str, Any] = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": str(output_dir), "seed": 7},
        "model": {"name": TINY},
        "data": {"micro_batch_size": 2},
        "precision": {"mode": "fp32"},
        "optimizer": {"lr": 1e-2},
        "checkpoint": {"interval": 2, "keep_last": 5},
        "logging": {"log_every": 1, "progress": False},
    }
    return SpeedtronicConfig.from_dict(merge_sections(data, sections))


Register = Callable[[Any, str], str]


@pytest.fixture(scope="module")
def tiny_model() -> Iterator[str]:
    """The shared bigram model, registered in-process with ``register_model``."""
    register_model(TINY, Bigram)
    yield TINY
    unregister_model(TINY)


@pytest.fixture
def register(tiny_model: str) -> Iterator[Register]:
    """Register in-test plugins with the real plugin manager; removed after the test."""
    names: list[str] = []

    def register_for_test(plugin: Any, name: str) -> str:
        names.append(plugins.register(plugin, name=name))
        return names[-1]

    yield register_for_test
    for name in names:
        plugins.unregister(name)


# ---------------------------------------------------------------- every hook


HOOKS = plugins.hook_names()


def test_the_hook_list_is_complete() -> None:
    specs = [name for name, fn in vars(hookspecs).items() if hasattr(fn, "speedtronic_spec")]
    assert specs == HOOKS and len(HOOKS) == 14


@pytest.mark.parametrize("name", HOOKS)
def test_every_hook_is_documented_and_exercised(name: str) -> None:
    spec = getattr(hookspecs, name)
    doc = inspect.getdoc(spec) or ""
    assert len(doc) > 80, f"hookspec {name} needs a docstring that explains it"
    assert callable(globals().get(f"test_hook_{name}")), f"no test_hook_{name} in this module"
    assert f"\n## {name}\n" in (DOCS / "hooks.md").read_text(), f"{name} missing from docs"


# ---------------------------------------------------------------- a recorded run and a resume


class Recorder:
    """Implements every trainer hook and writes down what it saw."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.loaded: Any = "never called"
        self.error: Any = "never called"
        self.label = ""

    @hookimpl
    def config_sections(self) -> dict[str, type]:
        return {"recorder": RecorderConfig}

    @hookimpl
    def on_train_start(self, trainer: Any) -> None:
        self.calls.append(("on_train_start", trainer.step))
        self.label = trainer.config.recorder.label

    @hookimpl
    def after_optimizer_step(self, trainer: Any, model: Any, step: int) -> None:
        assert model is trainer.model and step == trainer.step
        self.calls.append(("after_optimizer_step", step))

    @hookimpl
    def on_checkpoint(self, trainer: Any, state: dict[str, Any]) -> None:
        self.calls.append(("on_checkpoint", trainer.step))
        state["core_test"] = {
            "step": trainer.step,
            "weights": torch.arange(3.0) * trainer.step,
            "label": f"at {trainer.step}",
            "nested": {"history": [1, 2, trainer.step], "flag": True, "none": None},
        }

    @hookimpl
    def on_load_checkpoint(self, trainer: Any, state: dict[str, Any]) -> None:
        self.calls.append(("on_load_checkpoint", trainer.step))
        self.loaded = state.get("core_test")

    @hookimpl
    def on_metric(self, event: str, payload: dict[str, Any]) -> None:
        self.events.append((event, dict(payload)))

    @hookimpl
    def on_train_end(self, trainer: Any, error: BaseException | None) -> None:
        self.calls.append(("on_train_end", trainer.step))
        self.error = error


@dataclass
class RecordedRuns:
    first: Recorder
    resumed: Recorder
    first_steps: int
    resumed_steps: int
    resumed_from: int | None


@pytest.fixture(scope="module")
def runs(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> RecordedRuns:
    """Four steps with checkpoints at 2 and 4, then a resume to step 6."""
    output = tmp_path_factory.mktemp("hooks-run")
    first = Recorder()
    name = plugins.register(first, name="core-test-recorder")
    try:
        result = train_from_config(tiny_config(output, recorder={"label": "hi"}), console=False)
    finally:
        plugins.unregister(name)
    resumed = Recorder()
    name = plugins.register(resumed, name="core-test-recorder")
    try:
        config = tiny_config(output, run={"max_steps": 6}, checkpoint={"resume": True})
        again = train_from_config(config, console=False)
    finally:
        plugins.unregister(name)
    return RecordedRuns(first, resumed, result.steps, again.steps, again.resumed_from)


def test_the_config_a_hook_sees_is_the_whole_config() -> None:
    """``ConfigLike`` (the hook contract's type of ``trainer.config``) names every field of
    ``SpeedtronicConfig`` with the same type, in the same order: a section added to the config
    and not to the contract (or the other way round) fails here."""
    # The contract imports the section types for annotations only: resolve them here.
    contract = typing.get_type_hints(
        speedtronic.ConfigLike, {"sections": config_sections, "Any": typing.Any}
    )
    fields = typing.get_type_hints(SpeedtronicConfig)
    assert list(contract) == [field.name for field in dataclasses.fields(SpeedtronicConfig)]
    assert contract == {name: fields[name] for name in contract}
    assert speedtronic.TrainerLike.__annotations__["config"] == "ConfigLike"


def test_hook_on_train_start(runs: RecordedRuns) -> None:
    assert runs.first.calls[0] == ("on_train_start", 0)
    assert runs.first.calls.count(("on_train_start", 0)) == 1
    # The plugin's own config section reached it through trainer.config.
    assert runs.first.label == "hi" and runs.resumed.label == "unset"


def test_hook_after_optimizer_step(runs: RecordedRuns) -> None:
    steps = [step for hook, step in runs.first.calls if hook == "after_optimizer_step"]
    assert steps == [1, 2, 3, 4] and runs.first_steps == 4
    resumed = [step for hook, step in runs.resumed.calls if hook == "after_optimizer_step"]
    assert resumed == [5, 6]


def test_hook_on_checkpoint(runs: RecordedRuns) -> None:
    checkpoints = [call for call in runs.first.calls if call[0] == "on_checkpoint"]
    assert checkpoints == [("on_checkpoint", 2), ("on_checkpoint", 4)]
    # Called while the checkpoint is assembled: after the step it belongs to.
    calls = runs.first.calls
    assert calls.index(("on_checkpoint", 2)) == calls.index(("after_optimizer_step", 2)) + 1


def test_hook_on_load_checkpoint(runs: RecordedRuns) -> None:
    assert runs.resumed_from == 4 and runs.resumed_steps == 6
    # Before on_train_start, with exactly what on_checkpoint stored at step 4.
    assert runs.resumed.calls[:2] == [("on_load_checkpoint", 4), ("on_train_start", 4)]
    loaded = runs.resumed.loaded
    assert loaded["step"] == 4 and loaded["label"] == "at 4"
    assert torch.equal(loaded["weights"], torch.tensor([0.0, 4.0, 8.0]))
    assert loaded["nested"] == {"history": [1, 2, 4], "flag": True, "none": None}
    assert runs.first.loaded == "never called"  # a fresh run restores nothing


def test_hook_on_train_end(runs: RecordedRuns) -> None:
    assert runs.first.calls[-1] == ("on_train_end", 4) and runs.first.error is None
    assert runs.resumed.calls[-1] == ("on_train_end", 6)


def test_hook_on_train_end_receives_the_error(register: Register, tmp_path: Path) -> None:
    class FailsAtStepTwo:
        error: Any = "never called"

        @hookimpl
        def after_optimizer_step(self, step: int) -> None:
            if step == 2:
                raise RuntimeError("plugin failure at step 2")

        @hookimpl
        def on_train_end(self, error: BaseException | None) -> None:
            self.error = error

    plugin = FailsAtStepTwo()
    register(plugin, "core-test-fails")
    with pytest.raises(RuntimeError, match="plugin failure at step 2") as caught:
        train_from_config(tiny_config(tmp_path), console=False)
    assert plugin.error is caught.value


def test_hook_on_train_end_of_every_plugin_runs_even_when_one_raises(
    register: Register, tmp_path: Path
) -> None:
    released: list[str] = []

    class Raises:
        @hookimpl
        def on_train_end(self) -> None:
            raise RuntimeError("cleanup failed")

    class Releases:
        @hookimpl
        def on_train_end(self, error: BaseException | None) -> None:
            released.append("released" if error is None else "released after error")

    register(Releases(), "core-test-releases")
    register(Raises(), "core-test-raises")  # newer: called first
    result = train_from_config(tiny_config(tmp_path), console=False)
    assert result.steps == 4 and released == ["released"]


def test_hook_on_metric(runs: RecordedRuns) -> None:
    events = runs.first.events
    names = [event for event, _ in events]
    assert names[0] == "train_start" and names[-1] == "train_end"
    assert [p["step"] for e, p in events if e == "step"] == [1, 2, 3, 4]
    assert [p["step"] for e, p in events if e == "checkpoint"] == [2, 4]
    step = next(p for e, p in events if e == "step")
    assert {"loss", "lr", "samples_per_sec", "tokens_per_sec"} <= set(step)
    for _, payload in events:
        json.dumps(payload)  # JSON-compatible, as the hook promises
    assert events[-1][1]["status"] == "ok" and events[-1][1]["steps"] == 4


def test_hook_on_metric_failure_never_stops_training(
    register: Register, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class BrokenSink:
        calls = 0

        @hookimpl
        def on_metric(self, event: str) -> None:
            self.calls += 1
            raise OSError("disk full")

    sink = BrokenSink()
    register(sink, "core-test-broken-sink")
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        result = train_from_config(tiny_config(tmp_path), console=False)
    assert result.steps == 4 and sink.calls > 4
    warnings = [r.getMessage() for r in caplog.records if "core-test-broken-sink" in r.getMessage()]
    assert len(warnings) == 1 and "disk full" in warnings[0]


# ---------------------------------------------------------------- weights replaced


class Replacer:
    """Zeroes the weights after step 2 and says so; records the optimizer's step counter."""

    def __init__(self, keep_optimizer_state: bool = False) -> None:
        self.keep = keep_optimizer_state
        self.adam_steps: list[int] = []

    @hookimpl
    def on_train_start(self, trainer: Any) -> None:
        if self.keep:
            trainer.reset_optimizer_on_weight_replace = False

    @hookimpl
    def after_optimizer_step(self, trainer: Any, model: nn.Module, step: int) -> bool | None:
        states = trainer.optimizer.state.values()
        self.adam_steps.append(max(int(state["step"]) for state in states))
        if step != 2:
            return None
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
        return True


@pytest.mark.parametrize(("keep", "expected"), [(False, [1, 2, 1, 2]), (True, [1, 2, 3, 4])])
def test_hook_after_optimizer_step_true_resets_the_optimizer(
    register: Register, tmp_path: Path, keep: bool, expected: list[int]
) -> None:
    replacer = Replacer(keep_optimizer_state=keep)
    register(replacer, "core-test-replacer")
    result = train_from_config(tiny_config(tmp_path), console=False)
    assert replacer.adam_steps == expected
    assert result.summary["weights_replaced"] == 1


# ---------------------------------------------------------------- hooks outside the loop


def test_hook_build_model(register: Register) -> None:
    class Builds:
        asked: list[str] = []

        @hookimpl
        def build_model(self, name: str, params: dict[str, Any]) -> Any:
            self.asked.append(name)
            return nn.Linear(params["width"], 1) if name == "core_hooks_linear" else None

    class AlsoBuilds:
        @hookimpl
        def build_model(self, name: str) -> Any:  # a subset of the arguments
            return nn.Identity() if name == "core_hooks_linear" else None

    first = Builds()
    register(first, "core-test-builds")
    model = speedtronic.build_model("core_hooks_linear", width=3)
    assert isinstance(model, nn.Linear) and model.in_features == 3
    # Names the plugin does not know fall through to the next plugin (the registry here).
    assert isinstance(speedtronic.build_model(TINY), Bigram)
    assert first.asked == ["core_hooks_linear", TINY]
    # First result: the most recently registered answer wins and stops the call.
    register(AlsoBuilds(), "core-test-also-builds")
    assert isinstance(speedtronic.build_model("core_hooks_linear", width=3), nn.Identity)
    assert first.asked == ["core_hooks_linear", TINY]


def test_hook_config_sections(register: Register) -> None:
    class Contributes:
        @hookimpl
        def config_sections(self) -> dict[str, type]:
            return {"recorder": RecorderConfig}

    with pytest.raises(ConfigError, match="recorder: unknown key"):
        SpeedtronicConfig.from_dict({"recorder": {"label": "x"}})
    register(Contributes(), "core-test-contributes")
    config = SpeedtronicConfig.from_dict({"recorder": {"label": "x"}})
    assert config.recorder == RecorderConfig(label="x")
    assert config.to_dict()["recorder"] == {"label": "x"}
    with pytest.raises(ConfigError, match=r"recorder\.lable: unknown key; did you mean 'label'"):
        SpeedtronicConfig.from_dict({"recorder": {"lable": "x"}})


def test_hook_parallel_strategies(register: Register, tmp_path: Path) -> None:
    from speedtronic.parallel import SingleProcess

    class Counting(SingleProcess):
        """A third-party strategy: one process, counting what the engine asks of it."""

        built: list[Counting] = []

        def __init__(self, parallel: Any) -> None:
            super().__init__(parallel)
            self.backwards = self.clips = self.syncs = 0
            Counting.built.append(self)

        def sync_gradients(self, last: bool) -> Any:
            self.syncs += 1
            return super().sync_gradients(last)

        def backward(self, loss: torch.Tensor, *, last: bool, accumulating: bool) -> None:
            self.backwards += 1
            super().backward(loss, last=last, accumulating=accumulating)

        def clip_grad_norm(self, parameters: Any, max_norm: float) -> Any:
            self.clips += 1
            return super().clip_grad_norm(parameters, max_norm)

    class Provides:
        @hookimpl
        def parallel_strategies(self) -> dict[str, type]:
            return {"counting": Counting}

    def losses(output: Path, strategy: str) -> list[float]:
        config = tiny_config(
            output,
            parallel={"strategy": strategy},
            data={"micro_batch_size": 2, "target_batch_size": 4},
            optimizer={"lr": 1e-2, "grad_clip": 1.0},
        )
        runtime = build_runtime(config, console=False)
        runtime.trainer.fit()
        lines = (output / "metrics.jsonl").read_text().splitlines()
        return [e["loss"] for e in map(json.loads, lines) if e.get("event") == "step"]

    with pytest.raises(ConfigError, match=r"parallel\.strategy: is 'counting', which no"):
        build_runtime(tiny_config(tmp_path / "none", parallel={"strategy": "counting"}))
    register(Provides(), "core-test-strategies")
    counted = losses(tmp_path / "counting", "counting")
    (strategy,) = Counting.built
    # 4 steps x 2 micro-batches each; one clip per step; the run trains as `none` does.
    assert (strategy.syncs, strategy.backwards, strategy.clips) == (8, 8, 4)
    assert counted == losses(tmp_path / "single", "none") and len(counted) == 4

    class Clashes:
        @hookimpl
        def parallel_strategies(self) -> dict[str, type]:
            return {"ddp": Counting}

    register(Clashes(), "core-test-strategy-clash")
    with pytest.raises(speedtronic.errors.PluginError, match="'ddp' is a built-in"):
        build_runtime(tiny_config(tmp_path / "clash", parallel={"strategy": "counting"}))


def test_hook_data_rank(register: Register, tmp_path: Path) -> None:
    class Ranks:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        @hookimpl
        def data_rank(self, config: Any) -> tuple[int, int]:
            return (self.rank, 3)

    def samples(rank: int) -> set[tuple[int, ...]]:
        name = register(Ranks(rank), f"core-test-rank-{rank}")
        try:
            runtime = build_runtime(tiny_config(tmp_path / str(rank)), console=False)
        finally:
            plugins.unregister(name)
        runtime.metrics.close()
        batches = [b for _, b in zip(range(4), runtime.data.iterate(0))]
        return {tuple(row.tolist()) for b in batches for row in b["input_ids"]}

    ranks = [samples(rank) for rank in range(3)]
    assert all(ranks) and not (ranks[0] & ranks[1] or ranks[1] & ranks[2] or ranks[0] & ranks[2])
    config = tiny_config(tmp_path)
    single = build_dataloader(config, seq_len=8, vocab_size=16)
    everything = {
        tuple(row.tolist()) for _, b in zip(range(12), single.iterate(0)) for row in b["input_ids"]
    }
    assert ranks[0] | ranks[1] | ranks[2] == everything  # together: the single-process samples


def test_hook_data_seed(register: Register, tmp_path: Path) -> None:
    class Seeds:
        seen: list[tuple[Any, int]] = []

        @hookimpl
        def data_seed(self, config: Any, seed: int) -> int:
            self.seen.append((config, seed))
            return seed + 1000

    class Abstains:
        @hookimpl
        def data_seed(self) -> None:
            return None

    seeds = Seeds()
    register(seeds, "core-test-seeds")
    register(Abstains(), "core-test-abstains")  # asked first; None passes the turn on
    config = tiny_config(tmp_path)
    runtime = build_runtime(config, console=False)
    runtime.metrics.close()
    assert seeds.seen == [(config, 7)]

    def first_batch(seed: int) -> torch.Tensor:
        source = build_dataloader(config, seq_len=8, vocab_size=16, seed=seed)
        return next(source.iterate(0))["input_ids"]

    used = next(runtime.data.iterate(0))["input_ids"]
    assert torch.equal(used, first_batch(1007))
    assert not torch.equal(used, first_batch(7))


def test_hook_register_commands(register: Register, capsys: pytest.CaptureFixture[str]) -> None:
    class Commands:
        @hookimpl
        def register_commands(self, subparsers: Any) -> None:
            echo = subparsers.add_parser("core-test-echo", help="print a word")
            echo.add_argument("word")
            echo.set_defaults(handler=self.echo)

        def echo(self, args: Any) -> int:
            if args.word == "bad":
                raise ConfigError("not a good word", "word")
            print(f"echo {args.word}")
            return 3

    class Breaks:
        @hookimpl
        def register_commands(self, subparsers: Any) -> None:
            raise RuntimeError("cannot add commands")

    register(Commands(), "core-test-commands")
    register(Breaks(), "core-test-breaks")
    assert cli.main(["core-test-echo", "hello"]) == 3
    out, err = capsys.readouterr()
    assert out == "echo hello\n"
    assert "plugin 'core-test-breaks' could not add its commands" in err
    # A user error raised by a plugin command is one line and exit 2, like core's commands.
    assert cli.main(["core-test-echo", "bad"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "error: word: not a good word"
    assert cli.main(["--debug", "core-test-echo", "x"]) == 3  # --debug works before
    assert cli.main(["core-test-echo", "x", "--debug"]) == 3  # ... and after the command


# ---------------------------------------------------------------- using a trained model


def test_hook_export_model(register: Register, tmp_path: Path) -> None:
    from speedtronic.errors import PluginError
    from speedtronic.inference.export import export_run

    class Exports:
        seen: list[dict[str, Any]] = []

        @hookimpl
        def export_model(
            self, model: Any, config: Any, format: str, directory: Path, info: dict[str, Any]
        ) -> str | None:
            if format != "hf" or not isinstance(model, Bigram):
                return None
            self.seen.append({"directory": directory, "info": info, "config": config})
            table = model.table.weight.tolist()
            (directory / "bigram.json").write_text(json.dumps(table))
            return "Bigram table"

    class Abstains:
        @hookimpl
        def export_model(self) -> None:
            return None

    config = tiny_config(tmp_path / "run")
    train_from_config(config, console=False)
    with pytest.raises(PluginError, match="no plugin exports model 'core_hooks_tiny'"):
        export_run(config, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".out.*")) == []

    exporter = Exports()
    register(exporter, "core-test-exports")
    register(Abstains(), "core-test-abstains-export")  # asked first; None passes the turn on
    result = export_run(config, tmp_path / "out")
    assert result.description == "Bigram table" and result.dtype == "float32"
    from speedtronic.inference import load_trained_model

    expected = load_trained_model(config).model.table.weight.tolist()
    assert json.loads((tmp_path / "out" / "bigram.json").read_text()) == expected
    (seen,) = exporter.seen
    # The exporter wrote into a staging folder that was renamed into place afterwards.
    assert seen["directory"] != tmp_path / "out" and not seen["directory"].exists()
    assert seen["config"] is config
    assert seen["info"] == {
        "dtype": "float32",
        "eos_token_id": None,
        "bos_token_id": None,
        "tokenizer": "synthetic",
    }
    assert "step 4" in (tmp_path / "out" / "README.md").read_text()


def test_hook_load_global_state(register: Register, tmp_path: Path) -> None:
    from speedtronic.errors import PluginError
    from speedtronic.inference import load_trained_model

    class Publishes:
        asked: list[tuple[Any, Any]] = []

        @hookimpl
        def load_global_state(self, config: Any, model: Any) -> dict[str, Any]:
            self.asked.append((config, model))
            return {name: torch.full_like(t, 0.5) for name, t in model.state_dict().items()}

    class Abstains:
        @hookimpl
        def load_global_state(self) -> None:
            return None

    config = tiny_config(tmp_path)
    register(Abstains(), "core-test-abstains-global")
    with pytest.raises(PluginError, match="--global: no plugin provides the global weights"):
        load_trained_model(config, use_global=True)
    publisher = Publishes()
    register(publisher, "core-test-publishes")
    register(Abstains(), "core-test-abstains-global-2")  # asked first; None passes the turn on
    trained = load_trained_model(config, use_global=True)
    assert torch.equal(trained.model.table.weight, torch.full((16, 16), 0.5))
    assert trained.source == "the global weights" and not trained.model.training
    (asked,) = publisher.asked
    assert asked[0] is config and isinstance(asked[1], Bigram)
