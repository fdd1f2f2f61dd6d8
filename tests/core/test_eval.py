"""Held-out evaluation: it never disturbs training, scores the same samples every time, keeps
the best checkpoint, survives a resume, and `speedtronic eval` gives the same number."""

from __future__ import annotations

import copy
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from core.toy_runs import merge_sections, tiny_transformer_run, train

from speedtronic import SpeedtronicConfig
from speedtronic.checkpoint import CheckpointManager
from speedtronic.engine.eval import EvalResult, eval_seed, spread_windows
from speedtronic.engine.runtime import build_runtime
from speedtronic.errors import CheckpointError, ConfigError

EVAL_CLI = (sys.executable, "-m", "speedtronic", "eval", "-c")


def run_config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    # Dropout 0.1 in the tiny transformer: any RNG draw by eval would change the curve.
    return merge_sections(tiny_transformer_run(tmp_path, scheduler={"total_steps": 16}), sections)


def weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_training_is_bitwise_the_same_with_and_without_eval(tmp_path: Path) -> None:
    _, plain, plain_trainer = train(run_config(tmp_path / "plain"))
    _, evaluated, eval_trainer = train(
        run_config(tmp_path / "eval", eval={"every": 3, "batches": 2})
    )
    assert evaluated.losses == plain.losses  # exact, not approximate
    a, b = weights(plain_trainer), weights(eval_trainer)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(torch.get_rng_state(), torch.get_rng_state())  # sanity
    steps = [p["step"] for p in evaluated.named("eval")]
    assert steps == [3, 6, 9, 12, 15, 16]  # every 3, and once at the end
    for payload in evaluated.named("eval"):
        assert set(payload) >= {"step", "loss", "ppl", "tokens", "elapsed_s"}
        assert payload["tokens"] == 2 * 2 * 16 and payload["ppl"] > 1
    assert plain.named("eval") == []  # no eval section: nothing evaluated


def test_the_same_held_out_samples_are_scored_every_time(tmp_path: Path) -> None:
    runtime = build_runtime(
        run_config(tmp_path, eval={"batches": 3, "at_end": True}), console=False
    )
    evaluator = runtime.trainer.evaluator
    first = evaluator.evaluate(runtime.model, 0)
    again = evaluator.evaluate(runtime.model, 0)
    assert first.loss == again.loss and first.tokens == again.tokens == 3 * 2 * 16
    assert runtime.model.training  # train mode restored


def test_the_synthetic_held_out_samples_are_not_training_samples(tmp_path: Path) -> None:
    config = run_config(tmp_path, eval={"batches": 4, "at_end": True})
    runtime = build_runtime(config, console=False)
    held_out = {
        tuple(row.tolist())
        for batch in runtime.trainer.evaluator.held_out_batches()
        for row in batch["input_ids"]
    }
    trained = {
        tuple(row.tolist())
        for _, batch in zip(range(200), runtime.data.iterate(0))
        for row in batch["input_ids"]
    }
    assert held_out and not held_out & trained
    assert eval_seed(0) != 0 and eval_seed(7) != 7


def test_resume_with_eval_on_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    evaluation = {"every": 4, "batches": 2}
    _, straight, _ = train(run_config(tmp_path / "straight", eval=evaluation))
    config = run_config(tmp_path / "chain", eval=evaluation)
    train(merge_sections(copy.deepcopy(config), {"run": {"max_steps": 8}}))
    _, resumed, _ = train(merge_sections(copy.deepcopy(config), {"checkpoint": {"resume": True}}))
    assert {**straight.losses} == {
        **{step: loss for step, loss in straight.losses.items() if step <= 8},
        **resumed.losses,
    }
    straight_evals = {p["step"]: p["loss"] for p in straight.named("eval")}
    resumed_evals = {p["step"]: p["loss"] for p in resumed.named("eval")}
    assert resumed_evals == {step: loss for step, loss in straight_evals.items() if step > 8}


class ScriptedEvaluator:
    """Returns the losses it is given, in order (the retention rule is what is tested)."""

    description = "scripted"

    def __init__(self, losses: list[float]) -> None:
        self.losses = list(losses)

    def evaluate(self, model: Any, step: int) -> EvalResult:
        loss = self.losses.pop(0)
        return EvalResult(step, loss, 1.0, 1, 1, 0.0)


def test_keep_best_keeps_the_lowest_eval_loss_checkpoint_past_retention(tmp_path: Path) -> None:
    config = SpeedtronicConfig.from_dict(
        run_config(
            tmp_path,
            eval={"every": 2, "at_end": False},
            checkpoint={"interval": 2, "keep_last": 1, "keep_best": True},
        )
    )
    from speedtronic.data import build_dataloader
    from speedtronic.engine.parts import build_parts
    from speedtronic.engine.trainer import Trainer
    from speedtronic.observe.metrics import MetricLogger
    from speedtronic.registry import build_model_from_hook

    model = build_model_from_hook(config.model.name, **config.model.params)
    data = build_dataloader(config, seq_len=16, vocab_size=256)
    losses = [3.0, 2.0, 2.5, 2.7, 2.1, 2.9, 3.1, 2.2]  # best at step 4
    parts = build_parts(
        config, model, data, metric_logger=MetricLogger(), evaluator=ScriptedEvaluator(losses)
    )
    Trainer.from_parts(parts).fit()
    directory = tmp_path / "checkpoints"
    names = sorted(p.name for p in directory.iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000004", "step_00000016"]  # the best survives keep_last=1
    best = json.loads((directory / "best.json").read_text())
    assert best == {"checkpoint": "step_00000004", "step": 4, "eval_loss": 2.0}
    assert CheckpointManager(directory).load("best").step == 4


def test_keep_best_needs_an_eval_section() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint\.keep_best: needs an eval loss"):
        SpeedtronicConfig.from_dict({"checkpoint": {"keep_best": True}})


def test_text_training_data_needs_held_out_text(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("hello world " * 200)
    config = run_config(tmp_path, data={"text_path": str(text)}, eval={"every": 4})
    with pytest.raises(ConfigError, match=r"^eval: evaluating with data\.text_path needs"):
        build_runtime(config, console=False)


@pytest.mark.slow
def test_eval_cli_scores_a_checkpoint_like_the_run_did(tmp_path: Path) -> None:
    config = run_config(tmp_path, eval={"every": 8, "batches": 2}, checkpoint={"keep_best": True})
    _, events, _ = train(config)
    (tmp_path / "run.json").write_text(json.dumps(config))
    final_eval = events.named("eval")[-1]
    done = subprocess.run(
        [*EVAL_CLI, str(tmp_path / "run.json"), "--checkpoint", "best", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["loss"] == pytest.approx(final_eval["loss"], abs=1e-6)
    assert record["tokens"] == final_eval["tokens"]
    # The synthetic stream has no end: the command takes the config's eval.batches.
    assert record["windows"] == final_eval["windows"] == 4 and record["of_windows"] is None
    missing = subprocess.run(
        [*EVAL_CLI, str(tmp_path / "run.json"), "--checkpoint", str(tmp_path / "x/step_00000003")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # Log lines (the thread count) may come first; the error is one line, the last.
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1].startswith("error: --checkpoint ")
    assert "Traceback" not in missing.stderr


def test_a_corrupt_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    config = run_config(tmp_path, run={"max_steps": 4})
    train(config)
    newest = tmp_path / "checkpoints" / "step_00000004"
    (newest / "tensors.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"step_00000004.* (bytes|sha256)"):
        CheckpointManager(tmp_path / "checkpoints").load(str(newest))


def test_a_text_holdout_is_never_read_by_training(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    rng = random.Random(5)
    text.write_bytes(bytes(rng.randrange(32, 127) for _ in range(20_000)))
    config = run_config(
        tmp_path, data={"text_path": str(text)}, eval={"holdout_fraction": 0.1, "batches": 4}
    )
    runtime = build_runtime(config, console=False)
    assert "last 10% held out" in runtime.data.description
    held_out = {
        tuple(row.tolist())
        for batch in runtime.trainer.evaluator.held_out_batches()
        for row in batch["input_ids"]
    }
    blocks = (20_000 - 1) // 16
    # More than an epoch of training reads: every training block, wrapped around.
    trained = {
        tuple(row.tolist())
        for _, batch in zip(range(blocks), runtime.data.iterate(0))
        for row in batch["input_ids"]
    }
    assert len(held_out) == 4 * 2 and not held_out & trained
    assert len(trained) == blocks - math.ceil(blocks * 0.1)


@pytest.mark.parametrize("where", ["holdout", "eval_text"])
def test_finite_eval_data_is_read_once_not_wrapped_around(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    text = tmp_path / "corpus.txt"
    rng = random.Random(7)
    text.write_bytes(bytes(rng.randrange(32, 127) for _ in range(16 * 50 + 1)))  # 50 blocks
    small = tmp_path / "eval.txt"
    small.write_bytes(bytes(rng.randrange(32, 127) for _ in range(16 * 5 + 1)))  # 5 blocks
    if where == "holdout":  # 5 held-out blocks: two micro-batches of 2, then they repeat
        eval_section = {"holdout_fraction": 0.1, "batches": 8}
    else:
        eval_section = {"text_path": str(small), "batches": 8}
    config = run_config(tmp_path, data={"text_path": str(text)}, eval=eval_section)
    runtime = build_runtime(config, console=False)
    with caplog.at_level("WARNING", "speedtronic"):
        batches = runtime.trainer.evaluator.held_out_batches()
    rows = [tuple(row.tolist()) for batch in batches for row in batch["input_ids"]]
    # Every block once (two micro-batches of 2 and one of 1), none counted twice.
    assert [len(b["input_ids"]) for b in batches] == [2, 2, 1] and len(set(rows)) == 5
    assert "has only 5 windows, fewer than eval.batches=8 micro-batches of 2" in caplog.text
    result = runtime.trainer.evaluator.evaluate(runtime.model, 0)
    assert result.batches == 3 and result.tokens == 5 * 16
    assert (result.windows, result.of_windows) == (5, 5)


def test_spread_windows_are_distinct_even_and_the_same_every_time() -> None:
    chosen = spread_windows(1000, 50, seed=3)
    assert len(set(chosen.tolist())) == 50 and chosen.min() >= 0 and chosen.max() < 1000
    assert set(np.diff(chosen).tolist()) == {20}  # a fixed stride
    assert np.array_equal(chosen, spread_windows(1000, 50, seed=3))
    assert not np.array_equal(chosen, spread_windows(1000, 50, seed=4))  # a seeded offset
    uneven = spread_windows(1003, 7, seed=0)
    assert len(set(uneven.tolist())) == 7 and set(np.diff(uneven).tolist()) <= {143, 144}
    assert spread_windows(5, 8).tolist() == [0, 1, 2, 3, 4]  # more asked than there are


class Unigram(torch.nn.Module):
    """Scores each next byte by its frequency in a text: real text costs ~3 nats a byte,
    random bytes far more, so where the scored windows lie shows in the loss."""

    def __init__(self, text: bytes) -> None:
        super().__init__()
        counts = torch.bincount(torch.tensor(list(text)), minlength=256).double() + 0.01
        self.register_buffer("log_p", (counts / counts.sum()).log())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return -self.log_p[labels].mean()


def real_text() -> bytes:
    docs = Path(__file__).resolve().parents[2] / "docs"
    return b"\n".join(p.read_bytes() for p in sorted(docs.glob("*.md")))


def test_a_few_spread_batches_score_like_the_whole_held_out_split(tmp_path: Path) -> None:
    text = real_text()
    windows = 1600  # of seq 16: the first quarter random bytes, the rest real text
    random_part = bytes(random.Random(11).randrange(256) for _ in range(windows // 4 * 16))
    held_out = random_part + text[: windows * 16 + 1 - len(random_part)]
    assert len(held_out) == windows * 16 + 1
    (tmp_path / "eval.txt").write_bytes(held_out)
    (tmp_path / "train.txt").write_bytes(text[-20_000:])
    model = Unigram(text)

    def score(batches: Any) -> EvalResult:
        config = run_config(
            tmp_path,
            data={"text_path": str(tmp_path / "train.txt")},
            eval={
                "text_path": str(tmp_path / "eval.txt"),
                "micro_batch_size": 16,
                "batches": batches,
            },
        )
        evaluator = build_runtime(config, console=False).trainer.evaluator
        return evaluator.evaluate(model, 0)

    everything = score("all")
    sampled = score(5)  # 80 windows: 5% of the split
    assert (everything.windows, everything.of_windows) == (1600, 1600)
    assert (sampled.windows, sampled.of_windows) == (80, 1600)
    assert sampled.tokens == 80 * 16 and everything.tokens == 1600 * 16
    assert abs(sampled.loss - everything.loss) < 0.3
    # A prefix of the split would have scored random bytes only: far off.
    prefix = -model.log_p[torch.tensor(list(held_out[1 : 80 * 16 + 1]))].mean().item()
    assert prefix - everything.loss > 2


def test_eval_events_say_how_many_of_how_many_windows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = tmp_path / "corpus.txt"
    text.write_bytes(real_text()[: 16 * 400 + 1])  # 400 blocks, the last 40 held out
    config = run_config(
        tmp_path,
        run={"max_steps": 4},
        data={"text_path": str(text)},
        eval={"holdout_fraction": 0.1, "batches": 3, "every": 2},
    )
    with caplog.at_level("INFO", "speedtronic"):
        _, events, _ = train(config)
    assert "eval: 6 of 40 windows (3 micro-batches of 2, spread over the split)" in caplog.text
    payloads = events.named("eval")
    assert [p["step"] for p in payloads] == [2, 4]
    assert all((p["windows"], p["of_windows"], p["tokens"]) == (6, 40, 6 * 16) for p in payloads)
    everything = merge_sections(copy.deepcopy(config), {"eval": {"batches": "all"}})
    _, events, _ = train(merge_sections(everything, {"run": {"output_dir": str(tmp_path / "all")}}))
    assert events.named("eval")[-1]["windows"] == events.named("eval")[-1]["of_windows"] == 40


def test_all_windows_of_an_endless_stream_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^eval\.batches: 'all' needs held-out data of a known"):
        build_runtime(run_config(tmp_path, eval={"batches": "all", "every": 2}), console=False)
    with pytest.raises(ConfigError, match=r"^eval\.batches: .*'all'"):
        SpeedtronicConfig.from_dict({"eval": {"batches": "most"}})


def test_eval_command_scores_every_window_unless_told_a_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from speedtronic import cli

    text = tmp_path / "corpus.txt"
    text.write_bytes(real_text()[: 16 * 300 + 1])  # 300 blocks, the last 30 held out
    config = run_config(
        tmp_path,
        run={"max_steps": 4},
        data={"text_path": str(text)},
        eval={"holdout_fraction": 0.1, "batches": 2},
    )
    _, events, _ = train(config)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    capsys.readouterr()
    assert cli.main(["eval", "--config", str(path), "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["windows"], record["of_windows"], record["tokens"]) == (30, 30, 30 * 16)
    assert cli.main(["eval", "--config", str(path), "--batches", "2", "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["windows"], record["of_windows"]) == (4, 30)
    assert record["loss"] == pytest.approx(events.named("eval")[-1]["loss"], abs=1e-6)
    assert cli.main(["eval", "--config", str(path), "--batches", "2"]) == 0
    assert "4 of 30" in capsys.readouterr().out
