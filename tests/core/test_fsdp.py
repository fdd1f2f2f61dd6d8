"""``parallel.strategy: fsdp`` in one process: the config keys, which modules become units,
the memory estimate, and sharded (DCP) checkpoints written and read without a process group.

The multi-rank behaviour (same losses as one process, resharding across world sizes, a kill
during a sharded save, export/eval/generate of a sharded checkpoint) is tested with real
torchrun processes in tests/e2e/test_fsdp.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from toy_runs import EventRecorder, tiny_transformer_run, train

from speedtronic import ConfigError, SpeedtronicConfig
from speedtronic.checkpoint import CheckpointManager
from speedtronic.parallel.fsdp import (
    find_units,
    full_model_state,
    load_full_model_state,
    mixed_precision,
    state_bytes_per_rank,
)
from speedtronic_models import ReferenceTransformer

SMALL = {"vocab_size": 64, "max_seq_len": 8, "n_layer": 3, "n_head": 2, "d_model": 16}


def config(**parallel: object) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict({"parallel": {"strategy": "fsdp", **parallel}})


def test_fsdp_section_defaults_and_values() -> None:
    section = config().parallel.fsdp
    assert (section.reshard_after_forward, section.units, section.cpu_offload) == (
        True,
        "auto",
        False,
    )
    assert section.param_dtype is None and section.reduce_dtype is None
    given = config(fsdp={"units": ["TransformerBlock"], "param_dtype": "bfloat16"}).parallel.fsdp
    assert given.units == ["TransformerBlock"] and given.param_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("fsdp", "field"),
    [
        ({"units": []}, "parallel.fsdp.units"),
        ({"units": ["not a class"]}, "parallel.fsdp.units[0]"),
        ({"param_dtype": "float64"}, "parallel.fsdp.param_dtype"),
        ({"reshard_after_forward": "sometimes"}, "parallel.fsdp.reshard_after_forward"),
    ],
)
def test_bad_fsdp_values_name_their_field(fsdp: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(fsdp=fsdp)
    assert caught.value.path == field


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"ooo_backprop": {"enabled": True}}, "ooo_backprop.enabled"),
        ({"optimizer": {"name": "muon"}}, "optimizer.name"),
    ],
)
def test_combinations_fsdp_cannot_train_are_refused(
    sections: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict({"parallel": {"strategy": "fsdp"}, **sections})
    assert caught.value.path == field and "fsdp" in str(caught.value)


def test_auto_units_are_the_transformer_blocks() -> None:
    model = ReferenceTransformer(**SMALL)
    units = find_units(model, "auto")
    assert units == list(reversed(list(model.blocks)))  # innermost first, as FSDP wants


def test_auto_units_fall_back_to_the_class_repeated_in_a_module_list() -> None:
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
            self.head = torch.nn.Linear(4, 2)

    model = Stack()
    assert find_units(model, "auto") == list(reversed(list(model.layers)))


def test_a_model_without_blocks_is_one_unit(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "speedtronic"):
        assert find_units(torch.nn.Linear(4, 4), "auto") == []
    assert "parallel.fsdp.units" in caplog.text


def test_listed_units_must_be_classes_of_the_model() -> None:
    model = ReferenceTransformer(**SMALL)
    assert len(find_units(model, ["SwiGLU"])) == 3
    with pytest.raises(ConfigError, match="Blok is not a module class") as caught:
        find_units(model, ["Blok"])
    assert caught.value.path == "parallel.fsdp.units"


def test_mixed_precision_follows_the_run_precision_unless_set() -> None:
    fsdp = config().parallel.fsdp
    fp32 = mixed_precision(fsdp, None)
    assert fp32.param_dtype is None and fp32.reduce_dtype is None
    bf16 = mixed_precision(fsdp, torch.bfloat16)
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype is None  # = param dtype
    full_reduce = config(fsdp={"reduce_dtype": "float32"}).parallel.fsdp
    assert mixed_precision(full_reduce, torch.bfloat16).reduce_dtype == torch.float32


def test_fsdp_state_per_rank_is_about_one_nth_of_ddp() -> None:
    with torch.device("meta"):
        model = ReferenceTransformer(
            vocab_size=32000, max_seq_len=64, n_layer=8, n_head=8, d_model=512
        )
    ddp = state_bytes_per_rank(model, 4, "ddp")
    assert ddp.params == ddp.grads == 4 * sum(p.numel() for p in model.parameters())
    assert ddp.optimizer == 2 * ddp.params
    for world in (2, 4):
        fsdp = state_bytes_per_rank(model, world, "fsdp")
        assert fsdp.total <= (1 / world + 0.05) * ddp.total
        assert fsdp.total >= ddp.total / world  # padding never makes a shard smaller
        assert fsdp.gathered > 0
    assert state_bytes_per_rank(model, 1, "fsdp") == ddp


def test_full_state_helpers_on_one_process() -> None:
    model = ReferenceTransformer(**SMALL)
    full = full_model_state(model)
    assert set(full) == set(model.state_dict())
    assert all(t.device.type == "cpu" for t in full.values())
    load_full_model_state(model, {k: torch.zeros_like(v) for k, v in full.items()})
    assert all(bool((t == 0).all()) for t in model.state_dict().values())
    full["norm.weight"].fill_(7.0)  # a copy: the model is not touched
    assert not bool((model.norm.weight == 7.0).any())


def test_flops_are_counted_on_a_meta_copy_taken_before_sharding() -> None:
    from speedtronic.observe.flops import measure_flops
    from speedtronic.parallel.fsdp import meta_shadow

    model = ReferenceTransformer(**SMALL)
    shadow = meta_shadow(model)
    assert shadow is not None and all(p.is_meta for p in shadow.parameters())
    assert all(not p.is_meta for p in model.parameters())  # the model itself is untouched
    on_shadow = measure_flops(shadow, seq_len=8)
    on_model = measure_flops(model, seq_len=8)
    assert on_shadow.parameters == on_model.parameters
    # The real CPU pass takes the model's hand-differentiated backward, the meta one the plain
    # operations: the same model arithmetic within a few elementwise operations.
    assert on_shadow.flops_per_token == pytest.approx(on_model.flops_per_token, rel=0.02)


def test_fsdp_on_one_process_writes_dcp_checkpoints_any_run_resumes(tmp_path: Path) -> None:
    horizon = {"warmup_steps": 2, "total_steps": 8}  # one schedule whatever max_steps is
    straight = tiny_transformer_run(tmp_path / "straight", run={"max_steps": 8}, scheduler=horizon)
    expected = train(straight)[1].losses
    sharded = tiny_transformer_run(
        tmp_path / "chain", run={"max_steps": 4}, parallel={"strategy": "fsdp"}, scheduler=horizon
    )
    train(sharded)
    directory = tmp_path / "chain" / "checkpoints"
    step4 = directory / "step_00000004"
    manifest = json.loads((step4 / "manifest.json").read_text())
    assert manifest["layout"] == "dcp" and {"dcp/.metadata", "dcp/__0_0.distcp"} <= set(
        manifest["files"]
    )
    # Read whole (as export/eval/generate do): plain tensors with the model's own keys.
    state = CheckpointManager(directory).read(step4).state
    assert tuple(state["model"]["tok_emb.weight"].shape) == (256, 32)
    assert "blocks.0.attn.qkv.weight" in state["model"]
    assert isinstance(state["optimizer"]["state"]["tok_emb.weight"]["exp_avg"], torch.Tensor)
    # A plain single-process run continues from the sharded checkpoint exactly.
    plain = tiny_transformer_run(
        tmp_path / "chain",
        run={"max_steps": 8},
        checkpoint={"interval": 4, "resume": True},
        scheduler=horizon,
    )
    _, recorder, _ = train(plain)
    assert recorder.named("resumed")[0]["step"] == 4
    for step in range(5, 9):
        assert recorder.losses[step] == pytest.approx(expected[step], rel=1e-5)


class ScriptedEvaluator:
    """Eval losses from a list, one per evaluation (which step is best is up to the test)."""

    description = "scripted"

    def __init__(self, losses: list[float]) -> None:
        self.losses = list(losses)

    def evaluate(self, model: Any, step: int) -> Any:
        from speedtronic.engine.eval import EvalResult

        return EvalResult(step, self.losses.pop(0), 1.0, 1, 1, 0.0)


def test_sharded_saves_keep_the_managers_policy_retention_best_and_lock(tmp_path: Path) -> None:
    from speedtronic.checkpoint.dcp import ShardedWriter, is_sharded_checkpoint
    from speedtronic.checkpoint.runlock import LOCK_NAME
    from speedtronic.data import build_dataloader
    from speedtronic.engine.parts import build_parts
    from speedtronic.engine.trainer import Trainer
    from speedtronic.registry import build_model_from_hook

    settings = tiny_transformer_run(
        tmp_path,
        run={"max_steps": 50},
        parallel={"strategy": "fsdp"},
        eval={"every": 2, "at_end": False},
        checkpoint={"interval": 2, "keep_last": 1, "keep_best": True},
    )
    cfg = SpeedtronicConfig.from_dict(settings)
    model = build_model_from_hook(cfg.model.name, **cfg.model.params)
    recorder = EventRecorder()
    trainers: list[Trainer] = []

    def stop_at_ten(event: str, payload: dict[str, Any]) -> None:
        if event == "step" and payload["step"] == 10:
            trainers[0].request_stop()

    from speedtronic.observe.metrics import MetricLogger

    parts = build_parts(
        cfg,
        model,
        build_dataloader(cfg, seq_len=model.max_seq_len, vocab_size=model.vocab_size),
        metric_logger=MetricLogger([recorder, stop_at_ten]),
        evaluator=ScriptedEvaluator([3.0, 2.0, 2.5, 2.7, 2.9]),  # best at step 4
    )
    trainer = Trainer.from_parts(parts)
    trainers.append(trainer)
    assert isinstance(trainer.checkpoints.writer, ShardedWriter)
    result = trainer.fit()
    assert result.stopped and result.steps == 10
    directory = tmp_path / "checkpoints"
    assert [p["step"] for p in recorder.named("checkpoint")] == [2, 4, 6, 8, 10]
    names = sorted(p.name for p in directory.iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000004", "step_00000010"]  # the best survives keep_last=1
    assert all(is_sharded_checkpoint(directory / name) for name in names)
    assert json.loads((directory / "best.json").read_text())["checkpoint"] == "step_00000004"
    assert json.loads((directory / "latest.json").read_text())["step"] == 10
    assert CheckpointManager(directory).load("best").step == 4
    assert not (directory / LOCK_NAME).exists()  # released at the end


def test_a_tampered_shard_file_fails_verification(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tiny_transformer_run(
        tmp_path, run={"max_steps": 8}, parallel={"strategy": "fsdp"}, checkpoint={"interval": 4}
    )
    train(run)
    directory = tmp_path / "checkpoints"
    shard = directory / "step_00000008" / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "speedtronic"):
        assert CheckpointManager(directory).load_latest().step == 4
    assert "__0_0.distcp fails its sha256 check" in caplog.text


def test_a_manifest_naming_files_outside_dcp_is_refused(tmp_path: Path) -> None:
    run = tiny_transformer_run(tmp_path, run={"max_steps": 4}, parallel={"strategy": "fsdp"})
    train(run)
    step4 = tmp_path / "checkpoints" / "step_00000004"
    manifest = json.loads((step4 / "manifest.json").read_text())
    manifest["files"]["dcp/../../escape"] = manifest["files"]["dcp/.metadata"]
    (step4 / "manifest.json").write_text(json.dumps(manifest))
    from speedtronic.errors import CheckpointError

    with pytest.raises(CheckpointError, match="unexpected files"):
        CheckpointManager(step4.parent).verify(step4)


def test_validate_reports_state_per_rank_for_ddp_and_fsdp(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "config.json"
    model = {"name": "reference_transformer", **SMALL}
    path.write_text(json.dumps({"model": model, "parallel": {"strategy": "fsdp"}}))
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", "validate", "-c", str(path), "--nproc-per-node", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stderr.splitlines() if "state per rank on 4 ranks" in x)
    assert "ddp " in line and "fsdp " in line and "optimizer" in line
    bad = path.with_name("bad.json")
    bad.write_text(json.dumps({"model": model, "parallel": {"fsdp": {"units": ["Nope"]}}}))
    refused = subprocess.run(
        [sys.executable, "-m", "speedtronic", "validate", "-c", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0
    assert "parallel.fsdp.units" in refused.stderr and "Traceback" not in refused.stderr


def test_a_pickle_payload_in_the_dcp_metadata_never_runs(tmp_path: Path) -> None:
    import hashlib
    import pickle

    run = tiny_transformer_run(tmp_path, run={"max_steps": 4}, parallel={"strategy": "fsdp"})
    train(run)
    step4 = tmp_path / "checkpoints" / "step_00000004"
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (Path.touch, (str(marker),))  # type: ignore[return-value]

    planted = pickle.dumps(Payload())
    (step4 / "dcp" / ".metadata").write_bytes(planted)
    # A consistent manifest: only the unpickler stands between the payload and running it.
    manifest = json.loads((step4 / "manifest.json").read_text())
    manifest["files"]["dcp/.metadata"].update(
        size=len(planted), sha256=[hashlib.sha256(planted).hexdigest()]
    )
    (step4 / "manifest.json").write_text(json.dumps(manifest))
    from speedtronic.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not DCP metadata"):
        CheckpointManager(step4.parent).read(step4)
    assert not marker.exists()


def test_fp16_over_shards_uses_a_scaler_that_agrees_across_ranks() -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from speedtronic.engine.precision import FP16, FP32
    from speedtronic.parallel import SINGLE_PROCESS, FullyShardedDataParallel, ParallelContext

    cpu = torch.device("cpu")
    sharded = FullyShardedDataParallel(ParallelContext(rank=0, world_size=2))
    whole = FullyShardedDataParallel(SINGLE_PROCESS)
    assert isinstance(sharded.grad_scaler(FP16, cpu), ShardedGradScaler)
    assert not isinstance(whole.grad_scaler(FP16, cpu), ShardedGradScaler)
    assert not sharded.grad_scaler(FP32, cpu).is_enabled()
