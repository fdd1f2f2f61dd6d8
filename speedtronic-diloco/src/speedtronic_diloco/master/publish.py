"""Fenced publication of the master's global: the lease is checked (and its epoch written into
the metadata) before every publication, and a store that says the lease was lost stops the
master. The global goes out as one file, or, with streaming fragments on a store that has
fragment files, as one file per fragment where only the files whose fragment's version moved
are written (:mod:`speedtronic_diloco.fragment_files`), in one atomic publication."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from speedtronic.checkpoint.fileio import sha256_file
from speedtronic.errors import TransportError
from speedtronic_diloco.codecs import encode_global
from speedtronic_diloco.fragment_files import fragment_header, fragment_tensors
from speedtronic_diloco.fragments import FragmentLayout
from speedtronic_diloco.master.state import OuterState, encode
from speedtronic_diloco.master.store_state import STATE_ENTRY, put_store_state, stores_state
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.signing import sign_file
from speedtronic_diloco.tensors import TensorDict, save_tensors
from speedtronic_diloco.transports.base import (
    GLOBAL_WEIGHTS,
    FragmentFile,
    GlobalMetadata,
    Lease,
    LeaseError,
    LeaseLostError,
    Transport,
)

__all__ = ["Publication", "Publisher"]

log = logging.getLogger("speedtronic.diloco.outer")


@dataclass(frozen=True)
class Publication:
    """What to publish: one outer step's global and the metadata fields that go with it."""

    outer_step: int
    weights: TensorDict
    fields: dict[str, Any]  # GlobalMetadata fields other than the file's own
    layout: FragmentLayout | None  # one file per fragment of this layout, or one whole file
    versions: Sequence[int] = ()  # per fragment
    known: Sequence[FragmentFile | None] = ()  # this master's published file per fragment
    state: tuple[TensorDict, dict[str, str]] | None = None  # the encoded outer state, to store

    @classmethod
    def of(
        cls,
        state: OuterState,
        master: str,
        extra: dict[str, Any],
        deltas_included: int,
        store: Transport,
    ) -> Publication:
        """What publishing ``state`` to ``store`` means: its global, ledger window and node
        summaries, ``extra`` (the last round's entry) plus the fragment book's; one file per
        fragment where the store has fragment files; the outer state itself where the store
        keeps side files (:mod:`~speedtronic_diloco.master.store_state`)."""
        assert state.global_state is not None
        book = state.fragments
        extra = {**extra, **book.extra()}
        ledger, nodes = state.processed.published()
        fields = {
            "master": master,
            "deltas_included": deltas_included or int(extra.get("deltas_included", 0)),
            "processed": ledger,
            "extra": extra,
            "nodes": nodes,
            "eval_loss": extra.get("eval_loss"),
        }
        layout = book.publishes_files(store.supports_fragment_files)
        versions, files = list(book.versions), list(book.files)
        stored = replace(state, published_step=state.outer_step)
        encoded = encode(stored, master) if stores_state(store) else None
        return cls(state.outer_step, state.global_state, fields, layout, versions, files, encoded)


class Publisher:
    """Writes, signs and publishes globals, fenced by the master's lease."""

    def __init__(
        self,
        transport: Transport,
        *,
        node_id: str,
        cache_dir: Path,
        retry: RetryPolicy,
        stop: Callable[[], threading.Event],
        lease: Callable[[], Any],
        signing_key: bytes | None,
        compression: str = "none",
    ) -> None:
        self.transport = transport
        self.node_id = node_id
        self.directory = cache_dir / "publish"
        self.retry = retry
        self._stop = stop
        self._lease = lease
        self.signing_key = signing_key
        self.compression = compression

    def fence(self, what: str) -> tuple[bool, Lease | None]:
        """``(True, lease to fence with)``, ``(True, None)`` for a store without leases, or
        ``(False, None)`` while the lease cannot be taken (the store is unreachable); a lost or
        held lease raises."""
        lease = self._lease()
        if lease is None:
            return True, None
        try:
            return True, lease.ensure(self._stop())
        except LeaseError:
            raise
        except TransportError as exc:
            log.warning("%s waits for the master lease (%s); trying again next round", what, exc)
            return False, None

    def publish(self, item: Publication) -> GlobalMetadata | None:
        """Publish ``item`` (fenced); None (with a warning) when it did not happen. A store
        that reports the lease lost raises :class:`LeaseLostError`."""
        step = item.outer_step
        fenced, fence = self.fence(f"publishing outer step {step}")
        if not fenced:
            return None
        fields = {
            "published_at": time.time(),
            **item.fields,
            "lease_epoch": fence.epoch if fence is not None else None,
        }
        failures: list[TransportError] = []
        stored = True
        if item.state is not None:  # before the metadata that names it: see store_state
            stored, entry = self._attempt(
                f"storing the outer state of outer step {step} in {self.transport.description}",
                lambda: put_store_state(self.transport, item.state, step, self.directory, fence),
                failures,
            )
            if stored:
                fields["extra"] = {**fields["extra"], STATE_ENTRY: entry}
        done, published = False, None
        if not stored:
            pass  # no global without its state: a successor would restart the momentum
        elif item.layout is not None:
            done, published = self._fragment_files(item, fields, failures)
        else:
            done, published = self._whole(item, fields, failures)
        if done:
            return published
        if failures and isinstance(failures[-1], LeaseLostError):
            lease = self._lease()
            if lease is not None:
                lease.mark_lost(str(failures[-1]))
            raise failures[-1]
        return None

    def _attempt(self, what: str, fn: Callable[[], Any], failures: list[Any]) -> Any:
        return self.retry.attempt(
            what, fn, self._stop(), then="will retry next round", on_failure=failures.append
        )

    def _signed(self, path: Path, stored: TensorDict, meta: dict[str, str]) -> Path:
        save_tensors(path, stored, meta)
        if self.signing_key is not None:
            sign_file(path, self.signing_key)
        return path

    def _whole(
        self, item: Publication, fields: dict[str, Any], failures: list[Any]
    ) -> tuple[bool, GlobalMetadata | None]:
        """The whole global in one file (K = 1, or a store without fragment files)."""
        step = item.outer_step
        path = self.directory / f"global_{step:08d}.safetensors"
        try:
            stored, codec_meta = encode_global(item.weights, self.compression)
            header = {"kind": "global", "outer_step": str(step), "master": self.node_id}
            self._signed(path, stored, {**header, **codec_meta})
            meta = GlobalMetadata.for_file(path, step, **fields)
            return self._attempt(
                f"publishing outer step {step} to {self.transport.description}",
                lambda: self.transport.publish_global(path, meta),
                failures,
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _fragment_files(
        self, item: Publication, fields: dict[str, Any], failures: list[Any]
    ) -> tuple[bool, GlobalMetadata | None]:
        """Write the files of the fragments whose version moved past their published file
        (all of them when the store does not list this master's files), then publish them
        with metadata listing every fragment's file, in one atomic publication."""
        layout, step = item.layout, item.outer_step
        assert layout is not None
        kept = self._kept_files(item)
        files: dict[int, Path] = {}
        entries: list[FragmentFile] = []
        try:
            for j in range(layout.count):
                entry = kept.get(j)
                if entry is None:
                    files[j], entry = self._write_fragment(item, j)
                entries.append(entry)
            first = entries[min(files)] if files else max(entries, key=lambda e: e.outer_step)
            meta = GlobalMetadata(
                outer_step=step,
                sha256=first.sha256,
                size=first.size,
                model_file=first.file or GLOBAL_WEIGHTS,
                fragment_files=tuple(entries),
                **fields,
            )
            return self._attempt(
                f"publishing outer step {step} (fragment files {sorted(files)}) to "
                f"{self.transport.description}",
                lambda: self.transport.publish_fragments(files, meta),
                failures,
            )
        finally:
            for path in files.values():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _kept_files(self, item: Publication) -> dict[int, FragmentFile]:
        """The published fragment files that still hold their fragment's current version:
        this master's own files that the store's metadata lists as they are."""
        assert item.layout is not None
        read, remote = self.retry.attempt(
            f"reading global metadata from {self.transport.description}",
            self.transport.read_global_metadata,
            self._stop(),
            then="publishing every fragment file",
        )
        listed = remote.fragment_files if read and remote is not None else ()
        count = item.layout.count
        if len(listed) != count or len(item.known) != count:
            return {}
        return {
            j: entry
            for j, entry in enumerate(item.known)
            if entry is not None and entry.outer_step == item.versions[j] and listed[j] == entry
        }

    def _write_fragment(self, item: Publication, j: int) -> tuple[Path, FragmentFile]:
        """Fragment ``j``'s file at its version (encoded, signed), and its entry (its store
        path is named by the transport)."""
        assert item.layout is not None
        version = item.versions[j]
        path = self.directory / f"fragment{j}_{item.outer_step:08d}.safetensors"
        stored, codec_meta = encode_global(
            fragment_tensors(item.weights, item.layout, j), self.compression
        )
        header = fragment_header(j, version, item.layout, self.node_id)
        self._signed(path, stored, {**header, **codec_meta})
        return path, FragmentFile("", sha256_file(path), path.stat().st_size, version)
