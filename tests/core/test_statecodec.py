"""The pickle-free state codec round-trips real training state exactly."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load, save
from torch import nn

from speedtronic.checkpoint import statecodec
from speedtronic.checkpoint.statecodec import StateDecodeError


def roundtrip(tree: Any) -> Any:
    """Encode, go through real JSON text and safetensors bytes, decode."""
    json_tree, tensors = statecodec.encode(tree)
    text = json.dumps(json_tree, allow_nan=False)
    return statecodec.decode(json.loads(text), load(save(tensors)))


def assert_same(a: Any, b: Any, where: str = "root") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x))).logsumexp(-1).mean()


def trained() -> tuple[Tied, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    model = Tied()
    params = [p for n, p in model.named_parameters()]
    names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.AdamW(
        [
            {"params": params[:1], "param_names": names[:1], "weight_decay": 0.1, "group": "decay"},
            {"params": params[1:], "param_names": names[1:], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        model(torch.randint(0, 11, (2, 5))).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


def test_adamw_state_dict_roundtrips_exactly() -> None:
    _, optimizer, _ = trained()
    state = optimizer.state_dict()
    assert any(isinstance(k, int) for k in state["state"])  # int keys, 'step' tensors
    assert isinstance(state["param_groups"][0]["betas"], tuple)
    back = roundtrip(state)
    assert_same(state, back)
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert back["state"][0]["step"].dim() == 0


def test_restored_optimizer_continues_identically() -> None:
    model, optimizer, scheduler = trained()
    saved = roundtrip(
        {
            "model": model.state_dict(),
            "opt": optimizer.state_dict(),
            "sched": scheduler.state_dict(),
        }
    )
    clone = Tied()
    clone_opt = torch.optim.AdamW(
        [
            {"params": [clone.emb.weight], "param_names": ["emb.weight"], "weight_decay": 0.1},
            {"params": list(clone.norm.parameters()), "param_names": ["a", "b"]},
        ],
        lr=1.0,
        betas=(0.5, 0.5),
    )
    clone_sched = torch.optim.lr_scheduler.LambdaLR(clone_opt, lambda s: 1.0 / (s + 1))
    clone.load_state_dict(saved["model"])
    clone_opt.load_state_dict(saved["opt"])
    clone_sched.load_state_dict(saved["sched"])
    batch = torch.randint(0, 11, (2, 5))
    for m, o, s in ((model, optimizer, scheduler), (clone, clone_opt, clone_sched)):
        m(batch).backward()
        o.step()
        s.step()
    for a, b in zip(model.state_dict().values(), clone.state_dict().values()):
        assert torch.equal(a, b)
    assert clone_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_lambdalr_and_grad_scaler_state() -> None:
    _, _, scheduler = trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for state in (scheduler.state_dict(), scaler.state_dict()):
        assert_same(state, roundtrip(state))


def test_rng_states_restore_the_same_random_streams() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in the NumPy state
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    expected = (random.random(), np.random.standard_normal(3), torch.rand(3))
    back = roundtrip(state)
    assert_same(state, back)
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    torch.set_rng_state(back["torch"])
    assert random.random() == expected[0]
    assert np.array_equal(np.random.standard_normal(3), expected[1])
    assert torch.equal(torch.rand(3), expected[2])


def test_tied_weights_are_stored_once_and_come_back_tied() -> None:
    state = Tied().state_dict()
    _, tensors = statecodec.encode(state)
    assert len(tensors) == len(state) - 1  # head.weight is emb.weight
    back = roundtrip(state)
    assert back["head.weight"] is back["emb.weight"]
    clone = Tied()
    clone.load_state_dict(back)
    assert clone.head.weight is clone.emb.weight
    assert torch.equal(clone.emb.weight, state["emb.weight"])


def test_module_state_dict_keeps_its_version_metadata() -> None:
    state = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).state_dict()
    back = roundtrip(state)
    assert isinstance(back, OrderedDict)
    assert back._metadata == state._metadata  # type: ignore[attr-defined]
    assert back._metadata["1"]["version"] == 2  # type: ignore[attr-defined]


def test_overlapping_views_are_copied_apart_for_safetensors() -> None:
    base = torch.arange(12.0)
    tree = {"whole": base, "head": base[:4], "strided": base.view(3, 4).t(), "again": base}
    _, tensors = statecodec.encode(tree)
    assert len(tensors) == 3  # "again" is the same view as "whole"
    back = roundtrip(tree)
    assert back["again"] is back["whole"]
    for key in ("whole", "head", "strided"):
        assert torch.equal(back[key], tree[key])


def test_dtypes_safetensors_lacks_travel_as_bytes() -> None:
    tree = {
        "u16": torch.tensor([0, 1, 60000], dtype=torch.uint16),
        "u32": torch.tensor(7, dtype=torch.uint32),
        "c128": torch.tensor([1 + 2j], dtype=torch.complex128),
        "empty": torch.empty(0, 3, dtype=torch.uint64),
        "bf16": torch.ones(2, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False]),
    }
    assert_same(tree, roundtrip(tree))


def test_plugin_style_state_with_awkward_values() -> None:
    tree = {
        "coordinator": {
            "outer_step": 4,
            "node": "node-a",
            "pending": None,
            "ok": True,
            "baseline": {"w": torch.randn(3), "nested": [torch.zeros(2), {"k": 1}]},
        },
        "floats": [1.5, float("inf"), float("-inf"), float("nan"), 0.1 + 0.2],
        "bytes": b"\x00\xffabc",
        "dtype": torch.bfloat16,
        "keys": {(1, "a"): "tuple key", 2.5: "float key", None: "none key", False: 0},
        "array": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_scalars": [np.float32(1.25), np.int64(3), np.bool_(True)],
        "looks_like_a_marker": {"__tensor__": "x", "__tuple__": [1]},
        "size": torch.Size([2, 3]),
    }
    back = roundtrip(tree)
    expected = dict(tree, np_scalars=[1.25, 3, True], size=(2, 3))
    assert_same(expected, back)


def test_unserialisable_objects_are_refused_with_their_path() -> None:
    with pytest.raises(TypeError, match=r"coordinator\.lock"):
        statecodec.encode({"coordinator": {"lock": object()}})
    with pytest.raises(TypeError, match="object"):
        statecodec.encode({"a": np.array([object()])})


@pytest.mark.parametrize(
    "json_tree",
    [
        {"x": {"__ndarray__": "AAAA", "dtype": "|O", "shape": [1]}},  # object array
        {"x": {"__dtype__": "__import__"}},
        {"x": {"__dtype__": "Tensor"}},
        {"x": {"__tensor__": "nope"}},
        {"x": {"__tensor__": "t", "__tuple__": []}},
        {"x": {"__keyed__": [[1]]}},
        {"x": {"__float__": "1e400"}},
    ],
)
def test_decode_rejects_crafted_trees(json_tree: Any) -> None:
    with pytest.raises(StateDecodeError):
        statecodec.decode(json_tree, {"t": torch.zeros(1)})
