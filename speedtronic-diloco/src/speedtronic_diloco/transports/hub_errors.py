"""How failures of the Hugging Face Hub client become DiLoCo transport errors.

Transient (retry later, honouring ``Retry-After``): timeouts, connection errors, 408, 429,
5xx, 409 "another conflicting operation is in progress", a failed Xet transfer, local I/O
trouble. Permanent (retrying cannot help): 401, 403, 404 (repository, revision or file missing),
400 and other 4xx, offline mode, a bad repository id, a URL the client cannot parse
(``HfUriError``: ``create_repo`` raises it after a 401/403 against a mirror or test server), no
token, and every other exception type ``huggingface_hub`` defines (``huggingface_hub.errors``
and its private modules): the client raised it on purpose, so it is not a programming error of
ours. Anything else (a ``TypeError``...) is a programming error and is not translated.

``hf_hub_download`` hides 403/429/5xx/timeouts inside ``LocalEntryNotFoundError``; the real
error is its ``__cause__`` and is classified instead.

:func:`redact` removes the token and the credentials of every URL (``https://user:pass@host``)
from a message; the transport applies it to every error it raises.
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Callable, Mapping
from typing import NoReturn

from huggingface_hub.errors import (
    DisabledRepoError,
    EntryNotFoundError,
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    HfUriError,
    HFValidationError,
    LocalEntryNotFoundError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    XetDownloadError,
)

from speedtronic_diloco.transports.base import (
    LeaseConflictError,
    PermanentTransportError,
    TransientTransportError,
    TransportError,
    redact_userinfo,
)
from speedtronic_diloco.transports.hub_session import HubRequestFailed, http, safe_url

__all__ = [
    "classify",
    "error_text",
    "mentions",
    "raise_redacted",
    "rebuilt",
    "redact",
    "retry_after",
]

_TRANSIENT_STATUS = frozenset({408, 429})
# `RateLimit: "api";r=0;t=55`: r requests remain in the window, which resets in t seconds.
_RATELIMIT = re.compile(r";\s*r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+)")
_MAX_DETAIL = 300


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds the server asked to wait: ``Retry-After`` (seconds or an HTTP date), else the
    ``RateLimit`` header's reset time when no requests remain; None when it said nothing."""
    lowered = {key.lower(): value for key, value in headers.items()}
    value = (lowered.get("retry-after") or "").strip()
    if value:
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            when = None
        if when is not None:
            return max(0.0, when.timestamp() - time.time())
    match = _RATELIMIT.search(lowered.get("ratelimit") or "")
    if match and int(match.group(1)) == 0:
        return float(match.group(2))
    return None


def redact(text: str, secret: str | None) -> str:
    """``text`` with ``secret`` (the Hub token) and the userinfo of every URL replaced by
    ``<redacted>``."""
    if secret and len(secret) >= 4:
        text = text.replace(secret, "<redacted>")
    return redact_userinfo(text)


def _text(error: BaseException) -> str:
    """``str(error)``, even for an exception whose ``__str__`` needs attributes it lacks."""
    try:
        return str(error)
    except Exception:
        return type(error).__name__


def _from_client(error: BaseException) -> bool:
    """True for the exception types ``huggingface_hub`` itself defines."""
    return type(error).__module__.split(".")[0] == "huggingface_hub"


def _transient(message: str, wait: float | None = None) -> TransientTransportError:
    error = TransientTransportError(message)
    error.retry_after = wait
    return error


def _server_detail(error: HfHubHTTPError) -> str:
    detail = (getattr(error, "server_message", None) or "").strip().replace("\n", " ")
    return f": {detail[:_MAX_DETAIL]}" if detail else ""


def _classify_http(error: HfHubHTTPError, what: str) -> TransportError:
    response = getattr(error, "response", None)
    status = response.status_code if response is not None else None
    detail = _server_detail(error)
    if isinstance(error, RepositoryNotFoundError):
        return PermanentTransportError(
            f"{what}: repository not found, or the token cannot see it (a private repository "
            f"looks missing without a valid token; HTTP {status}){detail}"
        )
    if isinstance(error, RevisionNotFoundError):
        return PermanentTransportError(f"{what}: revision not found (HTTP {status}){detail}")
    if isinstance(error, RemoteEntryNotFoundError):
        return PermanentTransportError(f"{what}: file not found (HTTP {status}){detail}")
    if isinstance(error, (GatedRepoError, DisabledRepoError)):
        return PermanentTransportError(f"{what}: repository is gated or disabled{detail}")
    if status == 401:
        return PermanentTransportError(
            f"{what}: authentication failed (HTTP 401): the token is missing, invalid or "
            f"expired; set HF_TOKEN (or run `hf auth login`){detail}"
        )
    if status == 403:
        return PermanentTransportError(
            f"{what}: permission denied (HTTP 403): the token may read but not write this "
            f"repository, or may not see it at all; use a token with write access{detail}"
        )
    if status is not None and (status in _TRANSIENT_STATUS or status >= 500):
        wait = retry_after(response.headers) if response is not None else None
        return _transient(f"{what}: the Hub answered HTTP {status}{detail}", wait)
    if status == 409 and "conflicting operation" in detail:
        return _transient(f"{what}: the Hub is busy with another operation (HTTP 409){detail}")
    return PermanentTransportError(f"{what}: the Hub refused the request (HTTP {status}){detail}")


def classify(error: BaseException, what: str) -> TransportError | None:
    """The transport error for ``error`` raised by the Hub client while doing ``what``; None
    for exceptions that are programming errors and must propagate unchanged."""
    if isinstance(error, TransportError):
        return error
    if isinstance(error, LocalEntryNotFoundError) and error.__cause__ is not None:
        return classify(error.__cause__, what)
    if isinstance(error, HfUriError):
        return PermanentTransportError(
            f"{what}: the Hub client could not parse a URL of this endpoint ({_text(error)}); "
            "is distributed.endpoint a Hugging Face Hub?"
        )
    if isinstance(error, HubRequestFailed):
        wait = retry_after(error.headers) if error.status is not None else None
        return _transient(f"{what}: {error}", wait)
    if isinstance(error, OfflineModeIsEnabled):
        return PermanentTransportError(f"{what}: HF_HUB_OFFLINE is set, the Hub cannot be reached")
    if isinstance(error, HfHubHTTPError):
        return _classify_http(error, what)
    if isinstance(error, http.TimeoutException):
        return _transient(f"{what}: timed out ({type(error).__name__})")
    if isinstance(error, http.UnsupportedProtocol):
        return PermanentTransportError(f"{what}: bad Hub endpoint URL ({error})")
    if isinstance(error, http.TransportError):  # connection refused, dropped, proxy failure
        request = getattr(error, "_request", None)
        where = f" ({safe_url(request.url)})" if request is not None else ""
        return _transient(f"{what}: connection failed: {type(error).__name__}{where}")
    if isinstance(error, HFValidationError):
        return PermanentTransportError(f"{what}: {error}")
    if isinstance(error, http.InvalidURL):
        return PermanentTransportError(f"{what}: bad Hub endpoint URL ({_text(error)})")
    if isinstance(error, LocalTokenNotFoundError):
        return PermanentTransportError(
            f"{what}: no Hub token: set HF_TOKEN (or run `hf auth login`)"
        )
    if isinstance(error, EntryNotFoundError):
        return PermanentTransportError(f"{what}: file not found ({_text(error)})")
    if isinstance(error, FileMetadataError):
        return PermanentTransportError(
            f"{what}: the server's reply lacks the Hub's file metadata ({_text(error)}); "
            "is distributed.endpoint a Hugging Face Hub?"
        )
    if isinstance(error, XetDownloadError):
        return _transient(f"{what}: Xet transfer failed ({_text(error)})")
    if _from_client(error):  # any other type the client raises on purpose
        return PermanentTransportError(f"{what}: {type(error).__name__}: {_text(error)}")
    if isinstance(error, (PermissionError, FileNotFoundError, IsADirectoryError)):
        return PermanentTransportError(f"{what}: {error}")  # a local file: missing, forbidden
    if isinstance(error, OSError):  # local I/O trouble (full disk...) may pass
        return _transient(f"{what}: {error}")
    return None


def mentions(error: BaseException | None, clean: Callable[[str], str]) -> bool:
    """Whether ``error`` or any exception chained to it says something that ``clean``
    (redaction) would change."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for text in (error_text(error), repr(error.args)):
            if clean(text) != text:
                return True
        error = error.__cause__ or error.__context__
    return False


def error_text(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:
        return type(error).__name__


def rebuilt(error: Exception, message: str) -> Exception:
    """A copy of the transport error ``error`` with ``message`` (its attributes kept)."""
    if isinstance(error, LeaseConflictError):
        clean: Exception = LeaseConflictError(message, error.current)
    else:
        clean = type(error)(message)
    return clean


def raise_redacted(
    failure: Exception, error: Exception, redactor: Callable[[str], str]
) -> NoReturn:
    """Raise ``error`` (the translation of ``failure``) with every secret ``redactor`` removes
    taken out of its message, and without a chained exception that still shows one. Call it
    outside the ``except`` block, so that a redacted error keeps no ``__context__``."""
    cause = failure.__cause__ if error is failure else failure
    # A server echoing a secret must not leak it through the chained exceptions either.
    leaked = mentions(error, redactor) or mentions(cause, redactor)
    if error is failure and not leaked:
        raise failure
    clean = rebuilt(error, redactor(error_text(error)))
    clean.__dict__.update(error.__dict__)  # retry_after and the like
    if leaked:
        raise clean from None
    raise clean from cause
