"""Bounded HTTP for the Hugging Face Hub client: a timeout on every request, no hidden retries.

``huggingface_hub`` sends every request through one shared client (``get_session()``). That
client has no timeout for most API calls (``create_commit`` and ``list_repo_tree`` take none),
and some calls retry by themselves: the tree listing and the preupload step of a commit back
off for up to ~23 s on 429/5xx and network errors, sleeping ``Retry-After + 1`` s on a rate
limit however long that is. The DiLoCo retry policy (:mod:`speedtronic_diloco.retry`) must be
the only one, so that "retry with backoff for at most N seconds" means what it says.

This module installs (once, through the public ``set_client_factory``) a client that behaves
exactly like the default one except inside :func:`hub_call`:

* every request gets the caller's timeout, overriding whatever the library passed;
* a timeout, a connection error or a retryable status (408, 409 "conflicting operation", 429,
  5xx) raises :class:`HubRequestFailed`. That exception is none of the types the library's
  internal backoff catches, so it reaches the transport at once, which classifies it as a
  :class:`~speedtronic_diloco.transports.base.TransientTransportError`.

Outside :func:`hub_call` (other code in the process using ``huggingface_hub``, the library's
LFS upload threads) the client keeps the library's behaviour, except that its default timeout
is the first ``request_timeout`` given instead of none.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from huggingface_hub.utils import get_session, set_client_factory

from speedtronic_diloco.transports.base import redact_userinfo

try:  # the HTTP library the installed client uses: httpx2 for huggingface_hub 2.x
    from huggingface_hub.utils import httpx as http
except ImportError:  # huggingface_hub 1.x
    import httpx as http  # type: ignore[no-redef]

__all__ = ["HubRequestFailed", "http", "hub_call", "safe_url"]

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CONFLICTING_OPERATION = "conflicting operation is in progress"

_TIMEOUT: ContextVar[float | None] = ContextVar("speedtronic_hub_timeout", default=None)
_INSTALL_LOCK = threading.Lock()
_default_timeout: float | None = None


class HubRequestFailed(Exception):
    """A request inside :func:`hub_call` failed in a way that may pass: it timed out, the
    connection failed, or the server answered a retryable status (``status`` is then set)."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        headers: Mapping[str, str] | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})
        self.timed_out = timed_out


def safe_url(url: Any) -> str:
    """``url`` without its query string (redirects to a CDN carry signed, secret-like queries)
    and without credentials (``https://user:pass@host`` becomes ``https://<redacted>@host``)."""
    text = str(url)
    return redact_userinfo(text.split("?", 1)[0])


class BoundedClient(http.Client):  # type: ignore[misc,name-defined]
    """The library's client, with the per-call limits of :func:`hub_call` applied in ``send``
    (the one method that every request, streamed or not, goes through)."""

    def send(self, request: Any, **kwargs: Any) -> Any:
        timeout = _TIMEOUT.get()
        if timeout is None:
            return super().send(request, **kwargs)
        request.extensions["timeout"] = http.Timeout(timeout).as_dict()
        where = f"{request.method} {safe_url(request.url)}"
        try:
            response = super().send(request, **kwargs)
        except http.TimeoutException as exc:
            raise HubRequestFailed(
                f"{where} timed out after {timeout:g} s", timed_out=True
            ) from exc
        except (http.NetworkError, http.RemoteProtocolError, http.ProxyError) as exc:
            raise HubRequestFailed(f"{where} failed: {type(exc).__name__}") from exc
        status = response.status_code
        conflicting = (
            status == 409 and not kwargs.get("stream") and _CONFLICTING_OPERATION in response.text
        )
        if status in RETRYABLE_STATUS or status >= 500 or conflicting:
            response.close()
            message = response.headers.get("X-Error-Message") or response.reason_phrase
            raise HubRequestFailed(
                f"{where} answered HTTP {status} ({message})",
                status=status,
                headers=response.headers,
            )
        return response


def _client_factory() -> Any:
    """A :class:`BoundedClient` configured like the library's default client (same hooks:
    offline mode, request ids, download counter)."""
    try:
        from huggingface_hub.utils._http import default_client_factory
    except ImportError:  # private location moved: keep working, minus the library's hooks
        return BoundedClient(follow_redirects=True, timeout=_default_timeout)
    template = default_client_factory()
    try:
        return BoundedClient(
            event_hooks=template.event_hooks,
            follow_redirects=template.follow_redirects,
            headers=template.headers,
            timeout=_default_timeout,
        )
    finally:
        template.close()


def ensure_installed(default_timeout: float) -> None:
    """Make the library's shared client a :class:`BoundedClient` (idempotent; installs again
    if someone replaced the factory since). The first caller's timeout becomes the default
    for requests made outside :func:`hub_call`."""
    global _default_timeout
    with _INSTALL_LOCK:
        if _default_timeout is None:
            _default_timeout = default_timeout
        if not isinstance(get_session(), BoundedClient):
            set_client_factory(_client_factory)


@contextmanager
def hub_call(timeout: float) -> Iterator[None]:
    """Apply ``timeout`` to every request this thread makes to the Hub inside the block, and
    surface retryable failures as :class:`HubRequestFailed` instead of retrying them."""
    if not isinstance(get_session(), BoundedClient):
        ensure_installed(timeout)
    token = _TIMEOUT.set(timeout)
    try:
        yield
    finally:
        _TIMEOUT.reset(token)
