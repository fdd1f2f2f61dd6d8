"""Behaviour every DumbDiLoCo transport must show, as a reusable test class.

Subclass :class:`TransportContract` and provide a ``transport`` fixture returning a fresh,
empty store (see test_diloco_shared_dir.py); the Hub transport can reuse it unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speedtronic_diloco.tensors import save_tensors
from speedtronic_diloco.transports import (
    DeltaInfo,
    GlobalMetadata,
    IntegrityError,
    Transport,
    UnsupportedOperation,
    is_global_file,
)
from speedtronic_diloco.transports.base import Lease, LeaseConflictError, LeaseLostError


def weights_file(tmp_path: Path, value: float, name: str = "w") -> Path:
    return save_tensors(
        tmp_path / f"{name}_{value}.safetensors",
        {"w": torch.full((3, 3), value), "step": torch.tensor(int(value))},
    )


class TransportContract:
    """Tests run against ``self.transport`` (a fixture of the subclass)."""

    def test_empty_store_has_no_global_and_no_deltas(self, transport: Transport) -> None:
        transport.create_store(private=True)
        transport.create_store(private=True)  # idempotent
        assert transport.read_global_metadata() is None
        assert transport.list_deltas() == []

    def test_publish_then_read_and_download(self, transport: Transport, tmp_path: Path) -> None:
        transport.create_store()
        for step in (0, 1, 2):
            source = weights_file(tmp_path, float(step))
            published = transport.publish_global(
                source,
                GlobalMetadata.for_file(
                    source, step, master="m", deltas_included=2, processed=(("a", 5, "e"),)
                ),
            )
            assert is_global_file(published.model_file)
            read = transport.read_global_metadata()
            assert read is not None
            assert (read.outer_step, read.sha256, read.size) == (
                step,
                published.sha256,
                source.stat().st_size,
            )
            assert read.processed == (("a", 5, "e"),) and read.master == "m"
            dest = transport.download_global(read, tmp_path / "got" / f"{step}.safetensors")
            assert dest.read_bytes() == source.read_bytes()
            assert float(load_file(dest)["w"][0, 0]) == step

    def test_download_with_wrong_hash_raises_integrity_error(
        self, transport: Transport, tmp_path: Path
    ) -> None:
        transport.create_store()
        source = weights_file(tmp_path, 1.0)
        transport.publish_global(source, GlobalMetadata.for_file(source, 1))
        read = transport.read_global_metadata()
        wrong = GlobalMetadata(
            outer_step=1,
            sha256="0" * 64,
            size=read.size,
            model_file=read.model_file,
            revision=read.revision,
        )
        dest = tmp_path / "got.safetensors"
        with pytest.raises(IntegrityError):
            transport.download_global(wrong, dest)
        assert not dest.exists()

    def test_delta_round_trip_and_listing(self, transport: Transport, tmp_path: Path) -> None:
        transport.create_store()
        small = weights_file(tmp_path, 1.0, "small")
        transport.upload_delta("node-a", 5, small)
        transport.upload_delta("node-b", 5, small)
        transport.upload_delta("node-a", 10, small)
        listing = transport.list_deltas()
        assert sorted(info.key for info in listing) == [
            ("node-a", 5),
            ("node-a", 10),
            ("node-b", 5),
        ]
        info = next(i for i in listing if i.key == ("node-b", 5))
        assert isinstance(info, DeltaInfo) and info.size == small.stat().st_size
        dest = transport.download_delta(info, tmp_path / "d" / "b5.safetensors")
        assert dest.read_bytes() == small.read_bytes()

    def test_reupload_changes_the_etag(self, transport: Transport, tmp_path: Path) -> None:
        transport.create_store()
        transport.upload_delta("n", 5, weights_file(tmp_path, 1.0, "one"))
        (first,) = transport.list_deltas()
        bigger = save_tensors(tmp_path / "big.safetensors", {"w": torch.ones(8, 8)})
        transport.upload_delta("n", 5, bigger)
        (second,) = transport.list_deltas()
        assert first.etag is not None and second.etag != first.etag

    def test_grant_is_supported_or_says_so(self, transport: Transport) -> None:
        transport.create_store()
        try:
            transport.grant_write_access(["bob"])
        except UnsupportedOperation:
            pass

    # Optional parts: a store may say UnsupportedOperation, but what it does must be right.

    def test_lease_is_compare_and_swap_or_unsupported(self, transport: Transport) -> None:
        transport.create_store()
        try:
            assert transport.read_lease() is None
        except UnsupportedOperation:
            return
        first = transport.write_lease(Lease("a", 1, 2e9), None)
        assert transport.read_lease() == first
        with pytest.raises(LeaseConflictError):
            transport.write_lease(Lease("b", 1, 2e9), None)
        second = transport.write_lease(Lease("b", 2, 2e9), first)
        assert transport.read_lease() == second

    def test_fenced_publication_needs_the_current_lease(
        self, transport: Transport, tmp_path: Path
    ) -> None:
        transport.create_store()
        try:
            first = transport.write_lease(Lease("a", 1, 2e9), None)
        except UnsupportedOperation:
            return
        source = weights_file(tmp_path, 1.0)
        transport.publish_global(
            source, GlobalMetadata.for_file(source, 1, master="a", lease_epoch=1)
        )
        transport.write_lease(Lease("b", 2, 2e9), first)
        late = weights_file(tmp_path, 2.0)
        with pytest.raises(LeaseLostError):
            transport.publish_global(
                late, GlobalMetadata.for_file(late, 2, master="a", lease_epoch=1)
            )
        assert transport.read_global_metadata().outer_step == 1

    def test_delete_deltas_removes_listed_files_or_is_unsupported(
        self, transport: Transport, tmp_path: Path
    ) -> None:
        transport.create_store()
        for step in (1, 2):
            transport.upload_delta("n", step, weights_file(tmp_path, float(step), f"d{step}"))
        listing = transport.list_deltas()
        try:
            deleted = transport.delete_deltas([i for i in listing if i.local_step == 1])
        except UnsupportedOperation:
            return
        assert deleted == 1
        assert [info.key for info in transport.list_deltas()] == [("n", 2)]
