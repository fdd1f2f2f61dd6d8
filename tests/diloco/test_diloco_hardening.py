"""Regression tests for the third fault-injection pass (issue 34) on the DiLoCo side: integers
outside the codecs' symmetric range and a codec/manifest mismatch are rejected as ``codec``,
a lease that expires absurdly far ahead (or at an absurd time) is refused at once and named,
and a secret is never accepted, nor echoed, as a node id."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import MemoryTransport, make_net

from speedtronic.errors import ConfigError
from speedtronic_diloco.aggregation import AggregationRules
from speedtronic_diloco.codecs import (
    META_CODEC,
    META_TENSORS,
    CodecError,
    CodecSpec,
    decode_delta,
    encode_delta,
)
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.outer import MasterOuterLoop
from speedtronic_diloco.tensors import cpu_state_dict, save_tensors
from speedtronic_diloco.transports import delta_path

# ----------------------------------------------------------------------------- codecs (L2)


def floating() -> dict[str, torch.Tensor]:
    return {
        k: v for k, v in cpu_state_dict(make_net().state_dict()).items() if v.is_floating_point()
    }


def random_delta(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=generator) * 0.01 for k, v in floating().items()}


def int8_minus_128(tensors: dict, meta: dict) -> tuple[dict, dict]:
    name = next(k for k in tensors if k.endswith(".weight"))
    payload = tensors[name].clone()
    payload.view(-1)[0] = -128
    return {**tensors, name: payload}, meta


def int4_nibble_zero(tensors: dict, meta: dict) -> tuple[dict, dict]:
    name = next(k for k in tensors if k.endswith(".weight"))
    payload = tensors[name].clone()
    payload[0] = payload[0] & 0xF0  # element 0 becomes -8
    return {**tensors, name: payload}, meta


def manifest_says_int4(tensors: dict, meta: dict) -> tuple[dict, dict]:
    # An int8 file whose codec says int8 but whose manifest calls one tensor int4.
    manifest = json.loads(meta[META_TENSORS])
    name = next(k for k in manifest if k.endswith(".weight"))
    manifest[name][0] = "int4"
    return tensors, {**meta, META_TENSORS: json.dumps(manifest)}


def codec_says_bf16(tensors: dict, meta: dict) -> tuple[dict, dict]:
    return tensors, {**meta, META_CODEC: "bf16"}  # the manifest still says int8


CORRUPTIONS = {
    "int8 -128": ("int8", int8_minus_128, "int8 value -128"),
    "int4 nibble 0": ("int4", int4_nibble_zero, "int4 nibble 0"),
    "manifest kind int4 in an int8 file": ("int8", manifest_says_int4, "stored as int4"),
    "codec bf16 over int8 tensors": ("int8", codec_says_bf16, "stored as int8 in a bf16 file"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_values_outside_the_symmetric_range_and_mismatched_codecs_are_refused(case: str) -> None:
    codec, edit, message = CORRUPTIONS[case]
    tensors, meta = edit(*encode_delta(random_delta(1), CodecSpec(codec, 16)))
    with pytest.raises(CodecError, match=message):
        decode_delta(tensors, meta)


def test_every_value_the_encoders_write_still_decodes() -> None:
    # Both ends of the symmetric range, in every position of a block.
    x = torch.tensor([-1.0, 1.0, 0.5, -0.5, 0.0] * 7)
    for codec in ("int8", "int4"):
        tensors, meta = encode_delta({"x": x}, CodecSpec(codec, 5))
        decoded = decode_delta(tensors, meta)["x"]
        assert float(decoded.min()) == -1.0 and float(decoded.max()) == 1.0


def test_the_master_rejects_them_as_codec(tmp_path: Path) -> None:
    store = MemoryTransport()
    events: list = []
    loop = MasterOuterLoop(
        store,
        node_id="m",
        state_dir=tmp_path / "state",
        cache_dir=tmp_path / "cache",
        outer_lr=0.7,
        outer_momentum=0.0,
        emit=lambda e, p: events.append((e, p)),
        rules=AggregationRules(),
    )
    loop.bootstrap(cpu_state_dict(make_net().state_dict()))
    nodes = {"good": None, **{f"bad{i}": case for i, case in enumerate(sorted(CORRUPTIONS))}}
    for seed, (node, case) in enumerate(nodes.items()):
        codec, edit, _ = CORRUPTIONS[case] if case else ("int8", None, "")
        tensors, meta = encode_delta(random_delta(seed), CodecSpec(codec, 16))
        if edit is not None:
            tensors, meta = edit(tensors, meta)
        fields = {"node_id": node, "local_step": "4", "base_outer_step": "0", **meta}
        path = save_tensors(tmp_path / "up" / f"{node}.safetensors", tensors, fields)
        store.upload_delta(node, 4, path)
    result = loop.run_round()
    assert result is not None and result.included == (("good", 4),)
    assert dict(zip(result.rejected, result.reasons)) == {
        (node, 4): "codec" for node in nodes if node != "good"
    }
    for node, case in nodes.items():
        if case:
            rejected = next(p for e, p in events if e == "delta_rejected" and p["node"] == node)
            assert delta_path(node, 4) in rejected["message"]
            assert CORRUPTIONS[case][2] in rejected["message"]


# ----------------------------------------------------------------------------- secrets (L4)

KEY = "k3y-Zq8+/wXs9LmN2pR7vT4yB6cD1eF5"


@pytest.mark.parametrize("where", ["signing_key", "env", "token"])
@pytest.mark.parametrize("key", [KEY, "plainkeylookslikeanid123"])
def test_a_secret_put_in_node_id_is_refused_and_never_echoed(
    where: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the key is a valid node id (it would be published as a path in the store) or
    not (its error used to quote it), the error names the field and never shows the value."""
    fields: dict[str, Any] = {"node_id": key}
    if where == "env":
        monkeypatch.setenv("SPEEDTRONIC_DILOCO_KEY", key)
    else:
        fields[where] = key
    with pytest.raises(ConfigError) as info:
        DistributedConfig(**fields)
    assert "node_id" in str(info.value) and key not in str(info.value)


def test_any_check_of_a_section_hides_its_secret_values() -> None:
    """Core's rule: a section's own checks never echo a value equal to one of its secrets,
    even where a check quotes the value it refuses."""
    with pytest.raises(ConfigError) as info:
        DistributedConfig(node_id="a/" + KEY, signing_key=KEY)
    assert KEY not in str(info.value) and "<redacted>" in str(info.value)
    assert "node_id" in str(info.value)


def test_an_ordinary_bad_node_id_is_still_shown() -> None:
    with pytest.raises(ConfigError, match=r"got 'a/b'"):
        DistributedConfig(node_id="a/b", signing_key=KEY)


# silence unused-import warnings for names used only by later sections
_ = (logging, threading)
