"""Fewer bytes per round (issue 17) through the real coordinator and outer loop: mixed codecs in
one round, corrupt compressed deltas rejected by file name, signed compressed deltas, error
feedback across uploads, failures, checkpoints and the reset rule, bf16 globals, streaming
fragments against a hand computation, and (slow) a master and two workers as processes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import MemoryTransport, dist_config, make_master, make_net, nudge
from safetensors.torch import load as load_bytes

from speedtronic_diloco.codecs import CodecSpec, decode_delta, encode_delta
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.fragments import FragmentLayout, fragment_metadata
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.master.round import nesterov_step
from speedtronic_diloco.signing import sign_file
from speedtronic_diloco.tensors import cpu_state_dict, load_tensors, save_tensors
from speedtronic_diloco.transports import GLOBAL_WEIGHTS, TransientTransportError, delta_path

KEY = b"test-key-0123456789"


def weights() -> dict[str, torch.Tensor]:
    return cpu_state_dict(make_net().state_dict())


def floating() -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights().items() if v.is_floating_point()}


def random_delta(seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in floating().items()}


def put(
    store: MemoryTransport,
    tmp_path: Path,
    node: str,
    step: int,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str] | None = None,
    key: bytes | None = None,
) -> None:
    fields = {"node_id": node, "local_step": str(step), "base_outer_step": "0", **(meta or {})}
    path = save_tensors(tmp_path / "up" / f"{node}_{step}.safetensors", tensors, fields)
    if key is not None:
        sign_file(path, key)
    store.upload_delta(node, step, path)


def make_loop(
    store: MemoryTransport,
    tmp_path: Path,
    events: list | None = None,
    lr: float = 0.7,
    momentum: float = 0.0,
    **rules: Any,
) -> MasterOuterLoop:
    return make_master(
        store, tmp_path, lr=lr, momentum=momentum, events=events, rules=rules, start=weights()
    )


# --------------------------------------------------------------------------- the master
def test_mixed_codecs_in_one_round_average_what_each_node_sent(tmp_path: Path) -> None:
    store = MemoryTransport()
    events: list = []
    loop = make_loop(store, tmp_path, events, outlier_policy="off")
    sent = {}
    for index, codec in enumerate(["none", "bf16", "int8", "int4"]):
        delta = random_delta(index)
        tensors, meta = encode_delta(
            delta, CodecSpec(codec, 8, "bf16" if codec == "int4" else "fp32")
        )
        put(store, tmp_path, f"n{index}", 10, tensors, meta)
        sent[f"n{index}"] = decode_delta(tensors, meta)
    result = loop.run_round()
    assert result is not None and result.deltas_included == 4 and not result.rejected
    mean = {
        name: torch.stack([sent[n][name].to(torch.float64) for n in sent]).mean(0)
        for name in floating()
    }
    expected, _ = nesterov_step(floating(), mean, {}, 0.7, 0.0)
    assert loop.global_state is not None
    for name, value in expected.items():
        assert loop.global_state[name].dtype == torch.float32  # the model's dtype
        assert torch.allclose(loop.global_state[name], value, atol=1e-7), name
    round_event = next(p for e, p in events if e == "outer_step")
    sizes = [len(store.files[delta_path(f"n{i}", 10)]) for i in range(4)]
    assert round_event["bytes_received"] == sum(sizes)


def corrupt_int8(delta: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    tensors, meta = encode_delta(delta, CodecSpec("int8", 4))
    name = next(n for n in tensors if n.endswith("::scale"))
    tensors[name] = tensors[name][:-1].clone()  # one block scale short
    return tensors, meta


def test_a_corrupt_compressed_delta_is_rejected_with_its_file_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryTransport()
    events: list = []
    loop = make_loop(store, tmp_path, events)
    good, meta = encode_delta(random_delta(1), CodecSpec("int8"))
    put(store, tmp_path, "good", 4, good, meta)
    put(store, tmp_path, "bad", 4, *corrupt_int8(random_delta(2)))
    unknown, unknown_meta = encode_delta(random_delta(3), CodecSpec("int4"))
    put(store, tmp_path, "odd", 4, unknown, {**unknown_meta, "codec": "int3"})
    with caplog.at_level(logging.ERROR, "speedtronic.diloco.outer"):
        result = loop.run_round()
    assert result is not None and result.included == (("good", 4),)
    assert set(result.rejected) == {("bad", 4), ("odd", 4)}
    assert set(result.reasons) == {"codec"}
    for node, message in [("bad", "scales, expected"), ("odd", "unknown codec 'int3'")]:
        path = delta_path(node, 4)
        assert any(path in r.getMessage() and message in r.getMessage() for r in caplog.records)
        rejected = next(p for e, p in events if e == "delta_rejected" and p["node"] == node)
        assert path in rejected["message"] and rejected["reason"] == "codec"
    assert not list((tmp_path / "cache" / "deltas").rglob("*.decoded"))  # nothing left behind
    again = loop.run_round()
    assert again is None  # processed: not fetched again


def test_signed_compressed_deltas(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path, signing_key=KEY)
    tensors, meta = encode_delta(random_delta(1), CodecSpec("int4"))
    put(store, tmp_path, "signed", 2, tensors, meta, key=KEY)
    put(store, tmp_path, "unsigned", 2, tensors, meta)
    put(store, tmp_path, "forged", 2, tensors, meta, key=b"another-key-123456")
    result = loop.run_round()
    assert result is not None and result.included == (("signed", 2),)
    assert dict(zip(result.rejected, result.reasons)) == {
        ("unsigned", 2): "unsigned",
        ("forged", 2): "bad_signature",
    }
    # The same signed bytes under another name: the signed node and step give it away.
    store.files[delta_path("again", 4)] = store.files[delta_path("signed", 2)]
    replay = loop.run_round()
    assert replay is not None and replay.reasons == ("name_mismatch",)


# --------------------------------------------------------------------------- the node
def published_worker(
    tmp_path: Path, store: MemoryTransport, **config: Any
) -> DumbDiLoCoCoordinator:
    store.publish_state(weights(), 0, tmp_path)
    worker = DumbDiLoCoCoordinator(
        dist_config(**config), make_net(), hub=store, state_dir=tmp_path / "w"
    )
    worker.start()
    return worker


def test_worker_uploads_int8_with_error_feedback_and_byte_metrics(tmp_path: Path) -> None:
    store = MemoryTransport()
    events: list = []
    worker = published_worker(tmp_path, store, compression="int8", compression_block=4)
    worker._emit_to = lambda e, p: events.append((e, p))
    model = worker.model
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            ramp = torch.linspace(-0.01, 0.013, param.numel()).reshape(param.shape)
            param.add_(ramp * (index + 1))
    worker.after_optimizer_step(model, 1)
    worker.after_optimizer_step(model, 2)
    raw = store.files[delta_path("w1", 2)]
    tensors = load_bytes(raw)
    meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    assert meta["codec"] == "int8" and meta["codec_block"] == "4"
    assert tensors["a.weight"].dtype == torch.int8
    uploaded = next(p for e, p in events if e == "delta_uploaded")
    assert uploaded["bytes_sent"] == len(raw) == worker.bytes_sent
    assert uploaded["codec"] == "int8" and 0 < uploaded["compression_error"] < 0.05
    residual = dict(worker._feedback.residual)
    assert residual and all(v.dtype == torch.float32 for v in residual.values())
    # The decoded delta plus the residual is exactly what the node moved.
    moved = {k: v for k, v in worker.state_dict()["baseline"].items() if k in residual}
    decoded = decode_delta(tensors, meta)
    initial = weights()
    for name in residual:
        assert torch.allclose(decoded[name] + residual[name], initial[name] - moved[name])

    # A failed upload leaves the residual as it was (that progress is sent again).
    store.fail("upload_delta", TransientTransportError("down"), times=3)
    nudge(model)
    worker.after_optimizer_step(model, 3)
    worker.after_optimizer_step(model, 4)
    assert delta_path("w1", 4) not in store.files
    assert all(torch.equal(worker._feedback.residual[k], residual[k]) for k in residual)

    # Checkpoints carry the residual; a resumed node continues with it.
    state = worker.state_dict()
    assert set(state["error_feedback"]["residual"]) == set(residual)
    worker.stop()
    resumed = DumbDiLoCoCoordinator(
        dist_config(compression="int8", compression_block=4),
        make_net(),
        hub=store,
        state_dir=tmp_path / "w",
    )
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed._feedback.residual[k], residual[k]) for k in residual)


def test_the_residual_survives_the_next_global_but_not_a_jump(tmp_path: Path) -> None:
    store = MemoryTransport()
    worker = published_worker(tmp_path, store, compression="int4", max_staleness=16)
    model = worker.model
    nudge(model)
    worker.after_optimizer_step(model, 1)
    worker.after_optimizer_step(model, 2)
    assert worker._feedback.residual and worker.last_global_step == 0
    store.publish_state(weights(), 1, tmp_path)  # the next round: kept
    nudge(model, 0.0123)
    worker.after_optimizer_step(model, 3)
    worker.after_optimizer_step(model, 4)
    assert worker.last_global_step == 1 and worker._feedback.residual
    kept = dict(worker._feedback.residual)
    store.publish_state(weights(), 1 + 17, tmp_path)  # 17 > max_staleness outer steps ahead
    worker.after_optimizer_step(model, 5)
    nudge(model)
    worker.after_optimizer_step(model, 6)  # uploads (with the kept residual), then installs
    assert worker.last_global_step == 18
    assert worker._feedback.residual == {}
    assert kept


def test_compression_none_writes_exactly_todays_delta(tmp_path: Path) -> None:
    store = MemoryTransport()
    worker = published_worker(tmp_path, store)
    nudge(worker.model)
    worker.after_optimizer_step(worker.model, 2)
    tensors, meta = load_tensors_from(store.files[delta_path("w1", 2)], tmp_path)
    assert "codec" not in meta and "fragments" not in meta
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert worker._feedback.residual == {} and "error_feedback" not in worker.state_dict()


def load_tensors_from(raw: bytes, tmp_path: Path) -> tuple[dict, dict]:
    path = tmp_path / "read.safetensors"
    path.write_bytes(raw)
    return load_tensors(path)


def test_bf16_globals_are_published_small_and_installed_in_the_model_dtype(tmp_path: Path) -> None:
    store = MemoryTransport()
    master = DumbDiLoCoCoordinator(
        dist_config(role="master", node_id="m", global_compression="bf16"),
        make_net(),
        hub=store,
        state_dir=tmp_path / "m",
    )
    master.start()
    master.outer.stop()
    assert master.outer.publish() is not None
    published, meta = load_tensors_from(store.files[GLOBAL_WEIGHTS], tmp_path)
    assert published["a.weight"].dtype == torch.bfloat16 and meta["codec"] == "bf16"
    assert published["counter"].dtype == torch.long
    assert master.outer.global_state["a.weight"].dtype == torch.float32  # the master's own copy
    worker = DumbDiLoCoCoordinator(dist_config(), make_net(1), hub=store, state_dir=tmp_path / "w")
    worker.start()
    assert worker.last_global_step == 0
    for name, value in worker.model.state_dict().items():
        assert value.dtype == weights()[name].dtype
        assert torch.equal(value, published[name].to(value.dtype))
    assert worker.bytes_received == len(store.files[GLOBAL_WEIGHTS])
    worker.stop()
    master.stop()


# --------------------------------------------------------------------------- fragments
def test_fragments_match_a_hand_computation_node_and_master(tmp_path: Path) -> None:
    """TinyNet in two fragments ({a.*}, {b.*}), H = 4 (fragment 1 syncs at 2, 6; fragment 0 at
    4, 8), every step moves every weight by +0.01, outer lr 1, momentum 0.5. See the comments
    for each value."""
    store = MemoryTransport()
    loop = make_loop(store, tmp_path, lr=1.0, momentum=0.5, outlier_policy="off")
    layout = FragmentLayout.build(weights(), 2)
    assert layout.fragments == (("a.weight", "a.bias"), ("b.weight", "b.bias"))
    loop.keeper.set_fragments(layout)
    assert loop.publish() is not None
    worker = DumbDiLoCoCoordinator(
        dist_config(fragments=2, inner_steps=4), make_net(), hub=store, state_dir=tmp_path / "w"
    )
    worker.start()
    a0, b0 = weights()["a.weight"], weights()["b.weight"]

    def step(n: int) -> None:
        nudge(worker.model)
        worker.after_optimizer_step(worker.model, n)

    def model(name: str) -> torch.Tensor:
        return worker.model.state_dict()[name]

    step(1)
    step(2)  # fragment 1: b moved +0.02 -> delta -0.02
    tensors, meta = load_tensors_from(store.files[delta_path("w1", 2)], tmp_path)
    assert set(tensors) == {"b.weight", "b.bias"}
    assert {k: meta[k] for k in ("fragments", "fragment_count")} == {
        "fragments": "1",
        "fragment_count": "2",
    }
    assert torch.allclose(tensors["b.weight"], torch.full_like(b0, -0.02))
    loop.run_round()  # b: buf -0.02, update -0.03 -> b0 + 0.03; versions [0, 1]
    assert loop.keeper.fragment_steps == [0, 1] and loop.keeper.fragment_versions == [0, 1]
    step(3)
    step(4)  # fragment 0: a moved +0.04; global 1 has nothing new for a: nothing installed
    assert set(load_tensors_from(store.files[delta_path("w1", 4)], tmp_path)[0]) == {
        "a.weight",
        "a.bias",
    }
    assert torch.allclose(model("b.weight"), b0 + 0.04) and worker.last_global_step == 0
    loop.run_round()  # a: buf -0.04, update -0.06 -> a0 + 0.06; versions [2, 1]
    step(5)
    step(6)  # fragment 1: delta -0.04 (from b0 + 0.02), then b <- global 1's b0 + 0.03
    assert torch.allclose(model("b.weight"), b0 + 0.03)
    assert torch.allclose(model("a.weight"), a0 + 0.06 - 0.0)  # a still local
    assert torch.allclose(worker._baseline["b.weight"], b0 + 0.03)
    assert torch.allclose(worker._baseline["a.weight"], a0 + 0.04)  # advanced by its upload
    loop.run_round()  # b: buf 0.5 * -0.02 - 0.04 = -0.05, update -0.065 -> b0 + 0.095
    step(7)
    step(8)  # fragment 0: delta -0.04, then a <- global 2's a0 + 0.06
    assert torch.allclose(model("a.weight"), a0 + 0.06)
    assert torch.allclose(model("b.weight"), b0 + 0.05)  # b's local progress untouched
    loop.run_round()  # a: buf 0.5 * -0.04 - 0.04 = -0.06, update -0.07 -> a0 + 0.13
    g = loop.global_state
    assert torch.allclose(g["a.weight"], a0 + 0.13) and torch.allclose(g["b.weight"], b0 + 0.095)
    assert torch.allclose(loop.keeper.momentum["a.weight"], torch.full_like(a0, -0.06))
    assert torch.allclose(loop.keeper.momentum["b.weight"], torch.full_like(b0, -0.05))
    assert loop.outer_step == 4
    assert loop.keeper.fragment_steps == [2, 2] and loop.keeper.fragment_versions == [4, 3]
    info = store.metadata.extra["fragments"]
    assert info == {"count": 2, "layout": layout.fingerprint, "steps": [2, 2], "versions": [4, 3]}
    # The master's state file keeps the per-fragment counters.
    again = make_loop(store, tmp_path)
    assert again.keeper.fragment_steps == [2, 2] and again.keeper.fragment_versions == [4, 3]
    worker.stop()


def test_fragment_rounds_accept_whole_deltas_and_count_a_final_delta_once(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path, lr=1.0, momentum=0.0, outlier_policy="off")
    layout = FragmentLayout.build(weights(), 2)
    loop.keeper.set_fragments(layout)
    whole = random_delta(1)
    put(store, tmp_path, "old", 3, whole)  # no fragment metadata: covers both fragments
    put(store, tmp_path, "last", 3, whole, {**fragment_metadata([0, 1], layout), "final": "1"})
    only_b = {k: v for k, v in random_delta(2).items() if k.startswith("b.")}
    put(store, tmp_path, "frag", 3, only_b, fragment_metadata([1], layout))
    wrong = {**fragment_metadata([1], layout), "fragment_layout": "0" * 16}
    put(store, tmp_path, "alien", 3, only_b, wrong)
    before = dict(loop.global_state)
    result = loop.run_round()
    assert result is not None and result.deltas_included == 3
    assert sorted(result.included) == [("frag", 3), ("last", 3), ("old", 3)]
    assert dict(zip(result.rejected, result.reasons)) == {("alien", 3): "fragments"}
    assert loop.keeper.fragment_steps == [1, 1]
    for name in ("a.weight", "a.bias"):  # fragment 0: the two whole deltas
        assert torch.allclose(loop.global_state[name], before[name] - whole[name], atol=1e-7)
    for name in ("b.weight", "b.bias"):  # fragment 1: the mean of three
        mean = (2 * whole[name] + only_b[name]) / 3
        assert torch.allclose(loop.global_state[name], before[name] - mean, atol=1e-7)


def test_installing_one_fragment_leaves_the_others_alone(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path, lr=1.0, momentum=0.0, outlier_policy="off")
    loop.keeper.set_fragments(FragmentLayout.build(weights(), 2))
    loop.publish()
    worker = DumbDiLoCoCoordinator(
        dist_config(fragments=2, inner_steps=4, install_at="any", poll_interval=0.0),
        make_net(),
        hub=store,
        state_dir=tmp_path / "w",
    )
    worker.start()
    nudge(worker.model)
    worker.after_optimizer_step(worker.model, 2)  # fragment 1 uploaded, its baseline moves
    loop.run_round()
    nudge(worker.model)
    worker.after_optimizer_step(worker.model, 3)  # install_at any: fragment 1 installed now
    assert worker.last_global_step == 1
    assert torch.allclose(worker.model.state_dict()["b.weight"], loop.global_state["b.weight"])
    assert torch.allclose(  # fragment 0 kept its two steps of progress
        worker.model.state_dict()["a.weight"], weights()["a.weight"] + 0.02
    )
    assert torch.allclose(worker._baseline["a.weight"], weights()["a.weight"])
    worker.stop()


def test_an_upload_in_flight_still_moves_its_fragment_when_another_is_installed(
    tmp_path: Path,
) -> None:
    store = MemoryTransport()
    layout = FragmentLayout.build(weights(), 2)
    loop = make_loop(store, tmp_path, lr=1.0, momentum=0.0, outlier_policy="off")
    loop.keeper.set_fragments(layout)
    loop.publish()
    worker = DumbDiLoCoCoordinator(
        dist_config(
            fragments=2, inner_steps=4, install_at="any", poll_interval=0.0, async_delta_upload=True
        ),
        make_net(),
        hub=store,
        state_dir=tmp_path / "w",
    )
    worker.start()
    only_a = {k: v for k, v in random_delta(5).items() if k.startswith("a.")}
    put(store, tmp_path, "other", 1, only_a, fragment_metadata([0], layout))
    release = store.hold("upload_delta")
    try:
        nudge(worker.model)
        worker.after_optimizer_step(worker.model, 2)  # fragment 1's upload: held in flight
        loop.run_round()  # fragment 0 moves (the other node's delta)
        nudge(worker.model)
        worker.after_optimizer_step(worker.model, 3)  # installs fragment 0 meanwhile
        assert torch.allclose(worker.model.state_dict()["a.weight"], loop.global_state["a.weight"])
    finally:
        release.set()
    assert worker.wait_idle(60.0)
    assert delta_path("w1", 2) in store.files
    # Fragment 1's baseline moved to what was uploaded (not sent twice); fragment 0's is the
    # installed global.
    assert torch.allclose(worker._baseline["b.weight"], weights()["b.weight"] + 0.01)
    assert torch.allclose(worker._baseline["a.weight"], loop.global_state["a.weight"])
    worker.stop()
