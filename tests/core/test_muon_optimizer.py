"""optimizer.name: muon: grouping, equivalence with torch.optim.Muon, and the trainer contract
(LambdaLR, GradScaler, state dicts through the checkpoint codec, state reset)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from speedtronic.checkpoint.statecodec import decode, encode
from speedtronic.config import OptimizerConfig, SchedulerConfig
from speedtronic.errors import CheckpointError, ConfigError, SpeedtronicError
from speedtronic.optim import build_optimizer, build_scheduler, reset_optimizer_state
from speedtronic.optim.combined import CombinedOptimizer
from speedtronic.optim.muon import muon_param_groups
from speedtronic_models import ReferenceTransformer

CPU = torch.device("cpu")
SMALL = dict(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32)
HIDDEN = [
    f"blocks.{i}.{name}.weight"
    for i in range(2)
    for name in ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.down")
]


def make_model(seed: int = 0) -> ReferenceTransformer:
    torch.manual_seed(seed)
    return ReferenceTransformer(**SMALL)


def muon_config(**overrides: Any) -> OptimizerConfig:
    return OptimizerConfig(name="muon", lr=1e-2, **overrides)


def backward(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=generator)
    model(ids, labels=ids.roll(-1, dims=1))["loss"].backward()


def test_muon_takes_the_hidden_matrices_of_the_reference_transformer() -> None:
    model = make_model()
    optimizer = build_optimizer(model, muon_config(), CPU)
    assert isinstance(optimizer, CombinedOptimizer)
    assert list(optimizer.optimizers) == ["adamw", "muon"]
    muon = optimizer.optimizers["muon"]
    assert isinstance(muon, torch.optim.Muon)
    assert muon.param_groups[0]["param_names"] == HIDDEN
    adamw = optimizer.optimizers["adamw"]
    adamw_names = {n for g in adamw.param_groups for n in g["param_names"]}
    # The embedding doubles as the (tied) output head; norms are 1-D: all stay with AdamW.
    assert adamw_names == {"tok_emb.weight", "norm.weight"} | {
        f"blocks.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "mlp_norm")
    }
    every = {id(p) for p in model.parameters()}
    grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(every)  # each parameter exactly once


def test_untied_output_head_and_biases_stay_with_adamw() -> None:
    class Untied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.hidden = nn.Linear(32, 32)
            self.conv = nn.Conv1d(32, 32, 3)
            self.lm_head = nn.Linear(32, 64, bias=False)

    model = Untied()
    groups = muon_param_groups(model, muon_config())
    by_optimizer = {
        kind: {n for g in groups if g["optimizer"] == kind for n in g["param_names"]}
        for kind in ("adamw", "muon")
    }
    assert by_optimizer["muon"] == {"hidden.weight"}
    # A 3-D conv kernel is not a matrix torch's Muon accepts; the head is not a hidden layer.
    assert {"embed.weight", "hidden.bias", "conv.weight", "lm_head.weight"} <= by_optimizer["adamw"]


def test_grouping_is_logged_at_startup(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="speedtronic.optim"):
        build_optimizer(make_model(), muon_config(), CPU)
    lines = [r.getMessage() for r in caplog.records if r.name == "speedtronic.optim"]
    assert any("group muon (Muon" in line and "blocks.0.attn.qkv.weight" in line for line in lines)
    assert any("(AdamW" in line and "tok_emb.weight" in line for line in lines)


def test_a_muon_step_equals_torch_muon_called_directly() -> None:
    config = muon_config(
        muon={
            "lr": 0.03,
            "momentum": 0.9,
            "nesterov": False,
            "ns_steps": 4,
            "weight_decay": 0.01,
            "adjust_lr_fn": "match_rms_adamw",
        }
    )
    ours, reference = make_model(), make_model()
    optimizer = build_optimizer(ours, config, CPU)
    named = dict(reference.named_parameters())
    direct = torch.optim.Muon(
        [named[n] for n in HIDDEN],
        lr=0.03,
        momentum=0.9,
        nesterov=False,
        ns_steps=4,
        weight_decay=0.01,
        adjust_lr_fn="match_rms_adamw",
    )
    # Everything else: embedding (the tied head) and norms, undecayed as with plain AdamW.
    rest = torch.optim.AdamW(
        [p for n, p in named.items() if n not in HIDDEN],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.0,
    )
    for step in range(3):  # several steps, so momentum buffers matter too
        for model in (ours, reference):
            model.zero_grad(set_to_none=True)
            backward(model, seed=step)
        optimizer.step()
        direct.step()
        rest.step()
        for name, param in ours.named_parameters():
            assert torch.equal(param, named[name]), (step, name)
    # The Muon group really moved.
    assert not torch.equal(
        dict(ours.named_parameters())[HIDDEN[0]], dict(make_model().named_parameters())[HIDDEN[0]]
    )


def test_custom_groups_choose_muon_explicitly() -> None:
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def optimizer_param_groups(self, config: OptimizerConfig) -> list[dict[str, Any]]:
            return [
                {"params": [self.a.weight], "optimizer": "muon", "lr": 0.5},
                {"params": [self.a.bias, self.b.weight, self.b.bias], "weight_decay": 0.0},
            ]

    model = Custom()
    optimizer = build_optimizer(model, muon_config(), CPU)
    assert isinstance(optimizer, CombinedOptimizer)
    assert optimizer.optimizers["muon"].param_groups[0]["params"] == [model.a.weight]
    assert optimizer.optimizers["muon"].param_groups[0]["lr"] == 0.5
    assert len(optimizer.optimizers["adamw"].param_groups[0]["params"]) == 3


def test_custom_muon_group_with_a_vector_is_an_error() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def optimizer_param_groups(self, config: OptimizerConfig) -> list[dict[str, Any]]:
            return [
                {
                    "params": list(self.layer.parameters()),
                    "optimizer": "muon",
                    "param_names": ["layer.weight", "layer.bias"],
                }
            ]

    with pytest.raises(SpeedtronicError, match=r"layer\.bias .*2-D"):
        build_optimizer(Bad(), muon_config(), CPU)


def test_an_older_torch_gets_an_error_naming_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match=r"torch >= 2\.9") as excinfo:
        build_optimizer(make_model(), muon_config(), CPU)
    assert excinfo.value.path == "optimizer.name"


def test_lambda_lr_schedules_each_group_from_its_own_base_lr() -> None:
    optimizer = build_optimizer(make_model(), muon_config(), CPU)
    scheduler = build_scheduler(optimizer, SchedulerConfig(warmup_steps=4), max_steps=10)
    muon_group = optimizer.optimizers["muon"].param_groups[0]
    adamw_group = optimizer.optimizers["adamw"].param_groups[0]
    assert muon_group["lr"] == pytest.approx(0.02 / 4)
    assert adamw_group["lr"] == pytest.approx(1e-2 / 4)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert muon_group["lr"] == pytest.approx(0.02)
    assert adamw_group["lr"] == pytest.approx(1e-2)


def test_grad_scaler_drives_the_combined_optimizer_like_a_plain_step() -> None:
    scaled, plain = make_model(), make_model()
    scaled_opt = build_optimizer(scaled, muon_config(), CPU)
    plain_opt = build_optimizer(plain, muon_config(), CPU)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    assert scaler.is_enabled()
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=generator)
        scaler.scale(scaled(ids, labels=ids)["loss"]).backward()
        scaler.unscale_(scaled_opt)
        scaler.step(scaled_opt)
        scaler.update()
        plain(ids, labels=ids)["loss"].backward()
        plain_opt.step()
        scaled_opt.zero_grad()
        plain_opt.zero_grad()
    for a, b in zip(scaled.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # An overflow skips the whole combined step.
    before = [p.detach().clone() for p in scaled.parameters()]
    scaled.tok_emb.weight.grad = torch.full_like(scaled.tok_emb.weight, float("inf"))
    scaler.step(scaled_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, scaled.parameters(), strict=True))


def test_state_dict_round_trips_exactly_through_the_checkpoint_codec() -> None:
    model = make_model()
    optimizer = build_optimizer(model, muon_config(), CPU)
    scheduler = build_scheduler(optimizer, SchedulerConfig(warmup_steps=2), max_steps=10)
    for step in range(2):
        backward(model, seed=step)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    json_tree, tensors = encode(optimizer.state_dict())
    restored_model = make_model()
    restored_model.load_state_dict(model.state_dict())
    restored = build_optimizer(restored_model, muon_config(), CPU)
    build_scheduler(restored, SchedulerConfig(warmup_steps=2), max_steps=10)
    # Through safetensors bytes as a checkpoint would: no tensor is shared with the original.
    restored.load_state_dict(
        decode(json_tree, safetensors.torch.load(safetensors.torch.save(tensors)))
    )
    assert len(restored.state) == len(optimizer.state) == len(list(model.parameters()))
    buffer = optimizer.optimizers["muon"].state[model.blocks[0].attn.qkv.weight]
    restored_buffer = restored.optimizers["muon"].state[restored_model.blocks[0].attn.qkv.weight]
    assert torch.equal(restored_buffer["momentum_buffer"], buffer["momentum_buffer"])
    for group, saved in zip(restored.param_groups, optimizer.param_groups, strict=True):
        assert group["lr"] == saved["lr"] and group["initial_lr"] == saved["initial_lr"]
    # And the next step is identical.
    for m, opt in ((model, optimizer), (restored_model, restored)):
        backward(m, seed=9)
        opt.step()
    for a, b in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_loading_a_plain_adamw_state_is_a_checkpoint_error() -> None:
    adamw = build_optimizer(make_model(), OptimizerConfig(), CPU)
    combined = build_optimizer(make_model(), muon_config(), CPU)
    with pytest.raises(CheckpointError, match=r"optimizer\.name"):
        combined.load_state_dict(adamw.state_dict())


def test_reset_clears_both_parts() -> None:
    model = make_model()
    optimizer = build_optimizer(model, muon_config(), CPU)
    backward(model, seed=0)
    optimizer.step()
    assert len(optimizer.optimizers["muon"].state) and len(optimizer.optimizers["adamw"].state)
    reset_optimizer_state(optimizer)  # the trainer's path (DiLoCo's weight replacement)
    assert len(optimizer.state) == 0
    assert not optimizer.optimizers["muon"].state and not optimizer.optimizers["adamw"].state
    optimizer.step()  # state is rebuilt from scratch
    assert len(optimizer.optimizers["muon"].state) == len(HIDDEN)
