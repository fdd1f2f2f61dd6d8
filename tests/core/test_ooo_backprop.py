"""Out-of-order backprop: the deferred weight gradients equal autograd's, wherever they are
drained, and the trainer drains them before anything reads ``.grad``."""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from core.toy_runs import TINY_TRANSFORMER, EventRecorder, merge_sections, toy_trainer
from torch import nn

from speedtronic import ConfigError, SpeedtronicConfig, SpeedtronicError
from speedtronic.engine import ooo_backprop as ooo
from speedtronic.engine.ooo_backprop import OOOBackprop, install_ooo_backprop
from speedtronic.engine.parts import build_parts
from speedtronic.engine.train_step import TrainStep
from speedtronic.engine.trainer import Trainer
from speedtronic_models import ReferenceTransformer

TOL = 1e-6
SMALL = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 2, "n_head": 2, "n_kv_head": 1}


def reference(**overrides: Any) -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(**{**SMALL, "d_model": 32, **overrides})


def tokens(seed: int, batch: int = 3, seq: int = 16, vocab: int = 64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def queue_for(stream: str) -> OOOBackprop:
    """A ``same`` queue (products one layer behind, the default), a ``held`` one (every
    product waits for the drain), or a ``side`` queue whose streams are torch.cpu's (no-ops):
    the side path's buffers and their hand-over to ``.grad`` run on CPU too."""
    if stream == "side":
        return OOOBackprop("cpu", "side", stream_api=torch.cpu)
    return OOOBackprop("cpu", "same", window=None if stream == "held" else 1)


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_grads(got: nn.Module, want: nn.Module, tol: float = TOL) -> None:
    for (name, g), (_, w) in zip(grads(got).items(), grads(want).items()):
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.dtype == w.dtype, name
            assert torch.allclose(g, w, rtol=0, atol=tol), (name, (g - w).abs().max())


def backward_both(
    model: nn.Module,
    stream: str,
    losses: Callable[[nn.Module], list[torch.Tensor]] | None = None,
    flush_between: bool = True,
) -> tuple[nn.Module, nn.Module, OOOBackprop]:
    """Backward over one micro-batch (or several, from ``losses``) with plain autograd on
    ``model`` and with OOO on a copy; returns (plain, ooo copy, its drained queue)."""
    losses = losses or (lambda m: [m(**tokens(1))["loss"]])
    swapped = copy.deepcopy(model)
    queue = queue_for(stream)
    assert queue.install(swapped) > 0
    for loss in losses(model):
        loss.backward()
    for index, loss in enumerate(parts := losses(swapped)):
        loss.backward()
        if flush_between and index < len(parts) - 1:
            queue.flush()
    queue.drain()
    assert queue.pending == 0
    return model, swapped, queue


STREAMS = pytest.mark.parametrize("stream", ["same", "held", "side"])


@STREAMS
def test_reference_model_gradients_equal_autograd(stream: str) -> None:
    plain, swapped, _ = backward_both(reference(), stream)
    assert_same_grads(swapped, plain)


def test_the_swap_keeps_types_keys_and_parameters_and_is_removable() -> None:
    model = reference()
    keys, params = list(model.state_dict()), list(model.parameters())
    queue = OOOBackprop("cpu", "same")
    assert queue.install(model) == 8  # qkv, out, gate_up, down per block
    qkv = model.blocks[0].attn.qkv
    assert type(qkv) is nn.Linear and "forward" in qkv.__dict__
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    model(**tokens(1))["loss"].backward()
    assert qkv.weight.grad is None and queue.pending  # queued, not yet in .grad
    queue.remove()  # drains first
    assert qkv.weight.grad is not None and queue.pending == 0
    assert "forward" not in qkv.__dict__ and queue.modules == []


@pytest.mark.parametrize(("window", "waiting"), [(0, 0), (1, 1), (2, 2), (None, 3)])
def test_same_mode_products_wait_at_most_window_layer_calls(
    window: int | None, waiting: int
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    queue = OOOBackprop("cpu", "same", window=window)
    queue.install(model)
    model(torch.randn(3, 4)).sum().backward()
    assert queue.pending == waiting
    # the first layer's call is the last to backward: it waits whenever anything does
    assert (model[0].weight.grad is None) == (waiting > 0)
    queue.drain()
    assert queue.pending == 0 and all(p.grad is not None for p in model.parameters())


def test_copies_of_a_swapped_model_run_plain_autograd() -> None:
    model = reference()
    queue = OOOBackprop("cpu", "same")
    queue.install(model)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        twin(**tokens(1))["loss"].backward()
        assert all(p.grad is not None for p in twin.parameters())
    assert queue.pending == 0  # the copies never fed the original's queue


class BiasAndFrozen(nn.Module):
    """Linears with biases, a frozen layer, a frozen bias, and raw (grad-free) inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 8)  # its input needs no gradient: dW must still happen
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.frozen_bias = nn.Linear(8, 8)
        self.frozen_bias.bias.requires_grad_(False)
        self.last = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = torch.tanh(self.frozen_bias(torch.tanh(self.frozen(h))))
        return self.last(h).pow(2).mean()


@STREAMS
def test_biases_and_frozen_layers(stream: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bool, bool]] = []
    products = ooo._weight_products

    def counting(grad_out: Any, x: Any, want_weight: bool, want_bias: bool) -> Any:
        calls.append((want_weight, want_bias))
        return products(grad_out, x, want_weight, want_bias)

    monkeypatch.setattr(ooo, "_weight_products", counting)
    x = torch.randn(5, 4, 6)
    plain, swapped, _ = backward_both(BiasAndFrozen(), stream, lambda m: [m(x)])
    assert_same_grads(swapped, plain)
    assert swapped.frozen.weight.grad is None and swapped.frozen.bias.grad is None
    assert swapped.frozen_bias.bias.grad is None
    # last, frozen_bias (weight only), first; the frozen layer queues nothing at all
    assert sorted(calls) == sorted([(True, True), (True, False), (True, True)])


@STREAMS
@pytest.mark.parametrize("flush_between", [True, False])
def test_accumulation_of_four_micro_batches(stream: str, flush_between: bool) -> None:
    def four(model: nn.Module) -> list[torch.Tensor]:
        return [model(**tokens(seed))["loss"] / 4 for seed in range(4)]

    plain, swapped, _ = backward_both(reference(), stream, four, flush_between)
    assert_same_grads(swapped, plain)


@STREAMS
def test_accumulation_adds_to_existing_grads_like_autograd(stream: str) -> None:
    def with_grads(model: nn.Module) -> list[torch.Tensor]:
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)  # deepcopy does not copy .grad
        return [model(**tokens(1))["loss"]]

    plain, swapped, _ = backward_both(reference(), stream, with_grads)
    assert_same_grads(swapped, plain)


@STREAMS
def test_gradient_checkpointing(stream: str) -> None:
    want = reference()
    want(**tokens(1))["loss"].backward()
    model = reference()
    model.set_gradient_checkpointing(True)
    model.train()
    _, swapped, _ = backward_both(model, stream)
    assert_same_grads(swapped, want)


class TiedAndShared(nn.Module):
    """An nn.Linear head tied to the embedding (autograd accumulates the same weight too), and
    one weight used by two linears and by one of them twice."""

    def __init__(self, vocab: int = 64, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vocab_size = vocab
        self.embed = nn.Embedding(vocab, width)
        self.a = nn.Linear(width, width, bias=False)
        self.b = nn.Linear(width, width, bias=False)
        self.b.weight = self.a.weight
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        h = torch.tanh(self.b(torch.tanh(self.a(self.a(h)))))
        logits = self.head(h)
        return {"loss": F.cross_entropy(logits.view(-1, self.vocab_size), labels.reshape(-1))}


@STREAMS
def test_tied_embeddings_and_shared_weights(stream: str) -> None:
    plain, swapped, queue = backward_both(TiedAndShared(), stream)
    assert swapped.head.weight is swapped.embed.weight and len(queue.modules) == 3
    assert_same_grads(swapped, plain)


@STREAMS
def test_reference_model_with_tied_embeddings_and_accumulation(stream: str) -> None:
    # The reference head is F.linear(x, tok_emb.weight): autograd's part of the tied matrix
    # meets the deferred products only through the rest of the graph; checked all the same.
    def two(model: nn.Module) -> list[torch.Tensor]:
        return [model(**tokens(seed))["loss"] / 2 for seed in (3, 4)]

    plain, swapped, _ = backward_both(reference(), stream, two)
    assert swapped.output_weight is swapped.tok_emb.weight
    assert_same_grads(swapped, plain)


def test_autograd_grad_and_backward_inputs_get_what_they_ask_for() -> None:
    model = BiasAndFrozen()
    swapped = copy.deepcopy(model)
    queue = OOOBackprop("cpu", "same")
    queue.install(swapped)
    x = torch.randn(5, 6, requires_grad=True)
    # torch.autograd.grad with respect to a weight: computed at once, nothing deferred
    want = torch.autograd.grad(model(x), [model.last.weight, model.first.bias])
    got = torch.autograd.grad(swapped(x), [swapped.last.weight, swapped.first.bias])
    assert queue.pending == 0
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=0, atol=TOL)
    # backward(inputs=[x]): no weight product at all
    swapped(x).backward(inputs=[x])
    assert queue.pending == 0 and swapped.last.weight.grad is None
    # a plain forward under no_grad does not touch the queue
    with torch.no_grad():
        swapped(x)
    assert queue.pending == 0


def test_bf16_autocast_gives_the_dtypes_autograd_gives() -> None:
    x = torch.randn(5, 4, 6)
    for cast_model in (False, True):
        model = BiasAndFrozen()
        if cast_model:  # bf16 parameters: bf16 gradients
            model = model.to(torch.bfloat16)

        def under_autocast(m: nn.Module) -> list[torch.Tensor]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return [m(x.to(next(m.parameters()).dtype))]

        plain, swapped, _ = backward_both(model, "same", under_autocast)
        for (name, g), (_, w) in zip(grads(swapped).items(), grads(plain).items()):
            assert (g is None) == (w is None), name
            if w is not None:
                assert g.dtype == w.dtype == next(model.parameters()).dtype, name
                assert torch.allclose(g.float(), w.float(), rtol=2e-2, atol=1e-3), name


# ---------------------------------------------------------------------------- the trainer
def trainer_config(tmp_path: Any, enabled: bool, **sections: Any) -> SpeedtronicConfig:
    config: dict[str, Any] = {
        "run": {"seed": 0, "device": "cpu", "max_steps": 20, "output_dir": str(tmp_path)},
        "data": {"micro_batch_size": 2, "target_batch_size": 4},
        "optimizer": {"lr": 3e-3, "grad_clip": 0.5},
        "scheduler": {"warmup_steps": 2},
        "precision": {"mode": "fp32"},
        "checkpoint": {"interval": 0, "save_final": False},
        "logging": {"log_every": 1, "progress": False},
        "ooo_backprop": {"enabled": enabled, "stream": "same"},
    }
    return SpeedtronicConfig.from_dict(merge_sections(config, sections))


def tiny_model() -> ReferenceTransformer:
    torch.manual_seed(0)
    params = {k: v for k, v in TINY_TRANSFORMER.items() if k != "name"}
    return ReferenceTransformer(**params)


def fit(tmp_path: Any, enabled: bool, **sections: Any) -> tuple[EventRecorder, Trainer]:
    recorder = EventRecorder()
    torch.manual_seed(0)
    trainer = toy_trainer(tiny_model(), trainer_config(tmp_path, enabled, **sections), [recorder])
    trainer.fit()
    return recorder, trainer


def test_a_twenty_step_training_curve_equals_the_plain_one(tmp_path: Any) -> None:
    plain, _ = fit(tmp_path / "plain", False)
    swapped, trainer = fit(tmp_path / "ooo", True)
    assert trainer.ooo_backprop is not None and len(trainer.ooo_backprop.modules) == 4
    assert len(plain.losses) == len(swapped.losses) == 20
    for step, loss in plain.losses.items():
        assert abs(swapped.losses[step] - loss) <= 1e-5, step
    for want, got in zip(plain.named("step"), swapped.named("step")):
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5


def test_gradient_checkpointing_through_the_trainer(tmp_path: Any) -> None:
    plain, _ = fit(tmp_path / "plain", False, run={"max_steps": 3})
    swapped, _ = fit(tmp_path / "ooo", True, run={"max_steps": 3}, gradient_checkpointing=True)
    for step, loss in plain.losses.items():
        assert abs(swapped.losses[step] - loss) <= 1e-5


def test_the_queue_is_drained_before_clipping(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clipping sees complete gradients; without the drain points it would see the swapped
    weights' gradients missing, and the optimizer guard stops the step."""
    seen: list[tuple[int, float]] = []
    clip = torch.nn.utils.clip_grad_norm_
    trainers: list[Trainer] = []

    def spying_clip(params: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = list(params)
        queue = trainers[-1].ooo_backprop if trainers else None
        pending = queue.pending if queue is not None else 0
        norm = clip(params, max_norm, *args, **kwargs)
        seen.append((pending, float(norm)))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spying_clip)
    monkeypatch.setattr(Trainer, "_adopt", _recording_adopt(trainers))
    fit(tmp_path / "plain", False, run={"max_steps": 2})
    reference_norms = [norm for _, norm in seen]
    seen.clear()
    fit(tmp_path / "ooo", True, run={"max_steps": 2})
    assert [pending for pending, _ in seen] == [0, 0]
    assert [norm for _, norm in seen] == pytest.approx(reference_norms, abs=1e-6)

    seen.clear()
    monkeypatch.setattr(TrainStep, "drain_grads", lambda self, last=True: None)
    with pytest.raises(SpeedtronicError, match="not drained"):
        fit(tmp_path / "undrained", True, run={"max_steps": 2})
    pending, norm = seen[0]
    assert pending == 1  # the last layer call's products (one layer behind), still queued
    assert abs(norm - reference_norms[0]) > 1e-4  # so clipping saw a different gradient


def _recording_adopt(trainers: list[Trainer]) -> Callable[..., None]:
    adopt = Trainer._adopt

    def recording(self: Trainer, parts: Any) -> None:
        adopt(self, parts)
        trainers.append(self)

    return recording


def test_bf16_training_through_the_trainer(tmp_path: Any) -> None:
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no native bf16: precision.mode bf16 would run fp32")
    plain, _ = fit(tmp_path / "plain", False, run={"max_steps": 3}, precision={"mode": "bf16"})
    swapped, trainer = fit(tmp_path / "ooo", True, run={"max_steps": 3}, precision={"mode": "bf16"})
    assert trainer.precision.mode == "bf16"
    for step, loss in plain.losses.items():
        assert abs(swapped.losses[step] - loss) <= 1e-3


# ---------------------------------------------------------------------------- config
def test_compile_and_ooo_backprop_exclude_each_other(tmp_path: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict(
            {"compile": {"enabled": True}, "ooo_backprop": {"enabled": True}}
        )
    assert "compile.enabled" in str(caught.value) and "ooo_backprop.enabled" in str(caught.value)
    config = SpeedtronicConfig.from_dict({"ooo_backprop": {"enabled": True}})
    assert config.ooo_backprop.stream == "side" and config.ooo_backprop.modules == "linear"
    config.compile.enabled = True  # changed in place: the composition root checks again
    with pytest.raises(ConfigError, match=r"compile\.enabled.*ooo_backprop\.enabled"):
        build_parts(config, nn.Linear(2, 2), data=[])


def test_bad_values_name_their_keys() -> None:
    with pytest.raises(ConfigError, match=r"ooo_backprop\.stream"):
        SpeedtronicConfig.from_dict({"ooo_backprop": {"stream": "other"}})
    with pytest.raises(ConfigError, match=r"ooo_backprop\.modules"):
        SpeedtronicConfig.from_dict({"ooo_backprop": {"modules": "conv"}})


def test_off_cuda_it_warns_once_and_runs_on_the_same_device(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ooo, "_warned", set())
    section = SpeedtronicConfig.from_dict({"ooo_backprop": {"enabled": True}}).ooo_backprop
    with caplog.at_level(logging.WARNING, logger="speedtronic.ooo_backprop"):
        queues = [install_ooo_backprop(reference(), section, torch.device("cpu")) for _ in "ab"]
    assert [q.mode for q in queues if q is not None] == ["same", "same"]
    warnings = [r for r in caplog.records if "CUDA-only" in r.getMessage()]
    assert len(warnings) == 1
    disabled = SpeedtronicConfig.from_dict({}).ooo_backprop
    assert install_ooo_backprop(reference(), disabled, torch.device("cpu")) is None
