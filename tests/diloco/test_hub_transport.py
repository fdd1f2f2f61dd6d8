"""HubTransport over real HTTP: the real huggingface_hub client against tests/hub_emulator.py.

Layout, pinning, verification and atomic publication; failure classification lives in
test_hub_transport_faults.py.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
from hub_emulator import HubEmulator, git_blob_sha
from hub_fixtures import REPO, TOKEN, delta_file, hub_fixture, publish, transport  # noqa: F401
from transport_contract import TransportContract

from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.transports import (
    GLOBAL_METADATA,
    GLOBAL_WEIGHTS,
    DeltaInfo,
    GlobalMetadata,
    IntegrityError,
    PermanentTransportError,
    TransientTransportError,
    UnsupportedOperation,
    open_transport,
)
from speedtronic_diloco.transports.hub import HubTransport, PublishConflictError


def _kinds(hub: HubEmulator) -> list[str]:
    return [record.kind for record in hub.requests]


# -- construction ----------------------------------------------------------------------


def test_open_transport_builds_a_hub_transport_from_config(
    hub: HubEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = DistributedConfig(repo_id=REPO, token=TOKEN, endpoint=hub.endpoint)
    store = open_transport(config)
    assert isinstance(store, HubTransport)
    assert (store.repo_id, store.endpoint) == (REPO, hub.endpoint)
    assert TOKEN not in repr(store) and TOKEN not in store.description


def test_endpoint_defaults_to_hf_endpoint_read_at_construction(
    hub: HubEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub froze HF_ENDPOINT at import; the transport reads it when built."""
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint + "/")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    store = HubTransport.from_config(DistributedConfig(repo_id=REPO))
    assert store.endpoint == hub.endpoint
    store.create_store()
    assert hub.files(REPO).keys() == {".gitattributes"}
    assert {r.authorization for r in hub.requests} == {f"Bearer {TOKEN}"}  # SDK token lookup


@pytest.mark.parametrize("repo_id", ["run", "a/b/c", "", "/x"])
def test_bad_repo_ids_are_refused(repo_id: str) -> None:
    with pytest.raises(PermanentTransportError, match="<user or org>/<name>"):
        HubTransport(repo_id, endpoint="http://127.0.0.1:9")


# -- the store ---------------------------------------------------------------------------


def test_create_store_makes_a_private_repo_and_keeps_content(hub: HubEmulator) -> None:
    store = transport(hub)
    store.create_store(private=True)
    store.create_store(private=True)  # exist_ok
    assert hub.files(REPO).keys() == {".gitattributes"}
    info = [r for r in hub.requests if r.kind == "info"]
    assert info, "visibility was not checked"


def test_existing_public_repo_gets_a_loud_warning(
    hub: HubEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    hub.add_repo(REPO, private=False, files={"keep.txt": b"x"})
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco.hub"):
        transport(hub).create_store(private=True)
    assert any("PUBLIC" in r.getMessage() for r in caplog.records)
    assert hub.files(REPO)["keep.txt"] == b"x"

    caplog.clear()
    hub.set_visibility(REPO, private=True)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco.hub"):
        transport(hub).create_store(private=True)
    assert not any("PUBLIC" in r.getMessage() for r in caplog.records)


def test_grant_write_access_explains_how_to_do_it_by_hand(hub: HubEmulator) -> None:
    store = transport(hub)
    store.grant_write_access([])  # nothing asked, nothing said
    with pytest.raises(UnsupportedOperation) as unsupported:
        store.grant_write_access(["alice", "bob"])
    message = str(unsupported.value)
    assert "alice, bob" in message and "write" in message and "speedtronic" in message
    assert hub.requests == []  # no API call was attempted


# -- global weights ----------------------------------------------------------------------


def test_nothing_published_reads_as_none(hub: HubEmulator) -> None:
    hub.add_repo(REPO)
    assert transport(hub).read_global_metadata() is None


def test_publish_is_one_commit_and_reads_back_pinned(hub: HubEmulator, tmp_path: Path) -> None:
    hub.add_repo(REPO)
    store = transport(hub)
    before = len(hub.history(REPO))
    published = publish(store, tmp_path, 1, b"weights-1")

    assert len(hub.history(REPO)) == before + 1
    assert published.revision == hub.head(REPO)
    assert published.model_file == GLOBAL_WEIGHTS
    files = hub.files(REPO)
    assert files[GLOBAL_WEIGHTS] == b"weights-1"
    assert GlobalMetadata.loads(files[GLOBAL_METADATA]).sha256 == published.sha256

    read = store.read_global_metadata()
    assert read is not None
    assert (read.outer_step, read.revision, read.sha256) == (1, hub.head(REPO), published.sha256)
    dest = store.download_global(read, tmp_path / "dl" / "global.safetensors")
    assert dest.read_bytes() == b"weights-1"
    resolves = [r.path for r in hub.requests if r.kind == "resolve" and GLOBAL_WEIGHTS in r.path]
    assert resolves[-1] == f"/{REPO}/resolve/{read.revision}/{GLOBAL_WEIGHTS}"


def test_pinned_download_keeps_the_version_that_was_read(hub: HubEmulator, tmp_path: Path) -> None:
    hub.add_repo(REPO)
    master, worker = transport(hub), transport(hub)
    publish(master, tmp_path, 1, b"v1")
    seen = worker.read_global_metadata()
    publish(master, tmp_path, 2, b"v2-longer")  # lands between the read and the download
    assert seen is not None
    assert worker.download_global(seen, tmp_path / "g").read_bytes() == b"v1"
    newest = worker.read_global_metadata()
    assert newest is not None and newest.outer_step == 2
    assert worker.download_global(newest, tmp_path / "g").read_bytes() == b"v2-longer"


def test_without_the_commit_header_reads_are_pinned_through_the_api(
    hub: HubEmulator, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    hub.send_repo_commit = False
    store = transport(hub)
    assert store.read_global_metadata() is None
    publish(store, tmp_path, 1, b"v1")
    read = store.read_global_metadata()
    assert read is not None and read.revision == hub.head(REPO)
    publish(store, tmp_path, 2, b"v2")
    assert store.download_global(read, tmp_path / "g").read_bytes() == b"v1"


def test_every_commit_pairs_metadata_with_matching_weights(
    hub: HubEmulator, tmp_path: Path
) -> None:
    """Whatever commit a reader lands on, the metadata describes the weights next to it."""
    hub.add_repo(REPO)
    master, worker = transport(hub), transport(hub)
    for step in range(1, 5):
        publish(master, tmp_path, step, f"weights {step} ".encode() * step)
        worker.upload_delta("node-b", step * 10, delta_file(tmp_path, "d", b"d%d" % step))
    with_metadata = 0
    for sha in hub.history(REPO):
        files = hub.files(REPO, sha)
        if GLOBAL_METADATA in files:
            with_metadata += 1
            metadata = GlobalMetadata.loads(files[GLOBAL_METADATA])
            weights = files[GLOBAL_WEIGHTS]
            assert (metadata.size, len(weights)) == (len(weights), metadata.size)
            assert metadata.sha256 == hashlib.sha256(weights).hexdigest()
    assert with_metadata == 8  # 4 publications, each followed by one delta commit


def test_tampered_global_is_rejected_then_a_new_publication_is_taken(
    hub: HubEmulator, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    store = transport(hub)
    publish(store, tmp_path, 1, b"good weights")
    metadata = store.read_global_metadata()
    assert metadata is not None
    hub.tamper(REPO, GLOBAL_WEIGHTS, b"evil weights")  # same size, same commit sha
    dest = tmp_path / "global.safetensors"
    with pytest.raises(IntegrityError, match="sha256"):
        store.download_global(metadata, dest)
    assert not dest.exists()
    assert list(tmp_path.glob(".global.safetensors.*")) == []  # no temp file left behind

    publish(store, tmp_path, 2, b"fresh weights")
    fresh = store.read_global_metadata()
    assert fresh is not None
    assert store.download_global(fresh, dest).read_bytes() == b"fresh weights"


def test_truncated_or_padded_global_is_rejected(hub: HubEmulator, tmp_path: Path) -> None:
    hub.add_repo(REPO)
    store = transport(hub)
    publish(store, tmp_path, 1, b"0123456789")
    metadata = store.read_global_metadata()
    assert metadata is not None
    for data in (b"01234", b"0123456789-and-more"):
        hub.tamper(REPO, GLOBAL_WEIGHTS, data)
        with pytest.raises(IntegrityError):
            store.download_global(metadata, tmp_path / "g")
        assert not (tmp_path / "g").exists()


def test_malformed_metadata_is_permanent(hub: HubEmulator) -> None:
    hub.add_repo(REPO, files={GLOBAL_METADATA: b'{"outer_step": "x"}'})
    with pytest.raises(PermanentTransportError, match=r"step_count\.json"):
        transport(hub).read_global_metadata()


# -- publication races -------------------------------------------------------------------


def test_second_master_racing_the_first_gets_the_412_path(hub: HubEmulator, tmp_path: Path) -> None:
    hub.add_repo(REPO)
    first, second = transport(hub), transport(hub)
    publish(first, tmp_path, 1, b"first@1")
    # The second master's commit arrives after the first master committed outer step 2.
    hub.inject_call("commit", lambda: publish(first, tmp_path, 2, b"first@2"))
    with pytest.raises(PublishConflictError) as conflict:
        publish(second, tmp_path, 2, b"second@2", master="node-z")
    message = str(conflict.value)
    assert "412" in message and "node-a" in message and "one master" in message
    assert [r.status for r in hub.requests if r.kind == "commit"][-2:] == [200, 412]
    assert hub.files(REPO)[GLOBAL_WEIGHTS] == b"first@2"


def test_master_behind_the_store_refuses_to_overwrite_it(hub: HubEmulator, tmp_path: Path) -> None:
    hub.add_repo(REPO)
    publish(transport(hub), tmp_path, 5, b"ahead")
    commits, before = len(hub.history(REPO)), len(hub.requests)
    with pytest.raises(PublishConflictError, match="outer step 5"):
        publish(transport(hub), tmp_path, 3, b"behind", master="node-z")
    assert len(hub.history(REPO)) == commits
    assert _kinds(hub)[before:] == ["resolve"]  # refused before sending anything


def test_a_delta_landing_during_publish_only_makes_it_commit_again(
    hub: HubEmulator, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    master, worker = transport(hub), transport(hub)
    source = delta_file(tmp_path, "delta", b"delta bytes")
    hub.inject_call("commit", lambda: worker.upload_delta("node-b", 500, source))
    published = publish(master, tmp_path, 1, b"weights")
    files = hub.files(REPO)
    assert files["nodes/node-b/delta_500.safetensors"] == b"delta bytes"
    assert files[GLOBAL_WEIGHTS] == b"weights"
    assert published.revision == hub.head(REPO)
    assert [r.status for r in hub.requests if r.kind == "commit"] == [200, 412, 200]


def test_publish_after_a_lost_reply_recognises_its_own_commit(
    hub: HubEmulator, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    store = transport(hub)
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"weights")
    metadata = GlobalMetadata.for_file(weights, 1, published_at=123.0, master="node-a")
    hub.inject_drop("commit", after_apply=True)
    with pytest.raises(TransientTransportError):
        store.publish_global(weights, metadata)
    landed = hub.head(REPO)
    published = store.publish_global(weights, metadata)  # what the retry policy does
    assert published.revision == landed == hub.head(REPO)


def test_publish_refuses_weights_that_do_not_match_the_metadata(
    hub: HubEmulator, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"weights")
    metadata = GlobalMetadata.for_file(weights, 1)
    weights.write_bytes(b"changed")
    with pytest.raises(PermanentTransportError, match="does not match"):
        transport(hub).publish_global(weights, metadata)
    assert GLOBAL_METADATA not in hub.files(REPO)


# -- deltas ------------------------------------------------------------------------------


def test_deltas_are_listed_from_the_tree_without_downloads(
    hub: HubEmulator, tmp_path: Path
) -> None:
    hub.add_repo(
        REPO,
        files={
            "nodes/node-c/notes.txt": b"not a delta",
            "nodes/node-c/.delta_7.safetensors.tmp": b"temp",
            "nodes/bad id/delta_1.safetensors": b"invalid node id",
        },
    )
    store = transport(hub)
    assert store.list_deltas() == []  # foreign files only so far
    store.upload_delta("node-b", 1000, delta_file(tmp_path, "b", b"bbbb"))
    store.upload_delta("node-a", 500, delta_file(tmp_path, "a", b"aa"))
    before = len(hub.requests)

    listed = store.list_deltas()

    assert listed == [
        DeltaInfo("node-a", 500, "nodes/node-a/delta_500.safetensors", 2, git_blob_sha(b"aa")),
        DeltaInfo("node-b", 1000, "nodes/node-b/delta_1000.safetensors", 4, git_blob_sha(b"bbbb")),
    ]
    assert _kinds(hub)[before:] == ["tree"]  # one listing, nothing downloaded


def test_no_nodes_folder_lists_nothing(hub: HubEmulator) -> None:
    hub.add_repo(REPO)
    assert transport(hub).list_deltas() == []


def test_reupload_changes_the_etag_and_stale_infos_fail_integrity(
    hub: HubEmulator, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    store = transport(hub)
    store.upload_delta("node-a", 500, delta_file(tmp_path, "a", b"first"))
    (old,) = store.list_deltas()
    assert store.download_delta(old, tmp_path / "d1").read_bytes() == b"first"

    store.upload_delta("node-a", 500, delta_file(tmp_path, "a", b"again"))  # same size
    (new,) = store.list_deltas()
    assert new.etag != old.etag and new.key == old.key
    with pytest.raises(IntegrityError, match="content id"):
        store.download_delta(old, tmp_path / "d2")
    assert not (tmp_path / "d2").exists()
    assert store.download_delta(new, tmp_path / "d2").read_bytes() == b"again"


def test_same_delta_uploaded_twice_makes_no_second_commit(hub: HubEmulator, tmp_path: Path) -> None:
    hub.add_repo(REPO)
    store = transport(hub)
    source = delta_file(tmp_path, "a", b"same")
    store.upload_delta("node-a", 1, source)
    head = hub.head(REPO)
    store.upload_delta("node-a", 1, source)  # a retry after a lost reply
    assert hub.head(REPO) == head


def test_lfs_files_are_listed_and_checked_by_sha256(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Real Hub repos keep *.safetensors in LFS: the tree then gives their sha256 as etag."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with HubEmulator(lfs_suffixes=(".safetensors",)) as hub:
        hub.add_repo(REPO)
        store = transport(hub)
        store.upload_delta("node-a", 1, delta_file(tmp_path, "a", b"lfs bytes"))
        (old,) = store.list_deltas()
        assert old.etag == hashlib.sha256(b"lfs bytes").hexdigest()
        assert store.download_delta(old, tmp_path / "d").read_bytes() == b"lfs bytes"
        store.upload_delta("node-a", 1, delta_file(tmp_path, "a", b"LFS BYTES"))
        with pytest.raises(IntegrityError, match="sha256"):
            store.download_delta(old, tmp_path / "d")


# -- the contract every transport honours ------------------------------------------------


class TestHubTransportContract(TransportContract):
    """The shared transport contract (tests/diloco/transport_contract.py) over real HTTP."""

    @pytest.fixture
    def transport(self, hub: HubEmulator) -> HubTransport:
        return transport(hub)
