"""Bounded local caches: the per-version cache of downloaded global weights, and trimming a
cache directory to its newest files.

Globals are cached one file per published version, named by outer step and sha256
(``outer_<step>-<sha12>.safetensors``), checked against the metadata's sha256 before each use:
a corrupt entry is deleted and downloaded again. Only the newest ``keep`` versions are kept
(``distributed.cache_keep``). With streaming fragments published as files of their own, each
fragment has a cache of its own (``global/fragment_<j>/``, named by the fragment's version and
sha256, ``cache_keep`` files each), so a node keeps every fragment's current file.

**An outer step is only believed when the weights confirm it.** The master writes the outer
step into the safetensors header of every global it publishes. Metadata that claims another
outer step for those weights (a forged ``step_count.json`` saying outer step 10**9, which would
make a worker ignore every real global after it) is logged once and refused: nothing is
installed, so the claimed step never becomes the node's floor, and the claim is not downloaded
again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from speedtronic.checkpoint.fileio import sha256_file
from speedtronic_diloco.global_check import GlobalRefusedError
from speedtronic_diloco.tensors import TensorDict, TensorFileError, load_tensors
from speedtronic_diloco.transports.base import GlobalMetadata

__all__ = ["KEEP_CACHED_GLOBALS", "GlobalCache", "prune_files"]

log = logging.getLogger("speedtronic.diloco")

KEEP_CACHED_GLOBALS = 2
_MAX_REFUSED = 64


def prune_files(directory: str | Path, keep: int, pattern: str = "*") -> int:
    """Delete all but the ``keep`` most recently modified files matching ``pattern`` under
    ``directory``; returns how many were deleted (a missing directory has none)."""
    root = Path(directory)
    if not root.is_dir():
        return 0
    found = []
    for path in root.glob(pattern):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                found.append((path.stat().st_mtime_ns, str(path), path))
    found.sort()
    doomed = found[: max(0, len(found) - keep)]
    for _, _, path in doomed:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return len(doomed)


class GlobalCache:
    """Global weights by version under ``directory``; ``keep`` versions at most."""

    def __init__(self, directory: str | Path, keep: int = KEEP_CACHED_GLOBALS) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self._refused: dict[tuple[int, str], str] = {}

    def path_for(self, metadata: GlobalMetadata) -> Path:
        """Where the weights ``metadata`` describes are cached."""
        name = f"outer_{metadata.outer_step:08d}-{metadata.sha256[:12]}.safetensors"
        return self.directory / name

    def get(self, metadata: GlobalMetadata, download: Callable[[Path], bool]) -> TensorDict | None:
        """The tensors ``metadata`` describes: from a verified cache entry, else through
        ``download(dest)`` (True when it wrote ``dest``). None when the download failed or its
        header contradicts the metadata's outer step; GlobalRefusedError (``unreadable``) when
        the file is no safetensors file (then nothing is left cached for this version)."""
        claim = (metadata.outer_step, metadata.sha256)
        if claim in self._refused:
            return None
        path = self.path_for(metadata)
        if path.exists():
            if sha256_file(path) == metadata.sha256:
                return self._load(path, metadata)
            log.warning("cached global %s is corrupt; downloading it again", path)
            path.unlink()
        if not download(path):
            return None
        tensors = self._load(path, metadata)
        self.prune()
        return tensors

    def prune(self) -> None:
        """Delete all but the newest ``keep`` cached versions."""
        cached = sorted(self.directory.glob("outer_*.safetensors"))
        for old in cached[: -self.keep] if self.keep > 0 else cached:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()

    def _load(self, path: Path, metadata: GlobalMetadata) -> TensorDict | None:
        try:
            tensors, header = load_tensors(path)
        except TensorFileError as exc:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            message = str(exc).replace(str(path), metadata.model_file)  # no local paths
            raise GlobalRefusedError("unreadable", message) from None
        stated = header.get("outer_step")
        if stated is not None and stated.strip() != str(metadata.outer_step):
            self._refuse(metadata, stated)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        return tensors

    def _refuse(self, metadata: GlobalMetadata, stated: str) -> None:
        if len(self._refused) >= _MAX_REFUSED:
            self._refused.pop(next(iter(self._refused)))
        self._refused[(metadata.outer_step, metadata.sha256)] = stated
        log.warning(
            "global metadata claims outer step %d, but the weights it names (sha256 %s...) "
            "were published as outer step %s: not trusted, not installed, and not adopted as "
            "this node's outer step (forged or damaged step_count.json?)",
            metadata.outer_step,
            metadata.sha256[:12],
            stated[:40],
        )
