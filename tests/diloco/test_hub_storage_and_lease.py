"""HubTransport: bounded storage (deletion commits, history squash), the lease and its fence,
and the secrets findings of issue 22 (URL credentials redacted, every client error type
classified, HfUriError against a mirror), over real HTTP against tests/hub_emulator."""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path

import huggingface_hub.errors as hf_errors
import pytest
from hub_emulator import HubEmulator
from hub_fixtures import REPO, TOKEN, delta_file, hub_fixture, publish, transport  # noqa: F401

from speedtronic.errors import TransportError
from speedtronic_diloco.transports import (
    GlobalMetadata,
    IntegrityError,
    PermanentTransportError,
    TransientTransportError,
)
from speedtronic_diloco.transports.base import Lease, LeaseConflictError, LeaseLostError
from speedtronic_diloco.transports.hub import HubTransport
from speedtronic_diloco.transports.hub_errors import classify


def lease(holder: str, epoch: int) -> Lease:
    return Lease(holder, epoch, time.time() + 60, renewed_at=time.time())


def commits(hub: HubEmulator) -> list[str]:
    return [r.path for r in hub.requests if r.kind == "commit" and r.status == 200]


# --------------------------------------------------------------------------- storage


def test_processed_deltas_are_deleted_in_one_commit_of_unchanged_files(
    hub: HubEmulator, tmp_path: Path
) -> None:
    store = transport(hub)
    store.create_store()
    for step in (1, 2, 3):
        store.upload_delta("n", step, delta_file(tmp_path, f"d{step}", b"delta %d" % step))
    listing = store.list_deltas()
    store.upload_delta("n", 3, delta_file(tmp_path, "d3b", b"replaced"))  # changed since
    before = len(commits(hub))
    assert store.delete_deltas(listing) == 2
    assert len(commits(hub)) == before + 1  # one commit for the whole batch
    assert [info.key for info in store.list_deltas()] == [("n", 3)]
    assert store.delete_deltas([]) == 0 and len(commits(hub)) == before + 1


def test_deletion_is_fenced_by_the_lease(hub: HubEmulator, tmp_path: Path) -> None:
    store = transport(hub)
    store.create_store()
    mine = store.write_lease(lease("a", 1), None)
    store.upload_delta("n", 1, delta_file(tmp_path, "d", b"x"))
    listing = store.list_deltas()
    store.write_lease(lease("b", 2), mine)
    with pytest.raises(LeaseLostError):
        store.delete_deltas(listing, fence=mine)
    assert len(store.list_deltas()) == 1


def test_squash_history_leaves_one_commit_and_stale_pins_fail_integrity(
    hub: HubEmulator, tmp_path: Path
) -> None:
    store = transport(hub)
    store.create_store()
    for step in range(4):
        publish(store, tmp_path, step, b"weights %d" % step)
    old = store.read_global_metadata()
    assert len(hub.history(REPO)) > 4
    stored = hub.stored_bytes(REPO)
    store.squash_history()
    assert len(hub.history(REPO)) == 1
    assert hub.stored_bytes(REPO) < stored
    with pytest.raises(IntegrityError, match="no longer exists"):
        store.download_global(old, tmp_path / "old.safetensors")
    fresh = store.read_global_metadata()
    assert store.download_global(fresh, tmp_path / "new.safetensors").read_bytes() == b"weights 3"


def test_store_bytes_counts_the_files_at_the_head(hub: HubEmulator, tmp_path: Path) -> None:
    store = transport(hub)
    store.create_store()
    store.upload_delta("n", 1, delta_file(tmp_path, "d", b"x" * 100))
    assert store.store_bytes() == sum(len(data) for data in hub.files(REPO).values())


# --------------------------------------------------------------------------- lease and fence


def test_lease_writes_are_compare_and_swap_on_the_head(hub: HubEmulator, tmp_path: Path) -> None:
    store = transport(hub)
    store.create_store()
    assert store.read_lease() is None
    first = store.write_lease(lease("a", 1), None)
    assert store.read_lease() == first
    with pytest.raises(LeaseConflictError) as refused:
        store.write_lease(lease("b", 1), None)
    assert refused.value.current == first
    # Workers' delta commits move the branch: the write is based on the lease, not the head.
    hub.inject_call(
        "commit",
        lambda: transport(hub).upload_delta("w", 1, delta_file(tmp_path, "w", b"w")),
        method="POST",
    )
    second = store.write_lease(lease("a", 2), first)
    assert store.read_lease() == second


def test_lease_write_whose_reply_was_lost_is_recognised(hub: HubEmulator) -> None:
    store = transport(hub)
    store.create_store()
    hub.inject_drop("commit", after_apply=True)
    fresh = lease("a", 1)
    with pytest.raises(TransientTransportError):
        store.write_lease(fresh, None)
    assert store.write_lease(fresh, None) == fresh  # the retry finds its own lease


def test_publication_is_fenced_at_the_commit_it_names_as_parent(
    hub: HubEmulator, tmp_path: Path
) -> None:
    store = transport(hub)
    store.create_store()
    mine = store.write_lease(lease("a", 1), None)
    source = tmp_path / "w.safetensors"
    source.write_bytes(b"weights 1")
    store.publish_global(source, GlobalMetadata.for_file(source, 1, master="a", lease_epoch=1))
    # Another master takes the lease right before our next commit lands: the 412 makes the
    # transport read again, and the fence then refuses.
    other = transport(hub)
    hub.inject_call("commit", lambda: other.write_lease(lease("b", 2), mine), method="POST")
    source.write_bytes(b"weights 2")
    with pytest.raises(LeaseLostError, match="'b' holds it with epoch 2"):
        store.publish_global(source, GlobalMetadata.for_file(source, 2, master="a", lease_epoch=1))
    assert store.read_global_metadata().outer_step == 1


def test_a_newer_lease_replaces_a_higher_outer_step_written_without_one(
    hub: HubEmulator, tmp_path: Path
) -> None:
    """A forged (or pre-lease) step_count.json claiming outer step 10**9 cannot block the
    master that holds the lease forever."""
    store = transport(hub)
    store.create_store()
    publish(store, tmp_path, 10**9, b"forged", master="nobody")
    store.write_lease(lease("a", 1), None)
    source = tmp_path / "w.safetensors"
    source.write_bytes(b"weights 5")
    published = store.publish_global(
        source, GlobalMetadata.for_file(source, 5, master="a", lease_epoch=1)
    )
    assert store.read_global_metadata().outer_step == published.outer_step == 5


# --------------------------------------------------------------------------- secrets (issue 22)


def test_endpoint_userinfo_is_redacted_in_every_url_printed(
    hub: HubEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    port = hub.endpoint.rsplit(":", 1)[1]
    secret = "s3cr3t-password"
    store = HubTransport(
        REPO, token=TOKEN, endpoint=f"http://alice:{secret}@127.0.0.1:{port}", request_timeout=5
    )
    messages = [store.description, repr(store)]
    caplog.set_level(logging.DEBUG, logger="speedtronic")
    for fault in (
        lambda: hub.inject("resolve", status=503),
        lambda: hub.inject("resolve", status=403, message=f"no, alice:{secret}"),
        lambda: hub.inject_drop("resolve"),
    ):
        fault()
        with pytest.raises(TransportError) as raised:
            store.read_global_metadata()
        messages += [
            str(raised.value),
            repr(raised.value.__cause__),
            repr(raised.value.__context__),
        ]
    broken = HubTransport(REPO, endpoint=f"http://bob:{secret}@127.0.0.1:9", request_timeout=2)
    with pytest.raises(TransientTransportError) as refused:
        broken.read_global_metadata()  # connection refused: the URL is in the error
    messages += [str(refused.value), repr(refused.value.__cause__)]
    with pytest.raises(PermanentTransportError) as bad_id:  # a URL given as the repo id
        HubTransport(f"https://erin:{secret}@huggingface.co/org/run")
    messages.append(str(bad_id.value))
    everything = "\n".join([*messages, caplog.text])
    assert "<redacted>@127.0.0.1" in everything
    assert secret not in everything and "alice:" not in everything


def test_hf_uri_error_from_create_repo_against_a_mirror_is_classified(
    hub: HubEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """create_repo answering 401/403 for an existing repository on a non-huggingface.co
    endpoint raised HfUriError from the client, which crashed the master with a traceback."""
    hub.add_repo(REPO, private=True)
    store = transport(hub)
    for status in (401, 403):
        hub.inject("create", status=status, message=f"denied for {TOKEN}")
        store.create_store()  # the repository exists and can be read: no error at all
    assert TOKEN not in caplog.text
    # And HfUriError itself, whatever raised it, is a permanent error with secrets redacted.
    error = hf_errors.HfUriError(
        uri=f"http://carol:pw@127.0.0.1/{REPO}?token={TOKEN}", msg="Unrecognized host"
    )
    classified = classify(error, "create repository")
    assert isinstance(classified, PermanentTransportError)
    from speedtronic_diloco.transports.hub_errors import redact

    cleaned = redact(str(classified), TOKEN)
    assert "carol:pw" not in cleaned and TOKEN not in cleaned


def client_error_types() -> list[type[BaseException]]:
    return sorted(
        (
            obj
            for obj in vars(hf_errors).values()
            if inspect.isclass(obj)
            and issubclass(obj, BaseException)
            and obj.__module__.startswith("huggingface_hub")
        ),
        key=lambda cls: cls.__name__,
    )


@pytest.mark.parametrize("error_type", client_error_types(), ids=lambda cls: cls.__name__)
def test_every_huggingface_hub_error_type_is_classified(error_type: type[BaseException]) -> None:
    """Each exception type huggingface_hub defines becomes a transport error (never a
    traceback), whatever its constructor wants."""
    error = error_type.__new__(error_type)
    error.args = (f"failure at http://dave:pw@127.0.0.1/x with {TOKEN}",)
    classified = classify(error, "an operation")
    assert isinstance(classified, TransportError), error_type
