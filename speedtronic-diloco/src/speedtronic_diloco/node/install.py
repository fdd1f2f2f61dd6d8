"""Getting a global into a node: fetch it (from the per-version cache or the store; with
fragment files, only the files of the fragments it will install, each checked as
:mod:`speedtronic_diloco.fragment_files` says; signed globals verified), keep a fetched global
ready for the training thread, and install it: the fragments whose version advanced (with
``install_at: boundary`` only the one syncing now; one fragment: the whole global, minus this
node's own progress not aggregated yet), re-baselining just what was installed. Installing
loads the model (the training thread's) and hands the coordinator's applier (``settle``) the
decision: :class:`~speedtronic_diloco.node.decisions.Installed`, or
:class:`~speedtronic_diloco.node.decisions.Deferred` when nothing of that global installs
now."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from speedtronic.errors import SpeedtronicError
from speedtronic_diloco.cache import GlobalCache
from speedtronic_diloco.fragment_files import (
    FragmentFileError,
    check_fragment_file,
    check_fragment_metadata,
    check_listed_size,
)
from speedtronic_diloco.fragments import FragmentLayout, global_fragment_info
from speedtronic_diloco.global_check import (
    GlobalRefusedError,
    check_global_size,
    checked_global,
    weights_norm,
)
from speedtronic_diloco.node.context import NodeContext
from speedtronic_diloco.node.decisions import Decision, Deferred, Installed
from speedtronic_diloco.node.deltas import OwnProgress
from speedtronic_diloco.signing import SignatureError, read_header, verify_file
from speedtronic_diloco.tensors import TensorDict, cpu_state_dict, install_state, is_floating
from speedtronic_diloco.transports.base import GlobalMetadata

__all__ = ["Installer"]

log = logging.getLogger("speedtronic.diloco")


class Installer:
    """Fetches and installs globals for one node (see the module docstring). ``outer``
    returns the master's outer loop (None on a worker); ``settle`` applies a decision under
    the node's lock (the coordinator's applier)."""

    def __init__(
        self,
        ctx: NodeContext,
        own: OwnProgress,
        outer: Callable[[], Any],
        settle: Callable[[Decision], bool],
    ) -> None:
        self.ctx = ctx
        self.own = own
        self._outer = outer
        self._settle = settle
        self.globals = GlobalCache(ctx.cache_dir / "global", keep=ctx.config.cache_keep)
        #: A fetched global waiting for the training thread: ``(outer step, tensors)``.
        self.ready: tuple[int, TensorDict] | None = None
        self.bytes_received = 0
        self._aggregated_at: dict[int, frozenset[tuple[str, int]]] = {}
        self._global_info: dict[int, Any] = {}  # outer step -> fragment info of that global
        self._received: dict[int, int] = {}  # outer step -> bytes of its downloaded global
        self._fragment_caches: dict[int, GlobalCache] = {}  # fragment -> its files' cache
        self._refused: dict[tuple[str, str], None] = {}  # (file, sha256) refused: not again
        self._norm: tuple[TensorDict, float] | None = None  # (baseline, its norm)

    # ----------------------------------------------------------------- install
    def install_ready(self, model: nn.Module, due: tuple[int, ...]) -> bool:
        """Install the global waiting in :attr:`ready`, if it is newer than the installed one."""
        with self.ctx.lock:
            ready, self.ready = self.ready, None
        if ready is None or ready[0] <= self.ctx.state.last_global_step:
            return False
        return self.install(model, *ready, due=due)

    def install(
        self, model: nn.Module, outer_step: int, tensors: TensorDict, due: tuple[int, ...] = ()
    ) -> bool:
        """Load the fragments of ``tensors`` this node installs now into ``model`` (training
        thread only) and re-baseline them (:meth:`load`, then the applier); the others keep
        their weights and baselines. A global with fragments still to install waits in
        :attr:`ready` for their boundaries."""
        decision = self.load(model, outer_step, tensors, due)
        self._settle(decision)
        if not isinstance(decision, Installed):
            return False
        book = self.ctx.fragments
        log.info("installed %s outer step %d", book.describe(decision.fragments), outer_step)
        payload = {"step": self.ctx.state.local_step, "outer_step": outer_step}
        payload.update(book.plan.fragment_field(decision.fragments))
        self.ctx.queue_event("global_loaded", {**payload, **self._received_bytes(outer_step)})
        return True

    def load(
        self, model: nn.Module, outer_step: int, tensors: TensorDict, due: tuple[int, ...] = ()
    ) -> Installed | Deferred:
        """Load into ``model`` the fragments of global ``outer_step`` that install now (with
        ``install_at: boundary``, of those ``due``; whole-model: minus this node's own progress
        not aggregated yet) and say so (:class:`Installed`, with the weights now there);
        :class:`Deferred` when none does. The node's state is left to the applier (only the
        own-progress record moves here, under the lock: :meth:`OwnProgress.apply`)."""
        book = self.ctx.fragments
        outer = self._outer()
        if outer is not None:
            info = outer.keeper.fragment_info_at(outer_step)
        else:
            info = self._global_info.get(outer_step)
        boundary_only = self.ctx.config.install_at == "boundary" and due
        # (a global fetched as fragment files holds only the fragments it needed)
        plan = tuple(
            j
            for j in book.to_install(info, due if boundary_only else None)
            if all(name in tensors for name in book.plan.names([j]) or ())
        )
        if not plan:
            return Deferred(outer_step, tensors, info)
        chosen = book.plan.names(plan)
        subset = {k: v for k, v in tensors.items() if chosen is None or k in chosen}
        subset.update({k: v for k, v in tensors.items() if not is_floating(v)})
        install_state(model, self._with_own_progress(outer_step, subset))
        local = model.state_dict()
        now = cpu_state_dict({k: v for k, v in local.items() if chosen is None or k in subset})
        return Installed(outer_step, tensors, plan, info, now, chosen)

    def _with_own_progress(self, outer_step: int, tensors: TensorDict) -> TensorDict:
        """``tensors`` minus this node's own deltas not aggregated into it (see
        :meth:`OwnProgress.apply`)."""
        ctx = self.ctx
        with ctx.lock:
            outer = self._outer()
            if outer is not None:
                done = {s for s in self.own.steps() if outer.keeper.has_processed((ctx.node_id, s))}
            else:
                keys = self._aggregated_at.get(outer_step, frozenset())
                done = {s for node, s in keys if node == ctx.node_id}
            return self.own.apply(tensors, done)

    # ----------------------------------------------------------------- fetch
    def fetch_newer(self, stash: bool = True) -> tuple[int, TensorDict] | None:
        """Read metadata and fetch the global if it is newer than what is installed or
        ready. With ``stash`` the result waits in :attr:`ready` for the training thread."""
        ctx = self.ctx
        _, metadata = ctx.retry.attempt(
            f"polling {ctx.transport.description}",
            ctx.transport.read_global_metadata,
            ctx.stop,
            then="keeping the current weights",
        )
        with ctx.lock:
            known = max(ctx.state.last_global_step, self.ready[0] if self.ready else -1)
        if metadata is None or metadata.outer_step <= known:
            return None
        tensors = self.fetch(metadata)
        if tensors is None:
            return None
        with ctx.lock:
            self._aggregated_at = {
                metadata.outer_step: frozenset((str(n), int(s)) for n, s, _ in metadata.processed)
            }
            if stash and (self.ready is None or self.ready[0] < metadata.outer_step):
                self.ready = (metadata.outer_step, tensors)
        return metadata.outer_step, tensors

    def fetch(self, metadata: GlobalMetadata, complete: bool = False) -> TensorDict | None:
        """The weights ``metadata`` describes, from the per-version cache or the store, in the
        model's dtypes and checked (:mod:`speedtronic_diloco.global_check`); None when not
        fetched or refused. With fragment files, only the fragments this node will install
        (all with ``complete``)."""
        if metadata.fragment_files:
            return self._fetch_fragment_files(metadata, complete)
        if (metadata.model_file, metadata.sha256) in self._refused:
            return None
        ctx = self.ctx
        path = self.globals.path_for(metadata)
        try:
            with ctx.lock:
                reference = ctx.state.baseline
            check_global_size(metadata.size, reference, metadata.model_file)
            tensors = self.globals.get(
                metadata,
                self._downloader(
                    metadata, f"global outer step {metadata.outer_step}", metadata.outer_step
                ),
            )
            if tensors is None:
                return None
            header = read_header(path)[1].get("__metadata__") or {}
            if ctx.key is not None:
                signed = verify_file(path, ctx.key)
                if signed.get("kind") != "global" or signed.get("outer_step") != str(
                    metadata.outer_step
                ):
                    raise SignatureError("bad_signature", f"{path}: signed for another outer step")
            tensors = self._checked(tensors, metadata.model_file, header.get("codec"))
        except (SignatureError, GlobalRefusedError) as exc:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            if isinstance(exc, SignatureError):  # its message names the local cache file
                text = str(exc).replace(str(path), metadata.model_file)
                exc = GlobalRefusedError(exc.reason, text)
            return self._refuse(metadata, exc)
        self._note(metadata)
        return tensors

    def _checked(self, tensors: TensorDict, where: str, codec: Any) -> TensorDict:
        """``tensors`` (one global file's: the whole global, or one fragment's) in the model's
        dtypes, refused unless safe to install
        (:func:`~speedtronic_diloco.global_check.checked_global`, against the weights this
        node last installed or started from)."""
        with self.ctx.lock:
            reference = self.ctx.state.baseline
        known = self._norm  # the baseline is replaced, never changed in place: one norm each
        if known is None or known[0] is not reference:
            known = self._norm = (reference, weights_norm(reference))
        return checked_global(
            tensors,
            reference,
            where,
            codec=codec if isinstance(codec, str) else None,
            max_update_ratio=self.ctx.config.max_update_ratio,
            norm=known[1],
        )

    def _downloader(
        self, view: GlobalMetadata, what: str, outer_step: int
    ) -> Callable[[Path], bool]:
        """Downloads ``view`` into the cache, counting its bytes for global ``outer_step``."""
        ctx = self.ctx

        def download(dest: Path) -> bool:
            done, _ = ctx.retry.attempt(
                f"downloading {what}",
                lambda: ctx.transport.download_global(view, dest),
                ctx.stop,
            )
            if done:
                with contextlib.suppress(OSError):
                    self._count_received(outer_step, dest.stat().st_size)
            return done

        return download

    def _fetch_fragment_files(self, metadata: GlobalMetadata, complete: bool) -> TensorDict | None:
        """The tensors of the fragment files this node needs from a global published as
        fragment files (see
        :meth:`~speedtronic_diloco.node.fragments.NodeFragments.files_wanted`). None (logged,
        ``global_refused`` emitted once per file) when a file is refused or not fetched."""
        if (metadata.model_file, metadata.sha256) in self._refused:
            return None
        baseline = self.ctx.state.baseline
        try:
            layout = self.ctx.fragments.file_layout(baseline, len(metadata.fragment_files))
        except SpeedtronicError as exc:
            return self._refuse(metadata, FragmentFileError(f"{metadata.model_file}: {exc}"))
        try:
            versions = check_fragment_metadata(metadata, layout)
        except FragmentFileError as exc:
            return self._refuse(metadata, exc)
        tensors: TensorDict = {}
        for j in self.ctx.fragments.files_wanted(versions, layout, complete):
            part = self._fetch_fragment_file(metadata, layout, j)
            if part is None:
                return None
            tensors.update(part)
        self._note(metadata)
        return tensors

    def _fetch_fragment_file(
        self, metadata: GlobalMetadata, layout: FragmentLayout, j: int
    ) -> TensorDict | None:
        """Fragment ``j``'s tensors: from its cache or the store, bounded, then checked."""
        ctx = self.ctx
        view = metadata.fragment_view(j)
        where = view.model_file
        if (where, view.sha256) in self._refused:
            return None
        baseline = ctx.state.baseline
        try:
            check_listed_size(view, layout, j, baseline)
        except FragmentFileError as exc:
            return self._refuse(view, exc, metadata.outer_step)
        cache = self._fragment_cache(j)
        what = f"{where} (fragment {j} of global outer step {metadata.outer_step})"
        path = cache.path_for(view)
        try:
            tensors = cache.get(view, self._downloader(view, what, metadata.outer_step))
            if tensors is None:
                return None
            header = read_header(path)[1].get("__metadata__") or {}
            check_fragment_file(
                path, where, j, view.outer_step, layout, tensors, header, baseline, ctx.key
            )
            return self._checked(tensors, where, header.get("codec"))
        except (SignatureError, FragmentFileError, GlobalRefusedError) as exc:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            if isinstance(exc, SignatureError):  # its message names the local cache file
                exc = FragmentFileError(str(exc).replace(str(path), where))
            return self._refuse(view, exc, metadata.outer_step)

    def _fragment_cache(self, j: int) -> GlobalCache:
        cache = self._fragment_caches.get(j)
        if cache is None:
            directory = self.ctx.cache_dir / "global" / f"fragment_{j}"
            cache = GlobalCache(directory, keep=self.ctx.config.cache_keep)
            self._fragment_caches[j] = cache
        return cache

    def _refuse(
        self,
        refused: GlobalMetadata,
        exc: FragmentFileError | GlobalRefusedError,
        outer_step: int | None = None,
    ) -> None:
        """Log one line and emit ``global_refused`` for the file ``refused`` names (the
        metadata's own ``model_file`` for a refused metadata), and never fetch that file again:
        the node keeps its weights."""
        if len(self._refused) >= 64:
            self._refused.pop(next(iter(self._refused)))
        self._refused[(refused.model_file, refused.sha256)] = None
        step = refused.outer_step if outer_step is None else outer_step
        reason = exc.reason if isinstance(exc, GlobalRefusedError) else "fragment_file"
        message = str(exc)
        log.error(
            "!!! refusing global outer step %d: %s (%s); keeping the current weights",
            step,
            reason,
            message,
        )
        self.ctx.queue_event(
            "global_refused", {"outer_step": step, "reason": reason, "message": message}
        )

    # ----------------------------------------------------------------- bookkeeping
    def _note(self, metadata: GlobalMetadata) -> None:
        info = global_fragment_info(metadata.extra)
        with self.ctx.lock:
            self._global_info[metadata.outer_step] = info
            for old in sorted(self._global_info)[:-8]:
                del self._global_info[old]

    def _count_received(self, outer_step: int, size: int) -> None:
        with self.ctx.lock:
            self.bytes_received += size
            self._received[outer_step] = self._received.get(outer_step, 0) + size
            for old in sorted(self._received)[:-8]:
                del self._received[old]

    def _received_bytes(self, outer_step: int) -> dict[str, int]:
        """``bytes_received`` for a ``global_loaded`` event: what downloading that global cost
        (0 from the cache, on the master, or for a later fragment of the same global)."""
        with self.ctx.lock:
            return {"bytes_received": self._received.pop(outer_step, 0)}
