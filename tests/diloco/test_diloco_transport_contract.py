"""The transport contract, run against the in-memory test double (so the double used by the
coordinator tests behaves like a real store), and proof that the contract has teeth: a
transport that silently does nothing, or whose one method silently does nothing, fails it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from diloco_fakes import MemoryTransport
from transport_contract import TransportContract

from speedtronic_diloco.transports import DeltaInfo, GlobalMetadata, Transport


class TestMemoryTransportContract(TransportContract):
    @pytest.fixture
    def transport(self) -> MemoryTransport:
        return MemoryTransport()


def contract_failures(make: Callable[[], Transport], tmp_path: Path) -> dict[str, BaseException]:
    """Run every test of :class:`TransportContract` against a fresh ``make()``; the failures by
    test name (any exception is a failure, as it would be under pytest)."""
    failures: dict[str, BaseException] = {}
    contract = TransportContract()
    names = sorted(name for name in dir(TransportContract) if name.startswith("test_"))
    assert names, "the contract has no tests"
    for name in names:
        test = getattr(contract, name)
        fixtures: dict[str, Any] = {"transport": make(), "tmp_path": tmp_path / name}
        wanted = inspect.signature(test).parameters
        unknown = set(wanted) - set(fixtures)
        assert not unknown, f"{name} needs fixtures this runner lacks: {unknown}"
        (tmp_path / name).mkdir()
        try:
            test(**{key: fixtures[key] for key in wanted})
        except (Exception, pytest.fail.Exception) as exc:  # pytest.raises fails with the latter
            failures[name] = exc
    return failures


class SilentTransport(Transport):
    """Accepts every call, stores nothing, reports nothing, never complains."""

    description = "silent://"

    def create_store(self, *, private: bool = True) -> None:
        pass

    def read_global_metadata(self) -> GlobalMetadata | None:
        return None

    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        return dest

    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        return metadata

    def upload_delta(self, node_id: str, local_step: int, source: Path) -> None:
        pass

    def list_deltas(self) -> list[DeltaInfo]:
        return []

    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        return dest


def test_the_memory_transport_passes_the_contract(tmp_path: Path) -> None:
    assert contract_failures(MemoryTransport, tmp_path) == {}  # the runner itself works


def test_a_transport_that_silently_does_nothing_fails_the_contract(tmp_path: Path) -> None:
    failures = contract_failures(SilentTransport, tmp_path)
    # Only what a do-nothing store can honestly satisfy passes: an empty store, no grants, and
    # the optional parts (leases, deletion) that it says it does not support.
    passed = {name for name in dir(TransportContract) if name.startswith("test_")} - failures.keys()
    assert passed == {
        "test_empty_store_has_no_global_and_no_deltas",
        "test_grant_is_supported_or_says_so",
        "test_lease_is_compare_and_swap_or_unsupported",
        "test_fenced_publication_needs_the_current_lease",
        "test_delete_deltas_removes_listed_files_or_is_unsupported",
    }


def _silenced(method: str, body: Callable[..., Any]) -> type[MemoryTransport]:
    return type(f"Silent_{method}", (MemoryTransport,), {method: body})


SILENCED: dict[str, Callable[..., Any]] = {
    "read_global_metadata": lambda self: None,
    "download_global": lambda self, metadata, dest: dest,
    "publish_global": lambda self, weights, metadata: metadata,
    "upload_delta": lambda self, node_id, local_step, source: None,
    "list_deltas": lambda self: [],
    "download_delta": lambda self, info, dest: dest,
}


@pytest.mark.parametrize("method", sorted(SILENCED))
def test_each_method_doing_nothing_fails_the_contract(method: str, tmp_path: Path) -> None:
    assert contract_failures(_silenced(method, SILENCED[method]), tmp_path)


def test_a_download_that_skips_verification_fails_the_contract(tmp_path: Path) -> None:
    def unverified(self: MemoryTransport, metadata: GlobalMetadata, dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(self.files[metadata.model_file])
        return dest

    failures = contract_failures(_silenced("download_global", unverified), tmp_path)
    assert set(failures) == {"test_download_with_wrong_hash_raises_integrity_error"}
