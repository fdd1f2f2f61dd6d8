"""The per-version cache of downloaded global weights.

One file per published version, named by outer step and sha256
(``outer_<step>-<sha12>.safetensors``), checked against the metadata's sha256 before each use:
a corrupt entry is deleted and downloaded again. Only the newest few versions are kept.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from speedtronic.checkpoint.fileio import sha256_file
from speedtronic_diloco.tensors import TensorDict, TensorFileError, load_tensors
from speedtronic_diloco.transports.base import GlobalMetadata

__all__ = ["KEEP_CACHED_GLOBALS", "GlobalCache"]

log = logging.getLogger("speedtronic.diloco")

KEEP_CACHED_GLOBALS = 2


class GlobalCache:
    """Global weights by version under ``directory``; ``keep`` versions at most."""

    def __init__(self, directory: str | Path, keep: int = KEEP_CACHED_GLOBALS) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def path_for(self, metadata: GlobalMetadata) -> Path:
        """Where the weights ``metadata`` describes are cached."""
        name = f"outer_{metadata.outer_step:08d}-{metadata.sha256[:12]}.safetensors"
        return self.directory / name

    def get(self, metadata: GlobalMetadata, download: Callable[[Path], bool]) -> TensorDict | None:
        """The tensors ``metadata`` describes: from a verified cache entry, else through
        ``download(dest)`` (True when it wrote ``dest``). None when the download failed or the
        file is unusable (then nothing is left cached for this version)."""
        path = self.path_for(metadata)
        if path.exists():
            if sha256_file(path) == metadata.sha256:
                return self._load(path)
            log.warning("cached global %s is corrupt; downloading it again", path)
            path.unlink()
        if not download(path):
            return None
        tensors = self._load(path)
        self.prune()
        return tensors

    def prune(self) -> None:
        """Delete all but the newest ``keep`` cached versions."""
        cached = sorted(self.directory.glob("outer_*.safetensors"))
        for old in cached[: -self.keep] if self.keep > 0 else cached:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()

    @staticmethod
    def _load(path: Path) -> TensorDict | None:
        try:
            tensors, _ = load_tensors(path)
        except TensorFileError as exc:
            log.warning("global weights unusable: %s", exc)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        return tensors
