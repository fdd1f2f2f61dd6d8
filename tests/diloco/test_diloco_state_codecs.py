"""The master's and the node's state each have one codec: random states survive it unchanged
(the state file and the checkpoint form alike), and the files the previous release wrote
(tests/diloco/fixtures, made by the code at commit 0dbf77b) still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from diloco_fakes import MemoryTransport, dist_config, make_master, make_net
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speedtronic.checkpoint import statecodec
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.ledger import DeltaLedger
from speedtronic_diloco.master.fragments import MasterFragments
from speedtronic_diloco.master.state import (
    STATE_FILE,
    OuterState,
    decode,
    encode,
    from_checkpoint,
    load_state,
    save_state,
    to_checkpoint,
)
from speedtronic_diloco.node.state import NodeState
from speedtronic_diloco.node.state import from_checkpoint as node_from_checkpoint
from speedtronic_diloco.node.state import to_checkpoint as node_to_checkpoint
from speedtronic_diloco.tensors import load_tensors
from speedtronic_diloco.transports import DeltaInfo
from speedtronic_diloco.transports.base import FragmentFile

FIXTURES = Path(__file__).parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())

names = st.sampled_from(["a.weight", "a.bias", "b.weight", "blocks.0.w", "emb"])
small_ints = st.integers(min_value=0, max_value=10_000)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)


@st.composite
def tensors(draw: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name in draw(st.sets(names, max_size=4)):
        shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
        seed = draw(st.integers(0, 1000))
        values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
        out[name] = values.to(dtype)
    return out


@st.composite
def ledgers(draw: Any) -> DeltaLedger:
    ledger = DeltaLedger()
    for node, step, outer, accepted in draw(
        st.lists(st.tuples(st.sampled_from("abc"), small_ints, small_ints, st.booleans()))
    ):
        info = DeltaInfo(node, step, f"nodes/{node}/delta_{step}.safetensors", 10, f"e{step}")
        ledger.record(
            info,
            draw(st.none() | st.text("0123456789abcdef", min_size=8, max_size=8)),
            outer_step=outer,
            accepted=accepted,
            reason=None if accepted else draw(text),
            base_outer_step=draw(st.none() | small_ints),
            norm=draw(st.none() | finite),
            now=draw(st.floats(0, 2e9)),
        )
    return ledger


fragment_files = st.builds(
    FragmentFile,
    st.integers(0, 7).map(lambda j: f"global/fragment_{j}.safetensors"),
    st.text("0123456789abcdef", min_size=64, max_size=64),
    small_ints,
    small_ints,
)
json_values = st.none() | st.booleans() | small_ints | finite | text
outer_states = st.builds(
    OuterState,
    outer_step=small_ints,
    global_state=tensors(),
    momentum=tensors(),
    processed=ledgers(),
    published_step=st.integers(-1, 10_000),
    norm_history=st.lists(finite, max_size=32),
    rejections=st.lists(st.dictionaries(text, json_values, max_size=4), max_size=5),
    halted=st.none() | text.filter(bool),
    signatures=st.lists(st.text("0123456789abcdef", min_size=1, max_size=16), max_size=8),
    fragments=st.builds(
        lambda steps, files: MasterFragments.unfragmented(
            steps=steps, versions=[s + 1 for s in steps], files=files[: len(steps)]
        ),
        st.lists(small_ints, max_size=4),
        st.lists(st.none() | fragment_files, max_size=4),
    ),
    rolled_back=st.none() | st.dictionaries(text, small_ints, max_size=3),
)


def same_tensors(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    a, b = a or {}, b or {}
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def assert_same(a: OuterState, b: OuterState) -> None:
    assert same_tensors(a.global_state, b.global_state)
    assert same_tensors(a.momentum, b.momentum)
    assert a.processed.to_json() == b.processed.to_json()
    for field in (
        "outer_step",
        "published_step",
        "norm_history",
        "rejections",
        "halted",
        "signatures",
        "rolled_back",
    ):
        assert getattr(a, field) == getattr(b, field), field
    book, again = a.fragments, b.fragments
    # a book without counters keeps no files (nothing to publish them for)
    assert (again.steps, again.versions) == (book.steps, book.versions)
    assert again.files == (book.files if book.steps and any(book.files) else [])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outer_states)
def test_random_outer_states_survive_the_state_codec(state: OuterState) -> None:
    tensors, meta = encode(state, "m")
    assert all(isinstance(v, str) for v in meta.values())  # safetensors metadata: strings
    assert_same(state, decode(tensors, meta))
    assert_same(state, from_checkpoint(to_checkpoint(state, "m")))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outer_states)
def test_random_outer_states_survive_the_state_file(tmp_path_factory: Any, state: Any) -> None:
    path = tmp_path_factory.mktemp("state") / STATE_FILE
    save_state(path, state, "m")
    assert_same(state, load_state(path))


node_states = st.builds(
    NodeState,
    node_id=st.sampled_from(["w1", "m"]),
    role=st.sampled_from(["worker", "master"]),
    local_step=small_ints,
    last_global_step=st.integers(-1, 10_000),
    last_uploaded_step=st.none() | small_ints,
    baseline=tensors(),
    pending=st.none()
    | st.fixed_dictionaries(
        {
            "local_step": small_ints,
            "upload_id": st.text("0123456789abcdef", min_size=32, max_size=32),
            "base_outer_step": st.integers(-1, 100),
            "generation": small_ints,
        }
    ),
    error_feedback=st.none() | st.builds(lambda r: {"residual": r}, tensors()),
    fragments=st.none()
    | st.fixed_dictionaries(
        {
            "count": st.integers(2, 4),
            "layout": st.text("0123456789abcdef", min_size=16, max_size=16),
            "installed": st.none() | st.lists(small_ints, max_size=4),
        }
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node_states)
def test_random_node_states_survive_the_checkpoint_codec(state: NodeState) -> None:
    # Through the trainer's checkpoint encoding too (tensors apart, JSON for the rest).
    tree, saved_tensors = statecodec.encode(node_to_checkpoint(state))
    saved = statecodec.decode(json.loads(json.dumps(tree)), saved_tensors)
    again = node_from_checkpoint(saved, NodeState())
    assert same_tensors(again.baseline, state.baseline)
    for field in ("node_id", "role", "local_step", "last_global_step", "last_uploaded_step"):
        assert getattr(again, field) == getattr(state, field), field
    assert again.pending == state.pending
    assert again.fragments == state.fragments
    if state.error_feedback is None:
        assert again.error_feedback is None
    else:
        assert same_tensors(again.error_feedback["residual"], state.error_feedback["residual"])


# --------------------------------------------------------------------------- previous release


def test_master_state_files_of_the_previous_release_still_load(tmp_path: Path) -> None:
    for name in ("master_state_k1.safetensors", "master_state_k2.safetensors"):
        expected = EXPECTED[name]
        state_dir = tmp_path / name
        state_dir.mkdir()
        shutil.copyfile(FIXTURES / name, state_dir / STATE_FILE)
        loop = make_master(MemoryTransport(), tmp_path, state_dir=state_dir, cache_dir=tmp_path)
        assert loop.keeper.has_local_state
        assert loop.outer_step == expected["outer_step"]
        assert loop.keeper.published_step == expected["published_step"]
        assert len(loop.keeper.processed) == expected["processed"]
        assert [r["reason"] for r in loop.keeper.rejections] == expected["rejections"]
        assert len(loop.keeper.state.signatures) == expected["signatures"]
        assert len(loop.keeper.norm_history) == expected["norm_history"]
        assert loop.keeper.fragment_steps == expected["fragment_steps"]
        assert loop.keeper.fragment_versions == expected["fragment_versions"]
        assert loop.halted == expected["halted"]
        assert sorted(loop.global_state) == expected["global_keys"]
        assert sorted(loop.keeper.momentum) == expected["momentum_keys"]
        # ... and the state it writes now holds the same.
        loop.keeper.save()
        assert_same(loop.keeper.state, load_state(state_dir / STATE_FILE))


def checkpointed(name: str) -> dict[str, Any]:
    tensors, meta = load_tensors(FIXTURES / name)
    return statecodec.decode(json.loads(meta["tree"]), tensors)


def test_a_master_checkpoint_of_the_previous_release_resumes_the_outer_state(
    tmp_path: Path,
) -> None:
    saved = checkpointed("master_node_state.safetensors")
    expected = EXPECTED["master_node_state.safetensors"]
    assert sorted(saved["outer"]) == expected["keys"]  # the previous release's form
    loop = make_master(MemoryTransport(), tmp_path)
    assert loop.load_state_dict(saved["outer"])
    assert loop.outer_step == expected["outer_step"] == 1
    assert set(loop.global_state) == {"counter", "a.weight", "a.bias", "b.weight", "b.bias"}
    assert len(loop.keeper.processed) == 1
    coordinator = DumbDiLoCoCoordinator(
        dist_config(role="master", node_id="m", inner_steps=4),
        make_net(),
        hub=MemoryTransport(),
        state_dir=tmp_path / "node",
    )
    coordinator.load_state_dict(saved)  # before start: the prepared startup state
    assert coordinator.local_step == 4


def test_node_checkpoints_of_the_previous_release_still_load(tmp_path: Path) -> None:
    for k, codec in ((1, "int8"), (2, "none")):
        saved = checkpointed(f"node_state_k{k}.safetensors")
        node = DumbDiLoCoCoordinator(
            dist_config(inner_steps=4, fragments=k, compression=codec, error_feedback=True),
            make_net(),
            hub=MemoryTransport(),
            state_dir=tmp_path / f"k{k}",
        )
        node.load_state_dict(saved)
        state = node.ctx.state
        assert state.local_step == 6 and state.pending is not None
        assert state.pending["upload_id"] == "abc123"
        assert same_tensors(state.baseline, saved["baseline"])
        again = node.state_dict()
        assert again["pending_delta"] == saved["pending_delta"]
        assert again.keys() == saved.keys()  # the same checkpoint form as before
        if k == 1:
            residual = saved["error_feedback"]["residual"]
            assert same_tensors(node.ctx.feedback.residual, residual)
        else:
            assert again["fragments"] == saved["fragments"]
