"""Reading files of a Hub repository at one revision over plain HTTP: a small file into
memory (bounded, with the commit it was served from) and a large one streamed to disk,
checked (size, sha256, git blob id)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_url
from huggingface_hub.errors import RemoteEntryNotFoundError
from huggingface_hub.utils import get_session, hf_raise_for_status

from speedtronic_diloco.transports.base import (
    METADATA_LIMIT,
    IntegrityError,
    PermanentTransportError,
    write_verified,
)

__all__ = ["HubFiles", "repo_commit"]

_CHUNK = 1 << 20


def repo_commit(response: Any) -> str | None:
    """The commit a resolve response was served from (first ``X-Repo-Commit`` seen, redirects
    included: the Hub sets it on the redirect to the CDN, not on the CDN's reply)."""
    for step in (*response.history, response):
        commit = step.headers.get("X-Repo-Commit")
        if commit:
            return str(commit)
    return None


@dataclass(frozen=True)
class HubFiles:
    """The files of ``repo_id`` on ``endpoint``; ``headers()`` gives each request's headers."""

    repo_id: str
    endpoint: str
    headers: Callable[[], dict[str, str]]

    def get_bytes(
        self, path: str, revision: str, limit: int = METADATA_LIMIT
    ) -> tuple[str | None, bytes | None]:
        """``(commit, content)`` of a small file at ``revision``; content None when the file
        does not exist there (the repository itself missing still raises)."""
        url = hf_hub_url(self.repo_id, path, revision=revision, endpoint=self.endpoint)
        with get_session().stream("GET", url, headers=self.headers()) as response:
            commit = repo_commit(response)
            try:
                hf_raise_for_status(response)
            except RemoteEntryNotFoundError:
                return commit, None
            data = bytearray()
            for chunk in response.iter_bytes(_CHUNK):
                data += chunk
                if len(data) > limit:
                    raise PermanentTransportError(f"{path} is larger than {limit} bytes")
            return commit, bytes(data)

    def download(
        self,
        path: str,
        revision: str,
        dest: Path,
        *,
        size: int | None,
        sha256: str | None = None,
        git_oid: str | None = None,
    ) -> Path:
        """Stream ``path`` at ``revision`` into ``dest`` (temp file + rename), checking size,
        sha256 and git blob id where given; IntegrityError (and no ``dest``) on mismatch."""
        url = hf_hub_url(self.repo_id, path, revision=revision, endpoint=self.endpoint)
        where = f"{path}@{revision[:12]}"
        with get_session().stream("GET", url, headers=self.headers()) as response:
            hf_raise_for_status(response)
            announced = response.headers.get("Content-Length")
            plain = response.headers.get("Content-Encoding") in (None, "identity")
            if size is not None and announced and plain and int(announced) != size:
                Path(dest).unlink(missing_ok=True)
                raise IntegrityError(
                    f"{where}: the Hub announces {announced} bytes, expected {size}"
                )
            return write_verified(
                response.iter_bytes(_CHUNK),
                dest,
                where=where,
                size=size,
                sha256=sha256,
                git_oid=git_oid,
            )
