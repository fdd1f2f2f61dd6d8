"""HubTransport failure handling over real HTTP: what is transient, what is permanent, that
every request is bounded, that the client's hidden retries are cut short, and that the token
never shows up in a message."""

from __future__ import annotations

import email.utils
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hub_emulator import HubEmulator
from hub_fixtures import (  # noqa: F401
    HANG_TIMEOUT,
    REPO,
    TOKEN,
    client_sleeps_fixture,
    delta_file,
    hub_fixture,
    publish,
    transport,
)
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import OfflineModeIsEnabled

from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.transports import (
    DeltaInfo,
    GlobalMetadata,
    PermanentTransportError,
    TransientTransportError,
    TransportError,
)
from speedtronic_diloco.transports.hub import HubTransport
from speedtronic_diloco.transports.hub_errors import classify, retry_after

Op = Callable[[HubTransport, Path, GlobalMetadata], object]


def _seeded(hub: HubEmulator, tmp_path: Path) -> GlobalMetadata:
    """A repo with a published global (returned, pinned) and one delta of node-b."""
    hub.add_repo(REPO)
    store = transport(hub)
    published = publish(store, tmp_path, 1, b"weights")
    store.upload_delta("node-b", 10, delta_file(tmp_path, "seed", b"delta"))
    return published


# Each operation, the request kind a fault targets, and that request's method.
OPERATIONS: dict[str, tuple[Op, str, str | None]] = {
    "read_global_metadata": (lambda s, p, m: s.read_global_metadata(), "resolve", "GET"),
    "download_global": (lambda s, p, m: s.download_global(m, p / "g"), "resolve", "GET"),
    "publish_global": (lambda s, p, m: publish(s, p, 2, b"weights 2"), "commit", None),
    "publish_global/preupload": (lambda s, p, m: publish(s, p, 2, b"weights 2"), "preupload", None),
    "upload_delta": (
        lambda s, p, m: s.upload_delta("node-a", 20, delta_file(p, "up", b"up")),
        "commit",
        None,
    ),
    "upload_delta/preupload": (
        lambda s, p, m: s.upload_delta("node-a", 20, delta_file(p, "up", b"up")),
        "preupload",
        None,
    ),
    "list_deltas": (lambda s, p, m: s.list_deltas(), "tree", None),
    "download_delta": (
        lambda s, p, m: s.download_delta(
            DeltaInfo("node-b", 10, "nodes/node-b/delta_10.safetensors", 5, None), p / "d"
        ),
        "resolve",
        "GET",
    ),
}


def _count(hub: HubEmulator, kind: str, since: int) -> int:
    return sum(1 for record in hub.requests[since:] if record.kind == kind)


TRANSIENT_CASES = [(name, 503) for name in sorted(OPERATIONS)] + [
    (name, status)
    for name in ("list_deltas", "upload_delta/preupload", "download_global")
    for status in (408, 429, 500)
]
PERMANENT_CASES = [(name, 401, "authentication failed") for name in sorted(OPERATIONS)] + [
    (name, status, says)
    for name in ("read_global_metadata", "upload_delta", "list_deltas")
    for status, says in ((403, "permission denied"), (404, "HTTP 404"))
]


@pytest.mark.parametrize(("name", "status"), TRANSIENT_CASES)
def test_transient_statuses_fail_fast_and_carry_retry_after(
    hub: HubEmulator, tmp_path: Path, client_sleeps: list[float], name: str, status: int
) -> None:
    seeded = _seeded(hub, tmp_path)
    op, kind, method = OPERATIONS[name]
    before = len(hub.requests)
    hub.inject(kind, status=status, retry_after=7, method=method)
    with pytest.raises(TransientTransportError) as failure:
        op(transport(hub), tmp_path, seeded)
    assert f"HTTP {status}" in str(failure.value)
    assert failure.value.retry_after == 7
    assert _count(hub, kind, before) == 1  # the client did not retry on its own
    assert client_sleeps == []


@pytest.mark.parametrize(("name", "status", "says"), PERMANENT_CASES)
def test_permanent_statuses_are_not_retried_and_say_why(
    hub: HubEmulator, tmp_path: Path, name: str, status: int, says: str
) -> None:
    seeded = _seeded(hub, tmp_path)
    op, kind, method = OPERATIONS[name]
    before = len(hub.requests)
    hub.inject(kind, status=status, count=5, method=method)
    policy = RetryPolicy(retries=4, backoff=0.0)
    with pytest.raises(PermanentTransportError) as failure:
        policy.call(name, lambda: op(transport(hub), tmp_path, seeded))
    assert says in str(failure.value)
    assert REPO in str(failure.value)
    assert _count(hub, kind, before) == 1


def test_missing_repository_is_permanent(hub: HubEmulator) -> None:
    store = transport(hub)
    for call in (store.read_global_metadata, store.list_deltas):
        with pytest.raises(PermanentTransportError, match="repository not found"):
            call()


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_dropped_connections_are_transient(
    hub: HubEmulator, tmp_path: Path, client_sleeps: list[float], name: str
) -> None:
    seeded = _seeded(hub, tmp_path)
    op, kind, method = OPERATIONS[name]
    before = len(hub.requests)
    hub.inject_drop(kind, method=method)
    with pytest.raises(TransientTransportError, match="failed"):
        op(transport(hub), tmp_path, seeded)
    assert _count(hub, kind, before) == 1
    assert client_sleeps == []


@pytest.mark.parametrize(
    "name", ["publish_global", "upload_delta/preupload", "list_deltas", "download_delta"]
)
def test_a_hanging_request_times_out(
    hub: HubEmulator, tmp_path: Path, client_sleeps: list[float], name: str
) -> None:
    """create_commit and list_repo_tree take no timeout of their own; ours still applies."""
    seeded = _seeded(hub, tmp_path)
    op, kind, method = OPERATIONS[name]
    head, before = hub.head(REPO), len(hub.requests)
    hub.inject_hang(kind, seconds=60, method=method)
    with pytest.raises(TransientTransportError, match=f"timed out after {HANG_TIMEOUT:g} s"):
        op(transport(hub, timeout=HANG_TIMEOUT), tmp_path, seeded)
    assert hub.head(REPO) == head
    assert _count(hub, kind, before) == 1
    assert client_sleeps == []


@pytest.mark.parametrize(
    ("kind", "fault"), [("preupload", "503"), ("commit", "503"), ("commit", "drop")]
)
def test_a_failed_publication_leaves_readers_on_the_previous_global(
    hub: HubEmulator, tmp_path: Path, client_sleeps: list[float], kind: str, fault: str
) -> None:
    """A fault between the steps of a publication (after the weights were announced, at the
    commit) leaves the head, the metadata and the weights of the previous global together."""
    seeded = _seeded(hub, tmp_path)
    head = hub.head(REPO)
    if fault == "drop":
        hub.inject_drop(kind)
    else:
        hub.inject(kind, status=503)
    with pytest.raises(TransientTransportError):
        publish(transport(hub), tmp_path, 2, b"weights 2")
    assert hub.head(REPO) == head
    reader = transport(hub)
    metadata = reader.read_global_metadata()
    assert metadata is not None
    assert (metadata.outer_step, metadata.sha256) == (1, seeded.sha256)
    assert reader.download_global(metadata, tmp_path / "g").read_bytes() == b"weights"


# -- the retry policy on top ---------------------------------------------------------------


def test_transient_faults_are_retried_and_the_operation_completes(
    hub: HubEmulator, tmp_path: Path
) -> None:
    _seeded(hub, tmp_path)
    hub.inject("commit", status=503, count=2)
    hub.inject("tree", status=429, retry_after=0)
    hub.inject_drop("resolve", method="GET")
    store = transport(hub)
    policy = RetryPolicy(retries=3, backoff=0.0)
    policy.call("upload", lambda: store.upload_delta("node-a", 5, delta_file(tmp_path, "x", b"x")))
    listed = policy.call("list", store.list_deltas)
    metadata = policy.call("read", store.read_global_metadata)
    assert [info.key for info in listed] == [("node-a", 5), ("node-b", 10)]
    assert metadata is not None and metadata.outer_step == 1
    assert hub.faults_left() == 0


class _RecordedWaits:
    """A stand-in for the stop event: records the policy's waits instead of waiting."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def is_set(self) -> bool:
        return False

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return False


def test_backoff_is_exponential_with_jitter_and_honours_retry_after(
    hub: HubEmulator, tmp_path: Path
) -> None:
    _seeded(hub, tmp_path)
    store = transport(hub)
    hub.inject("tree", status=503, count=3)
    waits = _RecordedWaits()
    RetryPolicy(retries=4, backoff=1.0).call("list", store.list_deltas, waits)  # type: ignore[arg-type]
    assert len(waits.waits) == 3
    for attempt, wait in enumerate(waits.waits):
        assert 0.5 * 2**attempt <= wait <= 2**attempt

    hub.inject("tree", status=429, retry_after=7)
    waits = _RecordedWaits()
    RetryPolicy(retries=4, backoff=1.0).call("list", store.list_deltas, waits)  # type: ignore[arg-type]
    assert waits.waits == [7.0]


def test_retrying_stops_before_the_total_time_bound(hub: HubEmulator, tmp_path: Path) -> None:
    _seeded(hub, tmp_path)
    before = len(hub.requests)
    hub.inject("commit", status=429, retry_after=600, count=5)
    waits = _RecordedWaits()
    policy = RetryPolicy(retries=4, backoff=1.0, max_total=60.0)
    with pytest.raises(TransientTransportError, match="HTTP 429"):
        policy.call(
            "upload",
            lambda: transport(hub).upload_delta("node-a", 1, delta_file(tmp_path, "x", b"x")),
            waits,  # type: ignore[arg-type]
        )
    assert waits.waits == []  # waiting 600 s would break the 60 s bound: give up now
    assert _count(hub, "commit", before) == 1


# -- classification details ----------------------------------------------------------------


def test_hf_hub_download_errors_are_classified_by_their_cause(
    hub: HubEmulator, tmp_path: Path
) -> None:
    """hf_hub_download wraps a 403 on its HEAD in LocalEntryNotFoundError."""
    _seeded(hub, tmp_path)
    hub.inject("resolve", status=403, method="HEAD")
    with pytest.raises(Exception) as raised:
        hf_hub_download(
            REPO,
            "global/step_count.json",
            endpoint=hub.endpoint,
            token=TOKEN,
            cache_dir=tmp_path / "cache",
        )
    assert type(raised.value).__name__ == "LocalEntryNotFoundError"
    error = classify(raised.value, "download")
    assert isinstance(error, PermanentTransportError)
    assert "HTTP 403" in str(error)


def test_programming_errors_are_not_translated() -> None:
    assert classify(KeyError("bug"), "x") is None
    assert classify(TypeError("bug"), "x") is None


def test_offline_mode_is_permanent() -> None:
    error = classify(OfflineModeIsEnabled("offline"), "x")
    assert isinstance(error, PermanentTransportError)
    assert "HF_HUB_OFFLINE" in str(error)


def test_retry_after_forms() -> None:
    assert retry_after({"Retry-After": "12"}) == 12.0
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 20 < (retry_after({"retry-after": later}) or 0) <= 31
    assert retry_after({"RateLimit": '"api";r=0;t=42'}) == 42.0
    assert retry_after({"RateLimit": '"api";r=5;t=42'}) is None
    assert retry_after({}) is None


# -- the token -------------------------------------------------------------------------------


def test_the_token_never_appears_in_messages_or_logs(
    hub: HubEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Ours and the client's own logs at DEBUG; HTTP libraries' wire traces are out of scope.
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="speedtronic")
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")
    messages: list[str] = []
    _seeded(hub, tmp_path)
    store = transport(hub, timeout=HANG_TIMEOUT)
    faults: list[Callable[[], None]] = [
        lambda: hub.inject("resolve", status=403, message=f"token {TOKEN} may not read"),
        lambda: hub.inject("tree", status=503, message=f"overloaded for {TOKEN}"),
        lambda: hub.inject("commit", status=401),
        lambda: hub.inject_hang("preupload", seconds=30),
        lambda: hub.inject_drop("resolve"),
    ]
    for index, fault in enumerate(faults):
        fault()
        for call in (
            store.read_global_metadata,
            store.list_deltas,
            lambda i=index: store.upload_delta("node-a", i, delta_file(tmp_path, "t", b"%d" % i)),
        ):
            try:
                call()
            except TransportError as exc:
                messages.append(str(exc))
                messages.append(repr(exc.__cause__))
        hub.clear_faults()
    assert any("<redacted>" in message for message in messages)
    assert any("authentication failed" in message for message in messages)
    assert any("timed out" in message for message in messages)
    everything = "\n".join([*messages, caplog.text, repr(store), store.description])
    assert TOKEN not in everything
