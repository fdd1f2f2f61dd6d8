"""One Hub model repository as the parts of the Hub store reach it: :class:`HubRepo` holds the
client and the endpoint, runs every call bounded and redacted, and reads a file together with
the commit it was read at. The transport (:mod:`~speedtronic_diloco.transports.hub`), its side
files and its left records all go through one ``HubRepo``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

from huggingface_hub import HfApi, get_token
from huggingface_hub.utils import build_hf_headers

from speedtronic_diloco import __version__
from speedtronic_diloco.transports.base import (
    LEASE_FILE,
    LEASE_LIMIT,
    METADATA_LIMIT,
    Lease,
    TransientTransportError,
    redact_userinfo,
)
from speedtronic_diloco.transports.hub_errors import classify, raise_redacted, redact
from speedtronic_diloco.transports.hub_files import HubFiles
from speedtronic_diloco.transports.hub_session import hub_call

__all__ = ["DEFAULT_ENDPOINT", "HubRepo"]

DEFAULT_ENDPOINT = "https://huggingface.co"
LIBRARY = {"library_name": "speedtronic-diloco", "library_version": __version__}
T = TypeVar("T")


class HubRepo:
    """The repository ``repo_id`` on ``endpoint`` (``token``: None for the client's own
    lookup at each request), each request bounded by ``request_timeout`` seconds."""

    def __init__(
        self, repo_id: str, endpoint: str, token: str | None, request_timeout: float
    ) -> None:
        self.repo_id = repo_id
        self.endpoint = endpoint
        self.request_timeout = float(request_timeout)
        self._token = token or None
        netloc = urlsplit(endpoint).netloc
        self._userinfo = netloc.rpartition("@")[0] if "@" in netloc else None
        #: The client (``huggingface_hub.HfApi``) every request goes through.
        self.api = HfApi(endpoint=endpoint, token=self._token, **LIBRARY)
        shown = redact_userinfo(endpoint)
        where = "" if endpoint == DEFAULT_ENDPOINT else f" on {shown}"
        self.description = f"hf://{repo_id}{where}"
        #: Bounded, checked downloads of the repository's files.
        self.files = HubFiles(repo_id, endpoint, self._headers)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with bounded requests; translate client failures (the token and the
        endpoint's credentials redacted, from the message and from the exception chain)."""
        try:
            with hub_call(self.request_timeout):
                return fn()
        except Exception as exc:
            failure = exc
            error = classify(exc, f"{self.description}: {what}")
            if error is None:  # a programming error: keep it as it is
                raise
        raise_redacted(failure, error, self.redact)

    def redact(self, text: str) -> str:
        """``text`` without the token and the endpoint URL's credentials."""
        text = redact(text, self._secret())
        if self._userinfo:
            text = text.replace(self._userinfo, "<redacted>")
        return text

    def _secret(self) -> str | None:
        """The token in use, only ever to redact it from messages."""
        try:
            return self._token or get_token()
        except Exception:  # a broken token file must not hide the real error
            return self._token

    def _headers(self) -> dict[str, str]:
        return build_hf_headers(token=self._token, **LIBRARY)

    def head_file(self, path: str, limit: int = METADATA_LIMIT) -> tuple[str, bytes | None]:
        """``(head commit, the file at that commit or None)``, consistent with each other: one
        GET of the branch head normally (the reply names its commit); if a proxy dropped that
        header, the head is looked up first and the file read pinned to it."""
        commit, raw = self.files.get_bytes(path, "main", limit)
        if commit is not None:
            return commit, raw
        head = self.api.model_info(self.repo_id, revision="main", timeout=self.request_timeout)
        if not head.sha:
            raise TransientTransportError(f"{self.description}: the Hub named no head commit")
        return head.sha, self.files.get_bytes(path, head.sha, limit)[1]

    def lease_at(self, revision: str) -> Lease | None:
        """The lease at commit ``revision`` (None: no lease there)."""
        raw = self.files.get_bytes(LEASE_FILE, revision, LEASE_LIMIT)[1]
        return None if raw is None else Lease.loads(raw, f"{self.description}: {LEASE_FILE}")
