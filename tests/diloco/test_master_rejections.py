"""What the master says about a delta it refuses (issue 34): the reason names the delta by its
store path, never by the master's own copy of it, and is kept whole (L3); a rejection is
logged and emitted when the intake refuses the delta, not only when its round runs, and a node
sending nothing but refused deltas does not hold the round up (L5). Real files: the
shared-directory store."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import make_master, make_net

from speedtronic_diloco.ledger import MAX_REASON, bounded_reason
from speedtronic_diloco.signing import sign_file
from speedtronic_diloco.tensors import cpu_state_dict, save_tensors
from speedtronic_diloco.transports import GLOBAL_METADATA, SharedDirectoryTransport, delta_path

KEY = b"rejections-test-key-0123"
LONG = "x" * 60  # a tensor name as long as a real model's can be


def weights() -> dict[str, torch.Tensor]:
    return cpu_state_dict(make_net().state_dict())


def delta(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=generator) * 0.01
        for k, v in weights().items()
        if v.is_floating_point()
    }


def shared(tmp_path: Path) -> SharedDirectoryTransport:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    return store


def put(
    store: SharedDirectoryTransport,
    tmp_path: Path,
    node: str,
    tensors: dict[str, torch.Tensor] | None,
    key: bytes | None = KEY,
    raw: bytes | None = None,
) -> None:
    path = tmp_path / "up" / f"{node}.safetensors"
    if raw is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    else:
        fields = {"node_id": node, "local_step": "4", "base_outer_step": "0"}
        save_tensors(path, tensors or {}, fields)
        if key is not None:
            sign_file(path, key)
    store.upload_delta(node, 4, path)


def rejected_events(events: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {p["node"]: p for e, p in events if e == "delta_rejected"}


def test_rejection_reasons_name_store_paths_and_are_kept_whole(tmp_path: Path) -> None:
    store = shared(tmp_path)
    events: list[tuple[str, dict[str, Any]]] = []
    loop = make_master(store, tmp_path, events=events, start=weights(), rules={"signing_key": KEY})
    put(store, tmp_path, "good", delta(1))
    put(store, tmp_path, "unsigned", delta(2), key=None)
    put(store, tmp_path, "garbage", None, raw=b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    extra = {**delta(3), **{f"{LONG}.{i}": torch.zeros(1) for i in range(5)}}
    put(store, tmp_path, "extra", extra)
    result = loop.run_round()
    assert result is not None and result.included == (("good", 4),)
    told = rejected_events(events)
    assert {n: p["reason"] for n, p in told.items()} == {
        "unsigned": "unsigned",
        "garbage": "unreadable",
        "extra": "keys",
    }
    cache = str(tmp_path / "cache")
    published = json.loads((tmp_path / "store" / GLOBAL_METADATA).read_text())["nodes"]
    records = {r["node"]: r for r in loop.keeper.rejections}
    for node, event in told.items():
        store_path = delta_path(node, 4)
        for message in (event["message"], records[node]["message"]):
            assert message.startswith(f"{store_path}: "), message
            assert cache not in message and str(tmp_path) not in message, message
        reason = published[node]["last_reason"]
        assert reason.startswith(f"{event['reason']}: {store_path}: ") and cache not in reason
    # All five unexpected names, over 300 characters, nothing cut.
    message = told["extra"]["message"]
    assert len(message) > 300 and all(f"{LONG}.{i}" in message for i in range(5))
    assert message in published["extra"]["last_reason"]


def test_a_reason_is_bounded_only_far_beyond_a_real_one() -> None:
    assert bounded_reason("x" * MAX_REASON) == "x" * MAX_REASON
    cut = bounded_reason("y" * (MAX_REASON * 3))
    assert len(cut) <= MAX_REASON and cut.endswith("more characters)")


def test_a_hostile_writers_long_names_are_quoted_short(tmp_path: Path) -> None:
    store = shared(tmp_path)
    events: list[tuple[str, dict[str, Any]]] = []
    loop = make_master(store, tmp_path, events=events, start=weights())
    put(store, tmp_path, "good", delta(1), key=None)
    put(store, tmp_path, "evil", {**delta(2), "n" * 100_000: torch.zeros(1)}, key=None)
    loop.run_round()
    message = rejected_events(events)["evil"]["message"]
    assert len(message) < 600 and "(100000 characters)" in message


def test_rejections_are_told_as_the_intake_refuses_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A quorum of three that never comes (``min_deltas: 3``, two nodes seen): nothing is
    aggregated, yet the refused delta is logged and emitted at once, once. (With two, the
    failing node would not count as live, and the good one's round would run.)"""
    store = shared(tmp_path)
    events: list[tuple[str, dict[str, Any]]] = []
    rules = {"min_deltas": 3, "round_timeout": 86400.0}
    loop = make_master(store, tmp_path, events=events, start=weights(), rules=rules)
    put(store, tmp_path, "good", delta(1), key=None)
    nan = delta(2)
    nan["a.weight"][0, 0] = float("nan")
    put(store, tmp_path, "bad", nan, key=None)
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        assert loop.tick() is None  # waiting for the quorum
        assert loop.tick() is None
    lines = [r.getMessage() for r in caplog.records if "rejected delta" in r.getMessage()]
    path = delta_path("bad", 4)
    assert len(lines) == 1 and lines[0].startswith(f"rejected delta {path} (non_finite): {path}: ")
    assert list(rejected_events(events)) == ["bad"]
    assert not [e for e, _ in events if e == "outer_step"]


def test_a_node_with_only_refused_deltas_does_not_hold_the_round_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every node seen counts toward the quorum (``min_deltas`` unset), but one whose deltas
    are all refused is not waited for: the round runs on the quorum of the others at once,
    not after ``round_timeout``, and its rejection is told once."""
    store = shared(tmp_path)
    events: list[tuple[str, dict[str, Any]]] = []
    rules = {"round_timeout": 86400.0}
    loop = make_master(store, tmp_path, events=events, start=weights(), rules=rules)
    put(store, tmp_path, "good", delta(1), key=None)
    wrong = {**delta(2), "b.bias": torch.zeros(1, dtype=torch.int64)}
    put(store, tmp_path, "bad", wrong, key=None)
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        result = loop.tick()
    assert result is not None and result.reason == "quorum"
    assert result.included == (("good", 4),) and result.rejected == (("bad", 4),)
    assert len([e for e, _ in events if e == "delta_rejected"]) == 1
    assert caplog.text.count("rejected delta") == 1
