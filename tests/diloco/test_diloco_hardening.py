"""Regression tests for the third fault-injection pass (issue 34) on the DiLoCo side: integers
outside the codecs' symmetric range and a codec/manifest mismatch are rejected as ``codec``,
a lease that expires absurdly far ahead (or at an absurd time) is refused at once and named,
and a secret is never accepted, nor echoed, as a node id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import MemoryTransport, make_net
from diloco_runs import tiny_run

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
from speedtronic_diloco.lease import LeaseHeldError, LeaseKeeper
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.status import collect_status, summary_lines
from speedtronic_diloco.tensors import cpu_state_dict, save_tensors
from speedtronic_diloco.timestamps import format_utc, parse_timestamp
from speedtronic_diloco.transports import GLOBAL_METADATA, GlobalMetadata, delta_path
from speedtronic_diloco.transports.base import (
    LEASE_FILE,
    Lease,
    MalformedLeaseError,
    PermanentTransportError,
)
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

NO_WAIT = RetryPolicy(retries=0, backoff=0.0)

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
    loop.keeper.bootstrap(cpu_state_dict(make_net().state_dict()))
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


@pytest.mark.parametrize("field", ["repo_id", "endpoint"])
def test_a_secret_put_in_the_store_address_is_refused(field: str) -> None:
    with pytest.raises(ConfigError) as info:
        DistributedConfig(**{field: KEY, "signing_key": KEY})
    assert field in str(info.value) and KEY not in str(info.value)


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


# ----------------------------------------------------------------------------- leases (M1, L1)

YEAR = 365 * 86_400.0


def store_with_lease(tmp_path: Path, **fields: Any) -> SharedDirectoryTransport:
    """A shared-directory store whose ``lease.json`` is what a forger (or a far-off clock)
    wrote: another master's lease with ``fields``."""
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    lease = {"format": 1, "holder": "ghost", "epoch": 7, "instance": "x", "released": False}
    lease.update(fields)
    (tmp_path / "store" / LEASE_FILE).write_text(json.dumps(lease))
    return store


def acquire_within(keeper: LeaseKeeper, seconds: float = 60.0) -> Any:
    """``keeper.acquire()`` in a thread: a wait that would last a year fails the test instead
    of hanging it."""
    outcome: dict[str, Any] = {}
    stop = threading.Event()

    def run() -> None:
        try:
            outcome["lease"] = keeper.acquire(stop)
        except BaseException as exc:  # handed to the test below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        stop.set()
        thread.join(10)
        pytest.fail("acquire() was still waiting for the lease")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["lease"]


def test_take_over_of_a_lease_a_year_ahead_does_not_wait(tmp_path: Path) -> None:
    store = store_with_lease(tmp_path, expires_at=time.time() + YEAR, renewed_at=time.time())
    taken = acquire_within(LeaseKeeper(store, "m2", ttl=120.0, take_over=True, retry=NO_WAIT))
    assert (taken.holder, taken.epoch) == ("m2", 8)
    assert store.read_lease() == taken


def test_a_lease_a_year_ahead_is_refused_at_once_without_take_over(tmp_path: Path) -> None:
    store = store_with_lease(tmp_path, expires_at=time.time() + YEAR)
    with pytest.raises(LeaseHeldError) as refused:
        acquire_within(LeaseKeeper(store, "m2", ttl=120.0, retry=NO_WAIT))
    message = str(refused.value)
    assert LEASE_FILE in message and "expires_at" in message and "lease_ttl" in message
    assert "--take-over" in message
    assert store.read_lease().holder == "ghost"


def test_a_lease_within_ttl_and_skew_is_still_waited_for(tmp_path: Path) -> None:
    # 30 s beyond a 1 s ttl: within the skew slack, so a live lease (refused without take_over).
    store = store_with_lease(tmp_path, expires_at=time.time() + 31.0)
    with pytest.raises(LeaseHeldError, match=r"expires in 3\d s .* holds the lease"):
        LeaseKeeper(store, "m2", ttl=1.0, retry=NO_WAIT).acquire()


@pytest.mark.parametrize("field", ["expires_at", "renewed_at"])
@pytest.mark.parametrize("value", [1e18, -1e18])
@pytest.mark.parametrize("take_over", [False, True])
def test_absurd_lease_times_name_the_file_and_field(
    tmp_path: Path, field: str, value: float, take_over: bool
) -> None:
    times = {"expires_at": time.time() + 60.0, "renewed_at": time.time(), field: value}
    store = store_with_lease(tmp_path, **times)
    mine = LeaseKeeper(store, "m2", ttl=120.0, take_over=take_over, retry=NO_WAIT)
    if take_over:
        assert acquire_within(mine).epoch == 8
        return
    with pytest.raises(LeaseHeldError) as refused:
        acquire_within(mine)
    message = str(refused.value)
    assert f"{LEASE_FILE}: {field}" in message and "not a time" in message
    assert "Errno" not in message and "--take-over" in message
    # Lease.loads itself refuses it (parse_timestamp), keeping the epoch it could read
    with pytest.raises(MalformedLeaseError, match=f"{LEASE_FILE}: {field} .* not a time") as bad:
        store.read_lease()
    assert bad.value.epoch == 7


@pytest.mark.parametrize("value", [1e18, -1e18])
def test_status_names_an_absurd_published_at(tmp_path: Path, value: float) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    metadata = GlobalMetadata(outer_step=3, sha256="0" * 64, size=1, published_at=value)
    (tmp_path / "store" / GLOBAL_METADATA).write_bytes(metadata.dumps())
    status = collect_status(store)
    assert status.published_at is None
    assert any("step_count.json: published_at" in p for p in status.problems)
    assert any(line.startswith("published") for line in summary_lines(status))


@pytest.mark.parametrize("value", [1e18, -1.0, "12", True, None])
def test_lease_and_metadata_times_are_read_through_parse_timestamp(value: Any) -> None:
    """``Lease.loads`` and ``GlobalMetadata`` parse their times with the one helper: a time
    that is no time is one error naming the file and the field."""
    lease = {"format": 1, "holder": "ghost", "epoch": 3, "expires_at": value, "renewed_at": 1.0}
    with pytest.raises(MalformedLeaseError, match=r"^global/lease\.json: expires_at ") as bad:
        Lease.loads(json.dumps(lease).encode())
    assert bad.value.epoch == 3
    lease = {**lease, "expires_at": 5.0, "renewed_at": value}
    if value is None:
        assert Lease.loads(json.dumps(lease).encode()).renewed_at is None
    else:
        with pytest.raises(MalformedLeaseError, match=r"^global/lease\.json: renewed_at "):
            Lease.loads(json.dumps(lease).encode())
    metadata = {"outer_step": 1, "sha256": "0" * 64, "size": 1, "published_at": value}
    if value is None:
        assert GlobalMetadata.from_json(metadata).published_at is None
        return
    with pytest.raises(PermanentTransportError, match=r"^global/step_count\.json: published_at "):
        GlobalMetadata.from_json(metadata)


@pytest.mark.parametrize(
    "raw",
    [b'{"holder": "g", "epoch": 1e400, "expires_at": 5}', b"[1, 2]", b"\xff\xfe", b'{"epoch": 3}'],
)
def test_a_lease_that_is_no_lease_names_the_file(raw: bytes) -> None:
    with pytest.raises(
        MalformedLeaseError, match=r"^global/lease\.json: malformed lease \("
    ) as bad:
        Lease.loads(raw)
    assert bad.value.epoch is None


def test_parse_timestamp() -> None:
    assert parse_timestamp(None, "f", "t") is None and parse_timestamp(5, "f", "t") == 5.0
    for bad in (1e18, -1.0, float("nan"), float("inf"), "12", True, 10**400):
        with pytest.raises(ValueError, match=r"^f: t "):
            parse_timestamp(bad, "f", "t")
    assert format_utc(0.0) == "1970-01-01 00:00:00 UTC" and "not a time" in format_utc(1e18)


def master_config(tmp_path: Path, store: Path, **distributed: Any) -> Path:
    config = tiny_run(
        tmp_path,
        run={"name": "lease", "max_steps": 6, "threads": 1, "output_dir": None},
        data={"micro_batch_size": 2},
        checkpoint={"interval": 0, "save_final": False},
        logging={"log_every": 1000},
        precision=None,
        distributed={
            "node_id": "m2",
            "repo_id": str(store),
            "inner_steps": 3,
            "poll_interval": 0.2,
            "round_timeout": 1.0,
            "lease_ttl": 30.0,
            "retry_backoff": 0.05,
            "max_retries": 1,
            **distributed,
        },
    )
    path = tmp_path / "master.json"
    path.write_text(json.dumps(config))
    return path


def train(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SPEEDTRONIC_LOAD_PLUGINS", None)
    command = [sys.executable, "-m", "speedtronic", "train", "--config", str(config), *extra]
    # A generous bound: the bug this guards against was a wait of a year.
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_train_take_over_against_a_forged_lease_neither_hangs_nor_crashes(tmp_path: Path) -> None:
    """Real ``speedtronic train`` masters: a lease at -1e18 is one error line naming the file
    and field; ``--take-over`` of a lease a year ahead takes it at once and trains."""
    store = store_with_lease(tmp_path, expires_at=-1e18)
    refused = train(
        master_config(tmp_path, tmp_path / "store"), "--output-dir", str(tmp_path / "a")
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr and "Errno" not in refused.stderr
    assert f"{LEASE_FILE}: expires_at" in refused.stderr

    ahead = {"expires_at": time.time() + YEAR, "renewed_at": time.time()}
    (tmp_path / "store" / LEASE_FILE).write_text(
        json.dumps({"format": 1, "holder": "ghost", "epoch": 7, **ahead})
    )
    config = master_config(tmp_path, tmp_path / "store")
    done = train(config, "--take-over", "--output-dir", str(tmp_path / "b"))
    assert done.returncode == 0, done.stderr[-3000:]
    lease = store.read_lease()
    assert (lease.holder, lease.epoch) == ("m2", 8)
