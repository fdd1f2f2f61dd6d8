"""The whole-tensor view rank 0 of an FSDP group hands its coordinator
(:mod:`speedtronic_diloco.node.sharded`): the model's state-dict keys, read and installed like a
model's. The group itself runs as real torchrun processes in tests/e2e/test_diloco_fsdp_group.py."""

from __future__ import annotations

import torch
from diloco_runs import TINY_MODEL

from speedtronic_diloco.node.sharded import FullStateView
from speedtronic_diloco.tensors import compute_pseudo_gradient, cpu_state_dict, install_state
from speedtronic_models import ReferenceTransformer


def test_the_view_has_the_models_keys_and_takes_installs_like_it() -> None:
    params = {k: v for k, v in TINY_MODEL.items() if k != "name"}
    model = ReferenceTransformer.from_params(params)
    full = cpu_state_dict(model.state_dict())
    view = FullStateView(cpu_state_dict(full))  # its own tensors, as a gather gives
    assert list(view.state_dict()) == list(full)
    for name, tensor in view.state_dict().items():
        assert torch.equal(tensor, full[name]), name
    # The coordinator installs a global into the view; the group then reads it back whole.
    shifted = {k: v + 1 if v.is_floating_point() else v for k, v in full.items()}
    assert view.writes == 0
    installed, skipped = install_state(view, shifted)
    assert view.writes == 1  # what tells the group its shards need the view's weights
    assert sorted(installed) == sorted(full) and skipped == []
    for name, tensor in view.state_dict().items():
        assert torch.equal(tensor, shifted[name]), name
    # A later gather replaces the view's tensors: the next delta is measured from them.
    view.replace(cpu_state_dict(full))
    assert view.writes == 1  # a gather is not an install
    delta = compute_pseudo_gradient(shifted, view.state_dict())
    assert all(torch.allclose(d, torch.ones_like(d)) for d in delta.values())
    assert not list(view.parameters())  # no parameters: nothing trains on it
