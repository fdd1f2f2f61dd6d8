"""The one way the Hub transport changes its branch (:func:`commit_on_head`: commit on the
head just read, read again on HTTP 412) and the one checked add operation
(:func:`checked_add`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import HfHubHTTPError

from speedtronic_diloco.transports.base import (
    GlobalMetadata,
    PermanentTransportError,
    TransientTransportError,
)

__all__ = [
    "HEAD_RACES",
    "Commit",
    "Done",
    "PublishConflictError",
    "checked_add",
    "commit_on_head",
    "refuse_if_not_newer",
]

log = logging.getLogger("speedtronic.diloco.hub")

HEAD_RACES = 5  # commits again at most this often when deltas keep moving the branch


class PublishConflictError(PermanentTransportError):
    """Another master already published the same or a newer outer step; this publication was
    refused rather than overwriting it (the Hub's HTTP 412 path)."""


@dataclass(frozen=True)
class Commit:
    """One commit to try on ``head``; ``result`` turns the Hub's reply into the answer."""

    head: str
    operations: list[CommitOperationAdd | CommitOperationDelete]
    message: str
    result: Callable[[Any], Any]


@dataclass(frozen=True)
class Done:
    """Nothing to commit: ``value`` is the answer (an earlier attempt landed, nothing left)."""

    value: Any


def commit_on_head(
    api: Any,
    repo_id: str,
    description: str,
    what: str,
    prepare: Callable[[bool], Commit | Done],
    hint: str = "",
) -> Any:
    """The one way this transport changes the branch: read the head, let ``prepare``
    decide (it is told whether an earlier try raced), commit with that head as
    ``parent_commit``, and when the Hub answers HTTP 412 (the branch moved in between)
    read it again, at most :data:`HEAD_RACES` times."""
    raced = False
    for _ in range(HEAD_RACES):
        step = prepare(raced)
        if isinstance(step, Done):
            return step.value
        try:
            info = api.create_commit(
                repo_id,
                step.operations,
                commit_message=step.message,
                parent_commit=step.head,
            )
        except HfHubHTTPError as exc:
            if exc.response is None or exc.response.status_code != 412:
                raise
            raced = True
            log.info(
                "%s: the branch moved while %s (HTTP 412); reading it again",
                description,
                what,
            )
            continue
        return step.result(info)
    raise TransientTransportError(
        f"{description}: the branch moved {HEAD_RACES} times while {what}{hint}"
    )


def checked_add(
    path_in_repo: str, source: Path, sha256: str, size: int, what: str
) -> CommitOperationAdd:
    """The commit operation adding ``source`` (which hashes the file once), refused when the
    file is not the one the metadata names (``what`` says which entry)."""
    operation = CommitOperationAdd(path_in_repo, str(source))
    if (operation.upload_info.sha256.hex(), operation.upload_info.size) != (sha256, size):
        raise PermanentTransportError(f"{source} does not match the sha256/size {what}")
    return operation


def refuse_if_not_newer(
    description: str, current: bytes, head: str, published: GlobalMetadata, raced: bool
) -> None:
    """Raise PublishConflictError when the branch already holds this outer step or a newer
    one (published by another master: ours would have matched the payload)."""
    try:
        remote = GlobalMetadata.loads(current, revision=head)
    except PermanentTransportError as exc:
        log.warning("%s: the published metadata is malformed (%s); replacing it", description, exc)
        return
    if remote.outer_step < published.outer_step:
        return
    ours, theirs = published.lease_epoch, remote.lease_epoch
    if ours is not None and (theirs is None or theirs < ours):
        # Written without a lease or under an older one, and ours is checked at this very
        # head: this master is the store's master now, and its numbering wins.
        log.warning(
            "%s: the published metadata claims outer step %d (lease epoch %s); this master "
            "holds lease epoch %d and replaces it with outer step %d",
            description,
            remote.outer_step,
            theirs,
            ours,
            published.outer_step,
        )
        return
    how = " (the Hub refused our commit with HTTP 412: it raced with it)" if raced else ""
    raise PublishConflictError(
        f"{description}: master {remote.master or '?'!r} already published outer step "
        f"{remote.outer_step} at commit {head[:12]}; refusing to publish outer step "
        f"{published.outer_step} over it{how}. Run exactly one master per repository; a "
        "restarted master adopts the newer global."
    )
