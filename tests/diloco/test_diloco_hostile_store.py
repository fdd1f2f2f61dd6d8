"""The shared-directory store against hostile files (issue 22): special files and symlinks out
of the store are refused with their path, without blocking; every read stops at the size the
metadata or the listing promised; the lease, the lock and the fence of publications."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from diloco_fakes import SETTLE
from transport_contract import weights_file

from speedtronic_diloco.transports import (
    GlobalMetadata,
    IntegrityError,
    PermanentTransportError,
    TransientTransportError,
)
from speedtronic_diloco.transports.base import Lease, LeaseConflictError, LeaseLostError
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

pytestmark = pytest.mark.skipif(os.name != "posix", reason="FIFOs, sockets and /dev need POSIX")


def store_at(tmp_path: Path) -> SharedDirectoryTransport:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    return store


def in_thread(fn, timeout: float = SETTLE) -> object:
    """Run ``fn`` in a daemon thread and fail (instead of hanging) if it blocks."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} blocked"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def test_fifo_placed_as_a_delta_is_refused_with_its_path_and_never_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_at(tmp_path)
    store.upload_delta("good", 5, weights_file(tmp_path, 1.0))
    fifo = tmp_path / "store" / "nodes" / "evil" / "delta_5.safetensors"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        listing = in_thread(store.list_deltas)
    assert [info.key for info in listing] == [("good", 5)]
    assert str(fifo) in caplog.text and "FIFO" in caplog.text
    # Even if a listing had offered it (a file swapped for a FIFO after the listing), the
    # download refuses it instead of blocking in open().
    from speedtronic_diloco.transports import DeltaInfo

    info = DeltaInfo("evil", 5, "nodes/evil/delta_5.safetensors", 10, "x")
    with pytest.raises(PermanentTransportError, match="FIFO"):
        in_thread(lambda: store.download_delta(info, tmp_path / "got.safetensors"))
    assert not (tmp_path / "got.safetensors").exists()


def test_delta_or_global_symlinked_to_dev_zero_is_refused_and_never_copied(
    tmp_path: Path,
) -> None:
    store = store_at(tmp_path)
    link = tmp_path / "store" / "nodes" / "evil" / "delta_5.safetensors"
    link.parent.mkdir()
    link.symlink_to("/dev/zero")
    assert in_thread(store.list_deltas) == []
    from speedtronic_diloco.transports import DeltaInfo

    info = DeltaInfo("evil", 5, "nodes/evil/delta_5.safetensors", None, "x")
    with pytest.raises(PermanentTransportError, match="outside the store"):
        in_thread(lambda: store.download_delta(info, tmp_path / "got.safetensors"))
    # The global: metadata pointing at a version file that is a link to /dev/zero.
    published = store.publish_global(
        weights_file(tmp_path, 1.0), GlobalMetadata.for_file(weights_file(tmp_path, 1.0), 1)
    )
    version = tmp_path / "store" / published.model_file
    version.unlink()
    version.symlink_to("/dev/zero")
    with pytest.raises(PermanentTransportError, match="outside the store"):
        in_thread(lambda: store.download_global(published, tmp_path / "g.safetensors"))
    assert not (tmp_path / "g.safetensors").exists()


def test_metadata_that_is_a_fifo_or_a_device_is_refused_without_blocking(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    metadata = tmp_path / "store" / "global" / "step_count.json"
    os.mkfifo(metadata)
    with pytest.raises(PermanentTransportError, match=r"step_count\.json.*FIFO"):
        in_thread(store.read_global_metadata)
    metadata.unlink()
    metadata.symlink_to("/dev/zero")
    with pytest.raises(PermanentTransportError, match="outside the store"):
        in_thread(store.read_global_metadata)


def test_socket_as_a_delta_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_at(tmp_path)
    folder = tmp_path / "store" / "nodes" / "evil"
    folder.mkdir()
    # Bound by a relative name: AF_UNIX paths are short (about 100 bytes), temporary ones long.
    monkeypatch.chdir(folder)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind("delta_5.safetensors")
        assert in_thread(store.list_deltas) == []
    finally:
        server.close()


def test_symlinks_inside_the_store_still_work_but_node_folders_outside_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_at(tmp_path)
    store.upload_delta("real", 5, weights_file(tmp_path, 1.0))
    nodes = tmp_path / "store" / "nodes"
    (nodes / "alias").symlink_to(nodes / "real")  # inside the store: fine
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "delta_7.safetensors").write_bytes(weights_file(tmp_path, 2.0).read_bytes())
    (nodes / "smuggled").symlink_to(outside)
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        keys = [info.key for info in store.list_deltas()]
    assert keys == [("alias", 5), ("real", 5)]
    assert str(nodes / "smuggled") in caplog.text and "outside the store" in caplog.text


def test_delta_read_stops_at_the_listed_size(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.upload_delta("n", 5, weights_file(tmp_path, 1.0))
    (info,) = store.list_deltas()
    path = tmp_path / "store" / info.path
    with open(path, "ab") as grow:  # grows after it was listed (a writer gone wild)
        grow.write(b"\0" * (8 << 20))
    with pytest.raises(IntegrityError, match="more than the expected"):
        store.download_delta(info, tmp_path / "got.safetensors")
    assert not (tmp_path / "got.safetensors").exists()


def test_oversized_metadata_is_refused(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    (tmp_path / "store" / "global" / "step_count.json").write_bytes(b" " * (5 << 20))
    with pytest.raises(PermanentTransportError, match="larger than"):
        store.read_global_metadata()


def test_touch_changes_the_listing_etag_so_the_master_looks_at_it_again(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.upload_delta("n", 5, weights_file(tmp_path, 1.0))
    (before,) = store.list_deltas()
    path = tmp_path / "store" / before.path
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime: ctime still moves
    (after,) = store.list_deltas()
    assert after.etag != before.etag
    assert after.modified is not None


# --------------------------------------------------------------------------- lease and fence


def lease(holder: str, epoch: int, ttl: float = 60.0) -> Lease:
    return Lease(holder, epoch, time.time() + ttl, renewed_at=time.time())


def test_lease_writes_are_compare_and_swap(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    assert store.read_lease() is None
    first = store.write_lease(lease("a", 1), None)
    assert store.read_lease() == first
    with pytest.raises(LeaseConflictError) as refused:
        store.write_lease(lease("b", 1), None)
    assert refused.value.current == first
    second = store.write_lease(lease("b", 2), first)
    assert store.read_lease() == second


def test_publication_under_a_lost_lease_is_fenced(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    first = store.write_lease(lease("a", 1), None)
    source = weights_file(tmp_path, 1.0)
    ok = GlobalMetadata.for_file(source, 1, master="a", lease_epoch=1)
    store.publish_global(source, ok)
    store.write_lease(lease("b", 2), first)  # b took over
    late = GlobalMetadata.for_file(weights_file(tmp_path, 2.0), 2, master="a", lease_epoch=1)
    latest_before = (tmp_path / "store" / "global" / "latest.safetensors").read_bytes()
    with pytest.raises(LeaseLostError, match="'b' holds it with epoch 2"):
        store.publish_global(weights_file(tmp_path, 2.0), late)
    assert store.read_global_metadata().outer_step == 1  # nothing visible changed
    assert (tmp_path / "store" / "global" / "latest.safetensors").read_bytes() == latest_before


def hold_the_lock(tmp_path: Path) -> subprocess.Popen[str]:
    """A child process holding ``global/.lock`` until a line arrives on its stdin."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            "f = open(sys.argv[1], 'a+b')\n"
            "fcntl.lockf(f.fileno(), fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.readline()\n",
            str(tmp_path / "store" / "global" / ".lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def test_the_store_lock_excludes_other_processes(tmp_path: Path) -> None:
    """A child process holding ``global/.lock`` keeps a lease write waiting until it lets go."""
    store = store_at(tmp_path)
    holder = hold_the_lock(tmp_path)
    try:
        done = threading.Event()
        thread = threading.Thread(
            target=lambda: (store.write_lease(lease("a", 1), None), done.set()), daemon=True
        )
        thread.start()
        assert not done.wait(0.5)  # blocked behind the other process's lock
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert done.wait(SETTLE)
    finally:
        holder.kill()
        holder.wait(SETTLE)
    assert store.read_lease().holder == "a"


def test_a_lock_held_past_lock_wait_is_a_transient_error_naming_the_lock(tmp_path: Path) -> None:
    """A frozen holder delays a writer by ``lock_wait`` at most, then the writer gets a
    retryable error naming the lock file; once the holder dies the write goes through."""
    assert store_at(tmp_path).lock_wait == 10.0  # the default docs/diloco.md states
    store = SharedDirectoryTransport(tmp_path / "store", lock_wait=0.3)
    holder = hold_the_lock(tmp_path)
    try:
        holder.send_signal(signal.SIGSTOP)
        with pytest.raises(TransientTransportError, match=r"\.lock: held by another process"):
            store.write_lease(lease("a", 1), None)
        assert store.read_lease() is None  # nothing written
        holder.kill()
        holder.wait(SETTLE)
        store.write_lease(lease("a", 1), None)
    finally:
        holder.kill()
        holder.wait(SETTLE)
    assert store.read_lease().holder == "a"


def test_deleting_keeps_files_replaced_since_the_listing(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    for step in (5, 10):
        store.upload_delta("n", step, weights_file(tmp_path, float(step)))
    listing = store.list_deltas()
    store.upload_delta("n", 10, weights_file(tmp_path, 99.0))  # a restarted worker re-used it
    assert store.delete_deltas(listing) == 1
    assert [info.key for info in store.list_deltas()] == [("n", 10)]


def test_fenced_deletion_under_a_lost_lease_deletes_nothing(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    mine = store.write_lease(lease("a", 1), None)
    store.upload_delta("n", 5, weights_file(tmp_path, 1.0))
    listing = store.list_deltas()
    store.write_lease(lease("b", 2), mine)
    with pytest.raises(LeaseLostError):
        store.delete_deltas(listing, fence=mine)
    assert len(store.list_deltas()) == 1


def test_missing_store_lists_nothing_and_reads_nothing(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "nowhere")
    assert store.list_deltas() == []
    assert store.read_global_metadata() is None
    assert store.read_lease() is None
    with pytest.raises(TransientTransportError):
        store.download_global(
            GlobalMetadata(1, "a" * 64, 1, "global/v.safetensors"), tmp_path / "x"
        )
