"""optimizer.cautious: the mask on hand-computed examples, weight decay inside and outside it,
and the trainer contract (GradScaler, LambdaLR, state dicts, reset)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from speedtronic.config import OptimizerConfig, SchedulerConfig
from speedtronic.optim import build_optimizer, build_scheduler, reset_optimizer_state
from speedtronic.optim.cautious import CautiousOptimizer
from speedtronic.optim.combined import CombinedOptimizer
from speedtronic_models import ReferenceTransformer

CPU = torch.device("cpu")


class FixedUpdate(torch.optim.Optimizer):
    """A stand-in third-party optimizer: adds a preset update to each parameter."""

    def __init__(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": 1.0})
        self.updates = updates

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for param, update in zip(self.param_groups[0]["params"], self.updates, strict=True):
            param.add_(update)


def test_hand_computed_mask_and_rescale() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.tensor([1.0, 1.0, 1.0, -1.0])
    update = torch.tensor([-0.1, 0.2, -0.3, 0.4])
    optimizer = CautiousOptimizer(FixedUpdate([param], [update]))
    optimizer.step()
    # update * grad = [-0.1, +0.2, -0.3, -0.4]: component 1 moves uphill and is dropped; the
    # other three are kept and scaled by numel / kept = 4 / 3.
    expected = torch.ones(4) + torch.tensor([-0.1, 0.0, -0.3, 0.4]) * (4 / 3)
    torch.testing.assert_close(param.detach(), expected)
    assert param[1].item() == 1.0


def test_zero_gradient_components_are_masked_and_all_masked_means_no_update() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([0.0, 1.0, 0.0])
    optimizer = CautiousOptimizer(FixedUpdate([param], [torch.tensor([0.5, -0.5, 0.5])]))
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.tensor([1.0, 1.0 - 0.5 * 3, 1.0]))
    param.grad = torch.tensor([-1.0, -1.0, -1.0])  # every update component now goes uphill
    optimizer.base.updates = [torch.tensor([-0.5, -0.5, -0.5])]
    before = param.detach().clone()
    optimizer.step()
    assert torch.equal(param.detach(), before)


def two_step_grads() -> list[torch.Tensor]:
    # Step 2's second component flips sign but the momentum still points the old way.
    return [torch.tensor([1.0, 1.0]), torch.tensor([1.0, -0.01])]


def test_adamw_weight_decay_is_applied_outside_the_mask() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    lr, weight_decay = 0.1, 0.5
    optimizer = CautiousOptimizer(torch.optim.AdamW([param], lr=lr, weight_decay=weight_decay))
    for grad in two_step_grads():
        before = param.detach().clone()
        param.grad = grad
        optimizer.step()
    # The masked component got no Adam update but still decayed, as plain AdamW would decay it.
    torch.testing.assert_close(param[1].detach(), before[1] * (1 - lr * weight_decay))
    assert param[0].item() < before[0].item() * (1 - lr * weight_decay)  # kept: moved downhill
    assert optimizer.param_groups[0]["weight_decay"] == weight_decay  # restored after the step


def test_third_party_optimizer_mask_sees_the_decay_too() -> None:
    # torch's SGD is not one of the optimizers whose decay the wrapper knows how to separate:
    # its weight decay is part of the update the mask inspects (the documented caveat).
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = CautiousOptimizer(torch.optim.SGD([param], lr=0.1, weight_decay=0.5))
    param.grad = torch.tensor([1.0, -0.01])
    optimizer.step()
    # update = -0.1 * (grad + 0.5 * p) = [-0.15, -0.049]; component 1 (decay included) goes
    # uphill relative to the gradient and is dropped whole; component 0 is doubled.
    torch.testing.assert_close(param.detach(), torch.tensor([1.0 - 0.3, 1.0]))


def make_model(seed: int = 0) -> ReferenceTransformer:
    torch.manual_seed(seed)
    return ReferenceTransformer(vocab_size=64, max_seq_len=16, n_layer=1, n_head=2, d_model=32)


def loss_of(model: ReferenceTransformer, step: int) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
    return model(ids, labels=ids.roll(-1, dims=1))["loss"]


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_configured_cautious_step_is_the_base_step_masked(name: str) -> None:
    config = OptimizerConfig(name=name, cautious=True, weight_decay=0.0, lr=1e-2)
    cautious_model, plain_model = make_model(), make_model()
    cautious = build_optimizer(cautious_model, config, CPU)
    assert isinstance(cautious, CautiousOptimizer)
    assert isinstance(cautious.base, CombinedOptimizer if name == "muon" else torch.optim.AdamW)
    plain = build_optimizer(plain_model, OptimizerConfig(name=name, weight_decay=0.0, lr=1e-2), CPU)
    before = [p.detach().clone() for p in cautious_model.parameters()]
    for model in (cautious_model, plain_model):
        loss_of(model, 0).backward()
    cautious.step()
    plain.step()
    masked_somewhere = False
    for old, c, p in zip(
        before, cautious_model.parameters(), plain_model.parameters(), strict=True
    ):
        delta = p.detach() - old
        keep = delta * p.grad < 0
        masked_somewhere |= bool((~keep).any())
        expected = old + delta * keep / keep.float().mean().clamp_min(1e-3)
        torch.testing.assert_close(c.detach(), expected, rtol=1e-5, atol=1e-7)
    if name == "muon":
        assert masked_somewhere  # orthogonalised updates do disagree with some grad signs


def test_grad_scaler_and_lambda_lr_drive_the_wrapper() -> None:
    config = OptimizerConfig(cautious=True, lr=1e-2)
    scaled_model, plain_model = make_model(), make_model()
    scaled = build_optimizer(scaled_model, config, CPU)
    plain = build_optimizer(plain_model, config, CPU)
    schedules = [build_scheduler(o, SchedulerConfig(warmup_steps=3), 10) for o in (scaled, plain)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    assert scaler.is_enabled()
    for step in range(3):
        scaler.scale(loss_of(scaled_model, step)).backward()
        scaler.unscale_(scaled)
        scaler.step(scaled)
        scaler.update()
        loss_of(plain_model, step).backward()
        plain.step()
        for optimizer, schedule in zip((scaled, plain), schedules, strict=True):
            optimizer.zero_grad()
            schedule.step()
    assert scaled.param_groups[0]["lr"] == pytest.approx(1e-2)  # warmup done, through the wrapper
    for a, b in zip(scaled_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    before = [p.detach().clone() for p in scaled_model.parameters()]
    scaled_model.norm.weight.grad = torch.full_like(scaled_model.norm.weight, float("nan"))
    scaler.step(scaled)  # an overflow skips the step
    assert all(torch.equal(a, b) for a, b in zip(before, scaled_model.parameters(), strict=True))


def test_state_dict_is_the_base_optimizers_and_reset_reaches_it() -> None:
    model = make_model()
    cautious = build_optimizer(model, OptimizerConfig(cautious=True), CPU)
    loss_of(model, 0).backward()
    cautious.step()
    state = cautious.state_dict()
    assert state.keys() == {"state", "param_groups"}
    plain = build_optimizer(make_model(), OptimizerConfig(), CPU)
    plain.load_state_dict(state)  # switching cautious off (or on) keeps the checkpoint usable
    assert len(plain.state) == len(cautious.state) > 0
    reset_optimizer_state(cautious)
    assert len(cautious.base.state) == 0


@pytest.mark.parametrize("cautious", [True, False])
def test_trainer_wraps_a_third_party_optimizer_when_the_config_asks(cautious: bool) -> None:
    from core.toy_runs import Bigram, toy_trainer

    from speedtronic import SpeedtronicConfig

    config = SpeedtronicConfig.from_dict(
        {
            "run": {"device": "cpu", "max_steps": 2},
            "optimizer": {"cautious": cautious},
            "checkpoint": {"save_final": False},
        }
    )
    model = Bigram()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = toy_trainer(model, config, optimizer=sgd)
    if cautious:
        assert isinstance(trainer.optimizer, CautiousOptimizer) and trainer.optimizer.base is sgd
    else:
        assert trainer.optimizer is sgd
    trainer.fit()
    assert trainer.step == 2
    # An optimizer the caller already wrapped is not wrapped twice.
    wrapped = CautiousOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert toy_trainer(model, config, optimizer=wrapped).optimizer is wrapped
