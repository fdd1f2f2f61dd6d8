"""Compressed deltas (speedtronic_diloco.codecs): error bounds, exact int4 packing, the file
format and its validation, error feedback and its reset rule, bf16 globals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from speedtronic_diloco.codecs import (
    META_BLOCK,
    META_CODEC,
    META_FORMAT,
    META_TENSORS,
    SCALE_SUFFIX,
    CodecError,
    CodecSpec,
    ErrorFeedback,
    decode_delta,
    decode_delta_file,
    encode_delta,
    encode_global,
    error_bound,
    pack_int4,
    residual_survives,
    restore_dtypes,
    unpack_int4,
)
from speedtronic_diloco.tensors import load_tensors, save_tensors


def sample(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(37, 19, generator=g) * 0.01,  # 703 elements: a short last block
        "b": torch.randn(5, generator=g),
        "h": (torch.randn(300, generator=g) * 3).to(torch.float16),
        "d": torch.randn(2, 300, generator=g, dtype=torch.float64) * 1e-4,
        "z": torch.zeros(600),  # all-zero blocks
        "e": torch.zeros(0, 4),
    }


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("scales", ["fp32", "bf16"])
@pytest.mark.parametrize("block", [1, 7, 256])
def test_quantised_round_trip_within_the_documented_bound(codec, scales, block) -> None:
    delta = sample()
    spec = CodecSpec(codec, block, scales)
    tensors, meta = encode_delta(delta, spec)
    decoded = decode_delta(tensors, meta)
    assert decoded.keys() == delta.keys()
    for name, original in delta.items():
        out = decoded[name]
        assert out.shape == original.shape
        assert out.dtype == torch.promote_types(original.dtype, torch.float32)
        if original.numel() == 0:
            continue
        flat = original.reshape(-1).to(torch.float64)
        err = (flat - out.reshape(-1).to(torch.float64)).abs()
        for start in range(0, flat.numel(), block):
            part = slice(start, start + block)
            absmax = float(flat[part].abs().max())
            bound = error_bound(codec, absmax, scales)
            assert float(err[part].max()) <= bound * (1 + 1e-6) + 1e-30, (name, start)
        zeros = out.reshape(-1)[flat == 0]
        assert zeros.numel() == 0 or float(zeros.abs().max()) == 0.0


def test_bf16_round_trip_is_relative_2_to_minus_8() -> None:
    delta = sample()
    tensors, meta = encode_delta(delta, CodecSpec("bf16"))
    assert tensors["w"].dtype == torch.bfloat16
    decoded = decode_delta(tensors, meta)
    for name, original in delta.items():
        wide = original.to(torch.float64)
        err = (wide - decoded[name].to(torch.float64)).abs()
        assert bool((err <= wide.abs() * 2.0**-8).all()), name


def test_int4_packing_is_exact_for_every_representable_value() -> None:
    for count in (0, 1, 2, 15, 16, 17, 1001):
        values = torch.arange(count, dtype=torch.int64) % 16 - 8
        packed = pack_int4(values)
        assert packed.dtype == torch.uint8 and packed.numel() == (count + 1) // 2
        assert torch.equal(unpack_int4(packed, count), values.to(torch.int8))
    # element 2i in the low nibble, 2i + 1 in the high one, stored as value + 8
    assert pack_int4(torch.tensor([-8, 7, 0])).tolist() == [0 | (15 << 4), 8 | (8 << 4)]
    with pytest.raises(CodecError):
        pack_int4(torch.tensor([8]))


@pytest.mark.parametrize("codec, qmax", [("int8", 127), ("int4", 7)])
def test_representable_values_round_trip_exactly(codec, qmax) -> None:
    scale = 2.0**-10  # every k * scale is exact in float32, and absmax / qmax == scale
    ks = torch.arange(-qmax, qmax + 1, dtype=torch.float32)
    x = torch.cat([ks, ks.flip(0), torch.tensor([qmax * 1.0])]) * scale
    block = x.numel()
    tensors, meta = encode_delta({"x": x}, CodecSpec(codec, block))
    assert torch.equal(decode_delta(tensors, meta)["x"], x)


def test_sizes_on_disk(tmp_path: Path) -> None:
    delta = {"w": torch.randn(64, 256)}
    sizes = {}
    for codec in ("none", "bf16", "int8", "int4"):
        tensors, meta = encode_delta(delta, CodecSpec(codec))
        path = save_tensors(tmp_path / f"{codec}.safetensors", tensors, meta)
        sizes[codec] = path.stat().st_size
    raw = 64 * 256 * 4
    assert sizes["none"] < raw + 200
    assert sizes["bf16"] < raw / 2 + 400
    assert sizes["int8"] < raw / 4 + 64 * 4 + 600  # one fp32 scale per 256 elements
    assert sizes["int4"] < raw / 8 + 64 * 4 + 600


def test_none_is_exactly_todays_file(tmp_path: Path) -> None:
    delta = sample()
    delta.pop("e")
    tensors, meta = encode_delta(delta, CodecSpec("none"))
    assert meta == {} and tensors.keys() == delta.keys()
    assert all(tensors[k] is delta[k] for k in delta)
    plain = save_tensors(tmp_path / "a.safetensors", delta, {"node_id": "n", "local_step": "3"})
    loaded, meta2, compressed = decode_delta_file(plain)
    assert not compressed and meta2 == {"node_id": "n", "local_step": "3"}
    for name, tensor in delta.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("codec", ["none", "bf16", "int8", "int4"])
def test_non_finite_input_is_refused_before_encoding(codec, bad) -> None:
    delta = {"ok": torch.ones(3), "layer.weight": torch.tensor([1.0, bad])}
    with pytest.raises(CodecError, match=r"layer\.weight: non-finite"):
        encode_delta(delta, CodecSpec(codec))


def test_values_beyond_the_codec_range_are_refused() -> None:
    huge = {"x": torch.tensor([1e300, 1.0], dtype=torch.float64)}
    with pytest.raises(CodecError, match="x: values beyond the bfloat16 range"):
        encode_delta(huge, CodecSpec("bf16"))
    with pytest.raises(CodecError, match="x: values too large"):
        encode_delta(huge, CodecSpec("int8"))


def test_complex_tensors_travel_raw() -> None:
    delta = {"c": torch.randn(4, dtype=torch.complex64), "r": torch.randn(4)}
    tensors, meta = encode_delta(delta, CodecSpec("int4"))
    assert json.loads(meta[META_TENSORS])["c"][0] == "raw"
    decoded = decode_delta(tensors, meta)
    assert torch.equal(decoded["c"], delta["c"])


def test_spec_validation() -> None:
    with pytest.raises(CodecError):
        CodecSpec("zstd")
    with pytest.raises(CodecError):
        CodecSpec("int8", 0)
    with pytest.raises(CodecError):
        CodecSpec("int8", 256, "fp16")


# ----------------------------------------------------------------------------- corrupt files
def write(tmp_path: Path, tensors, meta) -> Path:
    return save_tensors(tmp_path / "nodes_w1_delta_10.safetensors", tensors, meta)


def corruptions():
    def meta_edit(key, value):
        def edit(tensors, meta):
            meta = dict(meta)
            if value is None:
                meta.pop(key)
            else:
                meta[key] = value
            return tensors, meta

        return edit

    def manifest_edit(fn):
        def edit(tensors, meta):
            manifest = json.loads(meta[META_TENSORS])
            fn(manifest)
            return tensors, {**meta, META_TENSORS: json.dumps(manifest)}

        return edit

    def tensor_edit(fn):
        def edit(tensors, meta):
            tensors = dict(tensors)
            fn(tensors)
            return tensors, meta

        return edit

    return {
        "unknown codec": (meta_edit(META_CODEC, "zstd"), "unknown codec 'zstd'"),
        "future format": (meta_edit(META_FORMAT, "2"), "unknown codec format '2'"),
        "no format": (meta_edit(META_FORMAT, None), "unknown codec format None"),
        "bad block": (meta_edit(META_BLOCK, "0"), "codec_block 0"),
        "bad block text": (meta_edit(META_BLOCK, "x"), "bad codec_block"),
        "bad json": (meta_edit(META_TENSORS, "{"), "not valid JSON"),
        "manifest list": (meta_edit(META_TENSORS, "[]"), "not a JSON object"),
        "bad kind": (manifest_edit(lambda m: m["w"].__setitem__(0, "int3")), "unknown tensor"),
        "bad dtype": (manifest_edit(lambda m: m["w"].__setitem__(1, "int64")), "bad dtype"),
        "wrong shape": (
            manifest_edit(lambda m: m["w"].__setitem__(2, [37, 20])),
            "payload of 703",
        ),
        "missing tensor": (
            manifest_edit(lambda m: m.__setitem__("q", m["b"])),
            "q: tensor missing",
        ),
        "missing scales": (tensor_edit(lambda t: t.pop("w" + SCALE_SUFFIX)), "w: scales missing"),
        "short payload": (
            tensor_edit(lambda t: t.__setitem__("w", t["w"].reshape(-1)[:-1].clone())),
            "payload of 702",
        ),
        "short scales": (
            tensor_edit(lambda t: t.__setitem__("w" + SCALE_SUFFIX, t["w" + SCALE_SUFFIX][:-1])),
            "scales, expected",
        ),
        "nan scales": (
            tensor_edit(
                lambda t: t.__setitem__("w" + SCALE_SUFFIX, t["w" + SCALE_SUFFIX] * float("nan"))
            ),
            "non-finite or negative scales",
        ),
        "negative scales": (
            tensor_edit(lambda t: t.__setitem__("w" + SCALE_SUFFIX, -t["w" + SCALE_SUFFIX])),
            "non-finite or negative scales",
        ),
        "extra tensor": (
            tensor_edit(lambda t: t.__setitem__("smuggled", torch.ones(2))),
            "not in codec_tensors",
        ),
        "payload dtype": (
            tensor_edit(lambda t: t.__setitem__("w", t["w"].to(torch.int16))),
            "expected 703 torch.int8",
        ),
    }


@pytest.mark.parametrize("case", sorted(corruptions()))
def test_a_corrupt_compressed_delta_is_refused_with_its_file_name(tmp_path: Path, case) -> None:
    edit, message = corruptions()[case]
    delta = {"w": torch.randn(37, 19), "b": torch.randn(5)}
    tensors, meta = edit(*encode_delta(delta, CodecSpec("int8", 64)))
    path = write(tmp_path, tensors, meta)
    with pytest.raises(CodecError) as info:
        decode_delta_file(path, tmp_path / "decoded.safetensors")
    assert str(path) in str(info.value)
    assert message in str(info.value)
    assert not (tmp_path / "decoded.safetensors").exists()


def test_an_unreadable_file_names_itself(tmp_path: Path) -> None:
    path = tmp_path / "delta_3.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(CodecError, match=r"delta_3\.safetensors"):
        decode_delta_file(path)


def test_decoded_file_is_a_plain_delta(tmp_path: Path) -> None:
    delta = sample()
    tensors, meta = encode_delta(delta, CodecSpec("int4", 32))
    source = write(tmp_path, tensors, {**meta, "node_id": "w1", "signature": "abc"})
    dest = tmp_path / "plain.safetensors"
    decoded, metadata, compressed = decode_delta_file(source, dest)
    assert compressed and metadata[META_CODEC] == "int4"
    plain, plain_meta = load_tensors(dest)
    assert plain_meta["node_id"] == "w1" and META_CODEC not in plain_meta
    assert "signature" not in plain_meta and plain_meta["decoded_from"] == "int4"
    assert plain.keys() == delta.keys()
    assert all(torch.equal(plain[k], decoded[k]) for k in plain)


# ----------------------------------------------------------------------------- error feedback
def drift(codec: str, enabled: bool, rounds: int = 50) -> tuple[float, float, float]:
    """``(|sum true - sum decoded|, largest single-round error, |sum true|)`` over ``rounds``
    deltas that share a persistent direction (as successive pseudo-gradients do)."""
    g = torch.Generator().manual_seed(1)
    direction = torch.randn(4096, generator=g)
    feedback = ErrorFeedback(CodecSpec(codec, 256), enabled=enabled)
    true_sum = torch.zeros(4096, dtype=torch.float64)
    sent_sum = torch.zeros(4096, dtype=torch.float64)
    worst = 0.0
    for _ in range(rounds):
        delta = {"w": (direction + 0.5 * torch.randn(4096, generator=g)) * 1e-3}
        encoded = feedback.encode(delta)
        decoded = decode_delta(encoded.tensors, encoded.metadata)["w"].to(torch.float64)
        worst = max(worst, float((delta["w"].to(torch.float64) - decoded).norm()))
        feedback.commit(encoded)
        true_sum += delta["w"].to(torch.float64)
        sent_sum += decoded
    return float((true_sum - sent_sum).norm()), worst, float(true_sum.norm())


@pytest.mark.parametrize("codec", ["int8", "int4", "bf16"])
def test_error_feedback_keeps_the_sum_of_decoded_deltas_on_track(codec) -> None:
    with_ef, one_round, total = drift(codec, enabled=True)
    without, _, _ = drift(codec, enabled=False)
    # With feedback the gap after 50 rounds is the last residual: at most about one round's
    # quantisation error (a little more: that round quantised delta + residual).
    assert with_ef <= 2.0 * one_round
    assert with_ef < without / 4
    assert with_ef / total < 0.01


def test_encode_does_not_move_the_residual_until_committed() -> None:
    feedback = ErrorFeedback(CodecSpec("int4"))
    delta = {"w": torch.randn(1000)}
    first = feedback.encode(delta)
    assert feedback.residual == {}
    assert 0 < first.error < 0.2
    again = feedback.encode(delta)  # the upload failed: the next attempt starts the same way
    assert all(torch.equal(again.tensors[k], first.tensors[k]) for k in first.tensors)
    feedback.commit(first)
    assert torch.equal(feedback.residual["w"], first.residual["w"])
    corrected = feedback.encode(delta)
    assert not torch.equal(corrected.tensors["w"], first.tensors["w"])


def test_residual_is_relative_error_and_state_round_trips() -> None:
    feedback = ErrorFeedback(CodecSpec("int8"))
    encoded = feedback.encode({"w": torch.randn(5000), "v": torch.randn(3, 3)})
    feedback.commit(encoded)
    assert math.isclose(encoded.error, feedback.norm() / encoded.norm, rel_tol=1e-6)
    other = ErrorFeedback(CodecSpec("int8"))
    other.load_state_dict(feedback.state_dict())
    assert all(torch.equal(other.residual[k], feedback.residual[k]) for k in feedback.residual)
    other.reset(["w"])
    assert list(other.residual) == ["v"]
    other.reset()
    assert other.residual == {}


def test_residual_of_other_fragments_is_kept_and_mismatched_shapes_wait() -> None:
    feedback = ErrorFeedback(CodecSpec("int4"))
    feedback.commit(feedback.encode({"a": torch.randn(100), "b": torch.randn(100)}))
    kept_b = feedback.residual["b"]
    feedback.commit(feedback.encode({"a": torch.randn(100)}))  # a fragment delta: only "a"
    assert feedback.residual["b"] is kept_b


def test_compression_none_flushes_a_leftover_residual() -> None:
    feedback = ErrorFeedback(CodecSpec("int4"))
    feedback.commit(feedback.encode({"w": torch.randn(100)}))
    residual = feedback.residual["w"]
    plain = ErrorFeedback(CodecSpec("none"))
    plain.load_state_dict(feedback.state_dict())
    delta = {"w": torch.randn(100)}
    encoded = plain.encode(delta)
    assert encoded.metadata == {}
    assert torch.allclose(encoded.tensors["w"], delta["w"] + residual)
    plain.commit(encoded)
    assert plain.residual == {}


def test_the_reset_rule() -> None:
    assert not residual_survives(None, 0)  # the first global a node installs
    assert not residual_survives(-1, 3)
    assert residual_survives(4, 5, max_staleness=16)  # the next round: kept
    assert residual_survives(4, 20, max_staleness=16)
    assert not residual_survives(4, 21, max_staleness=16)  # away too long
    assert not residual_survives(4, 4)  # not newer: another run or the store went back
    assert not residual_survives(4, 2)


# ----------------------------------------------------------------------------- globals
def test_bf16_globals_and_restoring_the_model_dtype() -> None:
    weights = {
        "w": torch.randn(8),
        "h": torch.randn(8).to(torch.float16),
        "i": torch.arange(3),
        "c": torch.randn(2, dtype=torch.complex64),
    }
    published, meta = encode_global(weights, "bf16")
    assert meta == {META_CODEC: "bf16"}
    assert published["w"].dtype == torch.bfloat16
    assert published["h"].dtype == torch.float16 and published["i"] is weights["i"]
    restored = restore_dtypes(published, weights)
    assert {k: v.dtype for k, v in restored.items()} == {k: v.dtype for k, v in weights.items()}
    assert torch.allclose(restored["w"], weights["w"], rtol=2**-8)
    same, none_meta = encode_global(weights, "none")
    assert none_meta == {} and same["w"] is weights["w"]
