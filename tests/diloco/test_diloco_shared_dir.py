"""The shared-directory transport: the contract, the layout, atomic publication under
concurrent readers (threads and another process), metadata checks and transport selection."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from diloco_fakes import SETTLE, wait_for
from safetensors.torch import load_file
from transport_contract import TransportContract, weights_file

from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.transports import (
    GlobalMetadata,
    IntegrityError,
    PermanentTransportError,
    TransientTransportError,
    open_transport,
)
from speedtronic_diloco.transports.shared_dir import (
    KEEP_VERSIONS,
    SharedDirectoryTransport,
    shared_dir_root,
)


class TestSharedDirectoryContract(TransportContract):
    @pytest.fixture
    def transport(self, tmp_path: Path) -> SharedDirectoryTransport:
        return SharedDirectoryTransport(tmp_path / "store")


def publish(store: SharedDirectoryTransport, tmp_path: Path, step: int) -> GlobalMetadata:
    source = weights_file(tmp_path, float(step))
    return store.publish_global(source, GlobalMetadata.for_file(source, step))


def test_layout_matches_the_hub(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    for step in range(KEEP_VERSIONS + 3):
        published = publish(store, tmp_path, step)
    store.upload_delta("node-a", 500, weights_file(tmp_path, 9.0))
    root = tmp_path / "store"
    latest = load_file(root / "global" / "latest.safetensors")
    assert float(latest["w"][0, 0]) == published.outer_step
    document = json.loads((root / "global" / "step_count.json").read_text())
    assert document["outer_step"] == published.outer_step
    assert document["model_file"] == published.model_file
    assert (root / "nodes" / "node-a" / "delta_500.safetensors").is_file()
    versions = sorted((root / "global").glob("v*.safetensors"))
    assert len(versions) == KEEP_VERSIONS  # older versions are pruned
    assert not list(root.rglob("*.tmp"))


def test_listing_skips_temp_files_and_unsafe_names(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    store.upload_delta("good", 5, weights_file(tmp_path, 1.0))
    nodes = tmp_path / "store" / "nodes"
    (nodes / "good" / ".delta_6.safetensors.abc.tmp").write_bytes(b"partial")
    (nodes / "good" / "delta_x.safetensors").write_bytes(b"?")
    (nodes / "good" / "notes.txt").write_text("hi")
    (nodes / "bad name").mkdir()
    (nodes / "bad name" / "delta_5.safetensors").write_bytes(b"?")
    (nodes / "stray-file").write_text("not a directory")
    assert [info.key for info in store.list_deltas()] == [("good", 5)]


def test_upload_rejects_unsafe_node_ids(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    for bad in ("..", "a/b", "a\\b", "."):
        with pytest.raises(ValueError):
            store.upload_delta(bad, 1, weights_file(tmp_path, 1.0))


def test_tampered_version_file_fails_integrity_check(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    published = publish(store, tmp_path, 1)
    (tmp_path / "store" / published.model_file).write_bytes(b"tampered")
    with pytest.raises(IntegrityError):
        store.download_global(published, tmp_path / "dest.safetensors")
    assert not (tmp_path / "dest.safetensors").exists()


def test_missing_version_file_is_transient(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    published = publish(store, tmp_path, 1)
    (tmp_path / "store" / published.model_file).unlink()
    with pytest.raises(TransientTransportError):
        store.download_global(published, tmp_path / "dest.safetensors")


def test_malformed_metadata_is_permanent(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    (tmp_path / "store" / "global" / "step_count.json").write_text("{not json")
    with pytest.raises(PermanentTransportError):
        store.read_global_metadata()


READER = """
import sys
from pathlib import Path
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport
from speedtronic_diloco.transports import IntegrityError, TransientTransportError
from safetensors.torch import load_file
store = SharedDirectoryTransport(sys.argv[1])
dest = Path(sys.argv[2])
checked = 0
while True:
    meta = store.read_global_metadata()
    if meta is None:
        continue
    try:
        store.download_global(meta, dest)
    except IntegrityError:
        raise  # a torn publication (IntegrityError is transient too: test it first)
    except TransientTransportError:
        continue  # the version was pruned while we read: take the next metadata
    assert float(load_file(dest)["w"][0, 0]) == meta.outer_step, meta
    checked += 1
    if meta.outer_step >= int(sys.argv[3]):
        print(checked)
        break
"""


def test_readers_never_see_metadata_with_other_weights(tmp_path: Path) -> None:
    """Publish many versions while readers in threads and in another process download what
    the metadata names: every download verifies (sha256) and carries the announced step."""
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    last = 40
    publish(store, tmp_path, 0)
    process = subprocess.Popen(
        [sys.executable, "-c", READER, str(tmp_path / "store"), str(tmp_path / "p.st"), str(last)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    problems: list[BaseException] = []
    checked = [0]
    done = threading.Event()

    def reader(index: int) -> None:
        mine = SharedDirectoryTransport(tmp_path / "store")
        dest = tmp_path / f"r{index}.safetensors"
        while not done.is_set():
            try:
                meta = mine.read_global_metadata()
                mine.download_global(meta, dest)
            except IntegrityError as exc:  # would mean a torn publication (it is transient too)
                problems.append(exc)
                return
            except TransientTransportError:
                continue  # the version was pruned while we read: take the next metadata
            except BaseException as exc:
                problems.append(exc)
                return
            if float(load_file(dest)["w"][0, 0]) != meta.outer_step:
                problems.append(AssertionError(f"weights do not match {meta}"))
                return
            checked[0] += 1

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for step in range(1, last + 1):
        publish(store, tmp_path, step)
    try:
        out, err = process.communicate(timeout=SETTLE)
        # The threads read the final version at least, however slowly they were scheduled.
        wait_for(lambda: checked[0] > 0 or bool(problems), what="a reader thread's download")
    finally:
        done.set()
        for thread in threads:
            thread.join(SETTLE)
    assert not any(thread.is_alive() for thread in threads)
    assert process.returncode == 0, err
    assert int(out.strip()) >= 1
    assert problems == []
    assert checked[0] > 0


@pytest.mark.parametrize(
    ("repo_id", "expected"),
    [
        ("file:///srv/run", Path("/srv/run")),
        ("file://localhost/srv/run", Path("/srv/run")),
        ("file://runs/shared", Path("runs/shared")),
        ("/srv/run", Path("/srv/run")),
        ("org/run", None),
        ("run", None),
    ],
)
def test_repo_id_selects_the_transport(repo_id: str, expected: Path | None) -> None:
    assert shared_dir_root(repo_id) == expected


def test_open_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = open_transport(DistributedConfig(repo_id=f"file://{tmp_path}"))
    assert isinstance(shared, SharedDirectoryTransport) and shared.root == tmp_path
    assert isinstance(
        open_transport(DistributedConfig(repo_id=str(tmp_path))), SharedDirectoryTransport
    )
    # Without huggingface-hub a Hub repo id is one clear error naming the package.
    monkeypatch.delitem(sys.modules, "speedtronic_diloco.transports.hub", raising=False)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(PermanentTransportError, match=r"pip install 'huggingface-hub.*file://"):
        open_transport(DistributedConfig(repo_id="org/run"))


@pytest.mark.parametrize(
    "document",
    [
        {"outer_step": 1, "sha256": "a" * 64, "size": 1, "model_file": "../secrets.safetensors"},
        {"outer_step": 1, "sha256": "a" * 64, "size": 1, "model_file": "global/../x.safetensors"},
        {"outer_step": 1, "sha256": "a" * 64, "size": 1, "model_file": "nodes/a/x.safetensors"},
        {"outer_step": 1, "sha256": "xyz", "size": 1},
        {"outer_step": -1, "sha256": "a" * 64, "size": 1},
        {"sha256": "a" * 64, "size": 1},
        ["not", "an", "object"],
    ],
)
def test_bad_metadata_is_rejected(document: object) -> None:
    with pytest.raises(PermanentTransportError):
        GlobalMetadata.from_json(document)


def test_metadata_round_trip_and_legacy_step() -> None:
    meta = GlobalMetadata(outer_step=4, sha256="b" * 64, size=10, processed=(("a", 5, None),))
    assert GlobalMetadata.loads(meta.dumps(), revision="abc") == meta.with_revision("abc")
    legacy = GlobalMetadata.from_json({"step": 3, "sha256": "c" * 64, "size": 2})
    assert legacy.outer_step == 3 and legacy.model_file == "global/latest.safetensors"


def test_delta_listing_reads_no_file_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing only stats names (the master dedupes before downloading anything)."""
    store = SharedDirectoryTransport(tmp_path / "store")
    store.upload_delta("a", 1, weights_file(tmp_path, 1.0))
    real_open = open

    def guarded_open(file: object, *args: object, **kwargs: object) -> object:
        if "nodes" in str(file):
            raise AssertionError(f"listing opened {file}")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)
    assert [info.key for info in store.list_deltas()] == [("a", 1)]
