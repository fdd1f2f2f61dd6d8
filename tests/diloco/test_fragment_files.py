"""Per-fragment global files (issue 17, streaming fragments): with K > 1 a fragment round
publishes only that fragment's file (plus the metadata listing every fragment's file), nodes
download only the files whose version advanced, every file is checked as hostile, storage
cleanup keeps what the metadata lists, and a restarted master, a fresh node and ``--global``
put the whole global back together. Real files: the shared-directory store and the Hub
emulator."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import dist_config, make_master
from hub_emulator import HubEmulator
from hub_fixtures import REPO, hub_fixture, transport  # noqa: F401
from torch import nn

from speedtronic.errors import TransportError
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.fragment_files import fragment_header
from speedtronic_diloco.fragments import FragmentLayout, fragment_metadata
from speedtronic_diloco.global_weights import read_global_state
from speedtronic_diloco.master.history import roll_back
from speedtronic_diloco.signing import sign_file
from speedtronic_diloco.status import collect_status, summary_lines
from speedtronic_diloco.tensors import cpu_state_dict, load_tensors, save_tensors
from speedtronic_diloco.transports import (
    GLOBAL_METADATA,
    FragmentFile,
    GlobalMetadata,
    Lease,
    LeaseLostError,
    PermanentTransportError,
    SharedDirectoryTransport,
    Transport,
)
from speedtronic_diloco.transports.shared_dir import KEEP_VERSIONS

K = 4
WIDTH = 64
KEY = "fragment-files-test-key"


class Stack(nn.Module):
    """Four equal layers (one per fragment with K = 4) and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(K)))
        self.register_buffer("seen", torch.arange(3, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def make_stack(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack()


def weights() -> dict[str, torch.Tensor]:
    return cpu_state_dict(make_stack().state_dict())


LAYOUT = FragmentLayout.build(weights(), K)


def model_bytes() -> int:
    return sum(v.numel() * v.element_size() for v in weights().values())


def master_loop(store: Transport, tmp_path: Path, state: str = "state", **rules: Any) -> Any:
    loop = make_master(
        store,
        tmp_path,
        lr=1.0,
        state_dir=tmp_path / state,
        cache_dir=tmp_path / f"{state}-cache",
        rules={"outlier_policy": "off", **rules},
    )
    loop.keeper.set_fragments(LAYOUT)
    if loop.global_state is None:
        loop.keeper.bootstrap(weights())
    return loop


def shared(tmp_path: Path) -> SharedDirectoryTransport:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    return store


def fragment_round(
    store: Transport, loop: Any, tmp_path: Path, j: int, step: int, key: bytes | None = None
) -> None:
    """Another node's delta for fragment ``j`` only, then one round."""
    delta = {n: torch.full_like(v, 0.01) for n, v in LAYOUT.select(weights(), [j]).items()}
    fields = {"node_id": "other", "local_step": str(step), "base_outer_step": "0"}
    path = save_tensors(
        tmp_path / "up" / f"other_{step}.safetensors",
        delta,
        {**fields, **fragment_metadata([j], LAYOUT)},
    )
    if key is not None:
        sign_file(path, key)
    store.upload_delta("other", step, path)
    result = loop.run_round()
    assert result is not None and result.deltas_included == 1, result


def node(
    store: Transport, tmp_path: Path, name: str = "w1", **overrides: Any
) -> tuple[DumbDiLoCoCoordinator, list[tuple[str, dict[str, Any]]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    values = dict(
        node_id=name,
        fragments=K,
        inner_steps=100,
        install_at="any",
        poll_interval=0.0,
        repo_id=str(tmp_path / "store"),
    )
    values.update(overrides)
    worker = DumbDiLoCoCoordinator(
        dist_config(**values),
        make_stack(seed=7),
        hub=store,
        state_dir=tmp_path / "nodes",
        logger=lambda event, payload: events.append((event, payload)),
    )
    return worker, events


def published_and_started(
    tmp_path: Path,
) -> tuple[Transport, Any, DumbDiLoCoCoordinator, list[tuple[str, dict[str, Any]]]]:
    """A store with the master's first (every-fragment) publication and a started node."""
    store = shared(tmp_path)
    loop = master_loop(store, tmp_path)
    loop.publish()
    worker, events = node(store, tmp_path)
    worker.start()
    return store, loop, worker, events


def step(worker: DumbDiLoCoCoordinator, n: int) -> None:
    worker.after_optimizer_step(worker.model, n)


def loaded(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [payload for event, payload in events if event == "global_loaded"]


def metadata_json(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "store" / GLOBAL_METADATA).read_text())


def assert_model_is(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


# --------------------------------------------------------------------------- publication
def test_a_fragment_round_publishes_only_that_fragments_file(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master_loop(store, tmp_path)
    first = loop.publish()
    assert first is not None and len(first.fragment_files) == K
    root = tmp_path / "store"
    for j, entry in enumerate(first.fragment_files):  # the first publication: every fragment
        tensors, header = load_tensors(root / entry.file)
        expected = set(LAYOUT.fragments[j]) | ({"seen"} if j == 0 else set())
        assert set(tensors) == expected
        assert header["fragment"] == str(j) and header["outer_step"] == "0"
    assert not (root / "global" / "latest.safetensors").exists()
    before = {p.name for p in (root / "global").glob("fragment*.safetensors")}

    fragment_round(store, loop, tmp_path, 2, 1)
    after = {p.name for p in (root / "global").glob("fragment*.safetensors")}
    new = after - before
    assert len(new) == 1 and new.pop().startswith("fragment2-v00000001-")
    meta = metadata_json(tmp_path)
    files = meta["fragment_files"]
    assert [f["outer_step"] for f in files] == [0, 0, 1, 0]
    assert meta["extra"]["fragments"]["versions"] == [0, 0, 1, 0]
    assert [f["file"] for f in files if f["outer_step"] == 0] == [
        e.file for j, e in enumerate(first.fragment_files) if j != 2
    ]
    assert meta["model_file"] == files[2]["file"] and meta["sha256"] == files[2]["sha256"]
    tensors, _ = load_tensors(root / files[2]["file"])
    assert set(tensors) == set(LAYOUT.fragments[2])
    for name, value in tensors.items():
        assert torch.equal(value, loop.global_state[name])
        assert not torch.equal(value, weights()[name])  # the round moved it
    assert files[2]["size"] < model_bytes() / 3


def test_k1_publication_is_todays_single_file(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = make_master(store, tmp_path, lr=1.0)
    loop.keeper.set_fragments(FragmentLayout.build(weights(), 1))
    loop.keeper.bootstrap(weights())
    published = loop.publish()
    assert published is not None and published.fragment_files == ()
    meta = metadata_json(tmp_path)
    assert "fragment_files" not in meta and meta["model_file"].startswith("global/v00000000-")
    assert (tmp_path / "store" / "global" / "latest.safetensors").exists()
    assert not list((tmp_path / "store" / "global").glob("fragment*"))


# --------------------------------------------------------------------------- nodes
def test_a_node_downloads_only_the_fragment_that_moved(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master_loop(store, tmp_path)
    first = loop.publish()
    assert first is not None
    worker, events = node(store, tmp_path)
    worker.start()
    total = sum(entry.size for entry in first.fragment_files)
    assert [e["bytes_received"] for e in loaded(events)] == [total]  # the first install: all
    assert_model_is(worker.model, loop.global_state)

    fragment_round(store, loop, tmp_path, 1, 1)
    step(worker, 1)
    fragment_size = metadata_json(tmp_path)["fragment_files"][1]["size"]
    latest = loaded(events)[-1]
    assert latest["outer_step"] == 1 and latest["fragments"] == "1"
    assert latest["bytes_received"] == fragment_size
    assert fragment_size < model_bytes() / 3  # about a quarter of the model, not all of it
    assert worker.bytes_received == total + fragment_size
    for name in LAYOUT.fragments[1]:
        assert torch.equal(worker.model.state_dict()[name], loop.global_state[name])

    cached = sorted((worker.cache_dir / "global").glob("fragment_*/*.safetensors"))
    assert len(cached) == K + 1  # one file per fragment, and fragment 1's new one
    step(worker, 2)  # nothing new: nothing downloaded
    assert worker.bytes_received == total + fragment_size
    worker.stop()


def test_a_resumed_node_with_an_empty_cache_downloads_only_what_advanced(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master_loop(store, tmp_path)
    loop.publish()
    first, _ = node(store, tmp_path)
    first.start()
    state = first.state_dict()
    first.stop()
    fragment_round(store, loop, tmp_path, 2, 1)
    resumed, events = node(store, tmp_path, cache_dir=str(tmp_path / "other-cache"))
    resumed.load_state_dict(state)  # its installed fragment versions, no cached file
    resumed.start()
    step(resumed, 1)
    size = metadata_json(tmp_path)["fragment_files"][2]["size"]
    assert [e["bytes_received"] for e in loaded(events)] == [size]
    assert resumed.bytes_received == size
    for name in LAYOUT.fragments[2]:
        assert torch.equal(resumed.model.state_dict()[name], loop.global_state[name])
    resumed.stop()


def test_a_node_installs_a_fragment_without_touching_the_others_progress(
    tmp_path: Path,
) -> None:
    store, loop, worker, _ = published_and_started(tmp_path)
    with torch.no_grad():
        for param in worker.model.parameters():
            param.add_(0.5)  # local progress on every fragment
    trained = cpu_state_dict(worker.model.state_dict())
    fragment_round(store, loop, tmp_path, 3, 1)
    step(worker, 1)
    state = worker.model.state_dict()
    for name, value in trained.items():
        if name in LAYOUT.fragments[3]:
            assert torch.equal(state[name], loop.global_state[name]), name
        else:
            assert torch.equal(state[name], value), name
    worker.stop()


def forged_global(tmp_path: Path, j: int, file: str, data: bytes, outer_step: int) -> None:
    """Point the store's metadata at ``file`` (``data``) as fragment ``j``'s file of a newer
    global, with a matching sha256 and size: what a hostile writer can do without the key."""
    (tmp_path / "store" / file).write_bytes(data)
    meta = metadata_json(tmp_path)
    meta["outer_step"] = outer_step
    meta["fragment_files"][j] = {
        "file": file,
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "outer_step": outer_step,
    }
    meta["extra"]["fragments"]["versions"][j] = outer_step
    (tmp_path / "store" / GLOBAL_METADATA).write_text(json.dumps(meta))


def fragment_bytes(tmp_path: Path, tensors: dict[str, torch.Tensor], j: int, step: int) -> bytes:
    path = save_tensors(
        tmp_path / "forged.safetensors", tensors, fragment_header(j, step, LAYOUT, "m")
    )
    return path.read_bytes()


def wrong_shape(tmp_path: Path) -> tuple[str, bytes]:
    tensors = {n: torch.zeros(3, 3) for n in LAYOUT.fragments[1]}
    return "global/fragment1-wrong.safetensors", fragment_bytes(tmp_path, tensors, 1, 5)


def oversized(tmp_path: Path) -> tuple[str, bytes]:
    tensors = LAYOUT.select(weights(), [1])
    data = fragment_bytes(tmp_path, tensors, 1, 5)
    return "global/fragment1-huge.safetensors", data + b" " * (4 << 20)


def non_finite(tmp_path: Path) -> tuple[str, bytes]:
    tensors = {
        n: torch.full_like(v, float("nan")) for n, v in LAYOUT.select(weights(), [1]).items()
    }
    return "global/fragment1-nan.safetensors", fragment_bytes(tmp_path, tensors, 1, 5)


def other_fragment(tmp_path: Path) -> tuple[str, bytes]:
    tensors = LAYOUT.select(weights(), [2])
    return "global/fragment1-other.safetensors", fragment_bytes(tmp_path, tensors, 2, 5)


def float64_overflow(tmp_path: Path) -> tuple[str, bytes]:
    """Finite in float64, infinite in the model's float32 (issue 34, H2)."""
    tensors = {
        n: torch.full(v.shape, 1e300, dtype=torch.float64)
        for n, v in LAYOUT.select(weights(), [1]).items()
    }
    return "global/fragment1-f64.safetensors", fragment_bytes(tmp_path, tensors, 1, 5)


def huge_but_finite(tmp_path: Path) -> tuple[str, bytes]:
    """Finite float32 everywhere, but a jump no outer step could make."""
    tensors = {n: torch.full_like(v, 1e30) for n, v in LAYOUT.select(weights(), [1]).items()}
    return "global/fragment1-huge-values.safetensors", fragment_bytes(tmp_path, tensors, 1, 5)


@pytest.mark.parametrize(
    ("forge", "why"),
    [
        (wrong_shape, "has shape (3, 3)"),
        (oversized, "more than fragment 1 can take"),
        (non_finite, "non-finite values"),
        (other_fragment, "header field fragment is '2'"),
        (float64_overflow, "is torch.float64, the model's is torch.float32"),
        (huge_but_finite, "more than max_update_ratio 10 x their norm"),
    ],
)
def test_a_hostile_fragment_file_is_refused_with_its_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, forge: Any, why: str
) -> None:
    _, _, worker, events = published_and_started(tmp_path)
    before = cpu_state_dict(worker.model.state_dict())
    file, data = forge(tmp_path)
    forged_global(tmp_path, 1, file, data, 5)
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        step(worker, 1)
    refused = [p for e, p in events if e == "global_refused"]
    assert refused and file in refused[-1]["message"] and why in refused[-1]["message"]
    assert file in caplog.text
    assert_model_is(worker.model, before)
    assert worker.last_global_step == 0
    received = worker.bytes_received
    step(worker, 2)  # the same refused file: neither fetched nor reported again
    assert len([e for e, _ in events if e == "global_refused"]) == len(refused)
    assert worker.bytes_received == received
    worker.stop()
    # `--global` (eval, export, generate) refuses it just as well
    section = dist_config(repo_id=str(tmp_path / "store"), fragments=K, inner_steps=100)
    with pytest.raises(TransportError, match=re.escape(why)):
        read_global_state(section, make_stack())


def test_a_tampered_fragment_file_is_refused_with_its_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, loop, worker, events = published_and_started(tmp_path)
    before = cpu_state_dict(worker.model.state_dict())
    fragment_round(store, loop, tmp_path, 2, 1)
    file = metadata_json(tmp_path)["fragment_files"][2]["file"]
    path = tmp_path / "store" / file
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        step(worker, 1)
    assert str(path) in caplog.text and "sha256" in caplog.text
    assert not [p for e, p in events if e == "global_loaded" and p["outer_step"] == 1]
    assert_model_is(worker.model, before)
    worker.stop()


def test_signed_fragment_files_verify_and_unsigned_ones_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = shared(tmp_path)
    key = KEY.encode()
    loop = master_loop(store, tmp_path, signing_key=key)
    loop.publish()
    worker, events = node(store, tmp_path, signing_key=KEY)
    worker.start()
    assert_model_is(worker.model, loop.global_state)  # every signed file verified
    fragment_round(store, loop, tmp_path, 0, 1, key=key)
    step(worker, 1)
    assert loaded(events)[-1]["outer_step"] == 1
    tensors = LAYOUT.select(weights(), [3])
    file = "global/fragment3-unsigned.safetensors"
    forged_global(tmp_path, 3, file, fragment_bytes(tmp_path, tensors, 3, 5), 5)
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        step(worker, 2)
    refused = [p for e, p in events if e == "global_refused"]
    message = refused[-1]["message"]
    assert message == f"{file}: not signed (unsigned)"  # the store path, not the cache's copy
    worker.stop()


# --------------------------------------------------------------------------- storage
def test_storage_cleanup_keeps_every_listed_fragment_file(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master_loop(store, tmp_path)
    loop.housekeeper.keep_outer_steps = 1  # processed deltas go as soon as they can
    first = loop.publish()
    assert first is not None
    for n in range(1, 8):  # fragment 0 moves every round; 1..3 never do
        fragment_round(store, loop, tmp_path, 0, n)
    meta = metadata_json(tmp_path)
    root = tmp_path / "store"
    for entry in meta["fragment_files"]:
        assert (root / entry["file"]).is_file(), entry
    assert [e["file"] for e in meta["fragment_files"][1:]] == [
        e.file for e in first.fragment_files[1:]
    ]
    fragment0 = sorted((root / "global").glob("fragment0-*.safetensors"))
    assert len(fragment0) == KEEP_VERSIONS
    assert f"global/{fragment0[-1].name}" == meta["fragment_files"][0]["file"]
    assert len(list(root.glob("nodes/*/*.safetensors"))) <= 1  # the deltas' cleanup too


# --------------------------------------------------------------------------- restarts
def test_a_restarted_master_and_fresh_nodes_rebuild_the_whole_global(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master_loop(store, tmp_path)
    loop.publish()
    for n, j in enumerate((1, 3, 1), start=1):
        fragment_round(store, loop, tmp_path, j, n)
    expected = dict(loop.global_state)
    listed = metadata_json(tmp_path)["fragment_files"]

    again = master_loop(store, tmp_path)  # the same state directory: resumes
    assert again.keeper.fragment_files == loop.keeper.fragment_files
    names = {p.name for p in (tmp_path / "store" / "global").glob("fragment*")}
    fragment_round(store, again, tmp_path, 2, 10)
    written = {p.name for p in (tmp_path / "store" / "global").glob("fragment*")} - names
    assert len(written) == 1 and written.pop().startswith("fragment2-")

    # A master that lost its state adopts the store's global, put together from the files.
    config = dist_config(
        role="master",
        node_id="m",
        fragments=K,
        inner_steps=100,
        repo_id=str(tmp_path / "store"),
        take_over=True,
    )
    expected = dict(again.global_state)
    fresh_master = DumbDiLoCoCoordinator(
        config, make_stack(seed=3), hub=store, state_dir=tmp_path / "lost"
    )
    fresh_master.start()
    outer = fresh_master.outer
    assert outer is not None and outer.outer_step == again.outer_step
    for name, value in expected.items():
        assert torch.equal(outer.global_state[name], value), name
    assert outer.keeper.fragment_files == again.keeper.fragment_files
    assert outer.keeper.fragment_versions == again.keeper.fragment_versions
    fresh_master.stop()

    worker, events = node(store, tmp_path, name="late")
    worker.start()
    assert_model_is(worker.model, expected)
    assert loaded(events)[0]["bytes_received"] == sum(
        e["size"] for e in metadata_json(tmp_path)["fragment_files"]
    )
    worker.stop()

    section = DistributedConfig(enabled=True, repo_id=str(tmp_path / "store"))
    read = read_global_state(section, make_stack(seed=5))
    assert read.keys() == expected.keys()
    assert all(torch.equal(read[k], v) for k, v in expected.items())
    assert listed != metadata_json(tmp_path)["fragment_files"]


def test_a_rollback_republishes_every_fragment_and_nodes_install_it(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master_loop(store, tmp_path, keep_history=4)
    loop.publish()
    original = dict(loop.global_state)
    worker, events = node(store, tmp_path)
    worker.start()
    fragment_round(store, loop, tmp_path, 1, 1)
    step(worker, 1)
    new_step = roll_back(tmp_path / "state", 0)
    restarted = master_loop(store, tmp_path, keep_history=4)
    assert restarted.keeper.fragment_versions == [new_step] * K
    assert restarted.publish_if_behind()
    files = metadata_json(tmp_path)["fragment_files"]
    assert [f["outer_step"] for f in files] == [new_step] * K
    step(worker, 2)
    assert loaded(events)[-1]["outer_step"] == new_step
    assert_model_is(worker.model, original)
    worker.stop()


def test_status_lists_the_fragment_files(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master_loop(store, tmp_path)
    loop.publish()
    fragment_round(store, loop, tmp_path, 2, 1)
    status = collect_status(store)
    assert [f["outer_step"] for f in status.to_json()["fragment_files"]] == [0, 0, 1, 0]
    assert any(line.startswith("fragments    4 files at outer steps 0, 0, 1, 0") for line in
               summary_lines(status))  # fmt: skip


def test_bf16_fragment_files_are_installed_in_the_model_dtype(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master_loop(store, tmp_path)
    loop.publisher.compression = "bf16"  # distributed.global_compression
    first = loop.publish()
    assert first is not None
    tensors, header = load_tensors(tmp_path / "store" / first.fragment_files[1].file)
    assert header["codec"] == "bf16" and all(v.dtype == torch.bfloat16 for v in tensors.values())
    worker, _ = node(store, tmp_path)
    worker.start()
    state = worker.model.state_dict()
    for name, value in loop.global_state.items():
        assert state[name].dtype == value.dtype
        if value.is_floating_point():
            assert torch.equal(state[name], value.to(torch.bfloat16).to(value.dtype))
    worker.stop()


# --------------------------------------------------------------------------- the Hub
def test_hub_fragment_round_is_one_commit_of_that_file_and_the_metadata(
    hub: HubEmulator, tmp_path: Path
) -> None:
    store = transport(hub)
    store.create_store()
    loop = master_loop(store, tmp_path)
    first = loop.publish()
    assert first is not None
    assert [e.file for e in first.fragment_files] == [
        f"global/fragment_{j}.safetensors" for j in range(K)
    ]
    worker, events = node(store, tmp_path, repo_id=REPO)
    worker.start()
    assert_model_is(worker.model, loop.global_state)
    head = hub.history(REPO)[-1]
    fragment_round(store, loop, tmp_path, 3, 1)
    commits = hub.history(REPO)
    changes = []  # per commit since, the global files it changed
    for parent, child in zip(commits[commits.index(head) :], commits[commits.index(head) + 1 :]):
        old, new = hub.files(REPO, parent), hub.files(REPO, child)
        changed = {p for p in new if p.startswith("global/") and old.get(p) != new[p]}
        if changed:
            changes.append(changed)
    # The master's outer state (fail-over) travels in the same commit.
    assert len(changes) == 1 and len([p for p in changes[0] if p.startswith("global/outer/")]) == 1
    assert {p for p in changes[0] if not p.startswith("global/outer/")} == {
        "global/fragment_3.safetensors",
        GLOBAL_METADATA,
    }
    step(worker, 1)
    latest = loaded(events)[-1]
    assert latest["outer_step"] == 1
    assert latest["bytes_received"] == len(hub.files(REPO)["global/fragment_3.safetensors"])
    for name in LAYOUT.fragments[3]:
        assert torch.equal(worker.model.state_dict()[name], loop.global_state[name])
    worker.stop()

    fresh, _ = node(store, tmp_path, name="fresh", repo_id=REPO)
    fresh.start()
    assert_model_is(fresh.model, loop.global_state)
    fresh.stop()


def test_hub_tampered_fragment_file_is_refused_with_its_name(
    hub: HubEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = transport(hub)
    store.create_store()
    loop = master_loop(store, tmp_path)
    assert loop.publish() is not None
    hub.tamper(REPO, "global/fragment_2.safetensors", b"not the published bytes")
    fresh, events = node(store, tmp_path, name="fresh", repo_id=REPO)
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        fresh.start()
    assert "global/fragment_2.safetensors" in caplog.text
    assert loaded(events) == [] and fresh.last_global_step == -1
    fresh.stop()


# --------------------------------------------------------------------------- metadata
@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ({"file": "../secret.safetensors"}, "fragment_files[1]: file"),
        ({"file": "nodes/a/delta_1.safetensors"}, "fragment_files[1]: file"),
        ({"sha256": "XYZ"}, "fragment_files[1]: sha256"),
        ({"size": -1}, "fragment_files[1]: size"),
        ({"size": True}, "fragment_files[1]: size"),
        ({"outer_step": "3"}, "fragment_files[1]: outer_step"),
    ],
)
def test_malformed_fragment_files_are_refused_naming_the_field(
    entry: dict[str, Any], why: str
) -> None:
    good = {"file": "global/fragment0-v1.safetensors", "sha256": "a" * 64, "size": 1}
    document = {
        "outer_step": 1,
        "sha256": "a" * 64,
        "size": 1,
        "fragment_files": [{**good, "outer_step": 1}, {**good, "outer_step": 1, **entry}],
    }
    with pytest.raises(
        PermanentTransportError, match=f"step_count.json: {why}".replace("[", r"\[")
    ):
        GlobalMetadata.from_json(document)
    too_many = {**document, "fragment_files": [{**good, "outer_step": 1}] * 1025}
    with pytest.raises(PermanentTransportError, match="at most 1024"):
        GlobalMetadata.from_json(too_many)


# --------------------------------------------------------------------------- the lease
@pytest.mark.parametrize("kind", ["shared", "hub"])
def test_a_fragment_publication_is_fenced_by_the_lease(
    hub: HubEmulator, tmp_path: Path, kind: str
) -> None:
    store: Transport = shared(tmp_path) if kind == "shared" else transport(hub)
    store.create_store()
    loop = master_loop(store, tmp_path)
    first = loop.publish()
    assert first is not None
    before = store.read_global_metadata()
    store.write_lease(Lease("another-master", 2, time.time() + 60.0), None)
    path = save_tensors(
        tmp_path / "f1.safetensors",
        LAYOUT.select(weights(), [1]),
        fragment_header(1, 1, LAYOUT, "m"),
    )
    entry = FragmentFile("", hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size, 1)
    entries = list(first.fragment_files)
    entries[1] = entry
    fenced = replace(first, outer_step=1, lease_epoch=1, master="m", fragment_files=tuple(entries))
    with pytest.raises(LeaseLostError, match="another-master"):
        store.publish_fragments({1: path}, fenced)
    after = store.read_global_metadata()
    assert after is not None and before is not None
    assert after.fragment_files == before.fragment_files and after.outer_step == 0
