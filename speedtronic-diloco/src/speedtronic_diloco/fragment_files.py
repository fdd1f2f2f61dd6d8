"""Per-fragment global files (streaming fragments, ``distributed.fragments: K``).

With K > 1 the master publishes, per fragment round, one file holding only the fragments that
round updated (one file each), and metadata whose ``fragment_files`` lists every fragment's
current file (:class:`~speedtronic_diloco.transports.base.FragmentFile`); the files a round did
not touch stay as they were. A node downloads only the files of the fragments it will install
(their version advanced), so at most the fragments that moved are in flight.

**A fragment file** is a safetensors file holding fragment ``j``'s tensors (fragment 0 also
carries the non-floating tensors: integer and boolean buffers, which the outer step never
changes), stored in the global codec (``global_compression``), with ``kind: global``,
``outer_step`` (the fragment's version: the outer step of its last update), ``fragment``,
``fragment_count``, ``fragment_layout`` and ``master`` in its header, signed when a signing
key is set.

**Every store file is hostile.** Before a download the size the metadata lists is bounded by
what the fragment's tensors can take at 8 bytes per element, plus a header allowance
(:func:`size_limit`); after it the transport has checked
size and sha256, and :func:`check_fragment_file` checks the header (kind, fragment, layout,
outer step), the signature (with a key), and the tensors: exactly the fragment's names, each
with the local shape, a floating dtype for floating tensors, finite values. Each failure is a
:class:`FragmentFileError` whose message starts with the file's store path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from speedtronic.errors import TransportError
from speedtronic_diloco.fragments import (
    FRAGMENT_COUNT_META,
    FRAGMENT_LAYOUT_META,
    FragmentLayout,
    global_fragment_info,
)
from speedtronic_diloco.global_check import size_limit as global_size_limit
from speedtronic_diloco.signing import SignatureError, verify_file
from speedtronic_diloco.tensors import TensorDict, is_floating, mismatch
from speedtronic_diloco.transports.base import GlobalMetadata

__all__ = [
    "FRAGMENT_META",
    "FragmentFileError",
    "check_fragment_file",
    "check_fragment_index",
    "check_fragment_metadata",
    "check_listed_size",
    "fragment_header",
    "fragment_tensors",
    "size_limit",
]

FRAGMENT_META = "fragment"


class FragmentFileError(TransportError):
    """A fragment global file (or the metadata's list of them) is not what this run expects;
    the message starts with the store path of the file."""


def fragment_tensors(
    weights: Mapping[str, torch.Tensor], layout: FragmentLayout, index: int
) -> TensorDict:
    """What fragment ``index``'s file holds: its tensors, and for fragment 0 also every tensor
    of ``weights`` outside the layout (the non-floating buffers)."""
    out = layout.select(weights, [index])
    if index == 0:
        out.update({k: v for k, v in weights.items() if k not in layout.index})
    return out


def fragment_header(
    index: int, version: int, layout: FragmentLayout, master: str
) -> dict[str, str]:
    """The safetensors metadata of fragment ``index``'s file at ``version``."""
    return {
        "kind": "global",
        "outer_step": str(version),
        "master": master,
        FRAGMENT_META: str(index),
        FRAGMENT_COUNT_META: str(layout.count),
        FRAGMENT_LAYOUT_META: layout.fingerprint,
    }


def check_fragment_index(
    metadata: GlobalMetadata, layout: FragmentLayout, versions: Sequence[int] | None
) -> None:
    """Raise FragmentFileError unless ``metadata`` lists one file per fragment of ``layout``,
    each at the fragment's version (``versions``, from ``extra.fragments``) and none newer
    than the publication itself."""
    files = metadata.fragment_files
    if len(files) != layout.count:
        raise FragmentFileError(
            f"{metadata.model_file}: the metadata lists {len(files)} fragment files, this run "
            f"has {layout.count} fragments"
        )
    if versions is None or len(versions) != layout.count:
        raise FragmentFileError(
            f"{metadata.model_file}: the metadata's fragment versions do not match its "
            "fragment files (another layout?)"
        )
    for index, entry in enumerate(files):
        if entry.outer_step != versions[index] or entry.outer_step > metadata.outer_step:
            raise FragmentFileError(
                f"{entry.file}: fragment {index} is listed at outer step {entry.outer_step}, "
                f"its version is {versions[index]} and the global's outer step "
                f"{metadata.outer_step}"
            )


def check_fragment_metadata(metadata: GlobalMetadata, layout: FragmentLayout) -> tuple[int, ...]:
    """The fragment versions of ``metadata`` (a global published as fragment files), after
    checking that it was published for ``layout`` and lists one file per fragment at its
    version (:func:`check_fragment_index`); FragmentFileError otherwise."""
    info = global_fragment_info(metadata.extra)
    if info is None or info[1] != layout.fingerprint:
        raise FragmentFileError(
            f"{metadata.model_file}: fragment layout {info[1] if info else None!r} differs "
            f"from this node's {layout.fingerprint!r} (another model?)"
        )
    check_fragment_index(metadata, layout, info[0])
    return info[0]


def check_listed_size(
    view: GlobalMetadata, layout: FragmentLayout, index: int, local: Mapping[str, torch.Tensor]
) -> None:
    """Before a download: FragmentFileError when the size the metadata lists for fragment
    ``index``'s file (``view``) is more than that fragment can take (:func:`size_limit`)."""
    limit = size_limit(layout, index, local)
    if view.size > limit:
        raise FragmentFileError(
            f"{view.model_file}: {view.size} bytes listed, more than fragment {index} can take "
            f"({limit})"
        )


def size_limit(layout: FragmentLayout, index: int, local: Mapping[str, torch.Tensor]) -> int:
    """The most bytes fragment ``index``'s file may take: what a global file of its tensors
    may (:func:`~speedtronic_diloco.global_check.size_limit`)."""
    return global_size_limit(fragment_tensors(local, layout, index))


def check_fragment_file(
    path: Path,
    where: str,
    index: int,
    outer_step: int,
    layout: FragmentLayout,
    tensors: Mapping[str, torch.Tensor],
    header: Mapping[str, str],
    local: Mapping[str, torch.Tensor],
    key: bytes | None = None,
) -> None:
    """Raise FragmentFileError (message starting with ``where``, the store path) unless the
    downloaded file ``path`` (its ``tensors`` and ``header`` already read) is fragment
    ``index`` of ``layout`` at ``outer_step``, signed with ``key`` when given, with exactly
    that fragment's tensors in the shapes of ``local``, floating where the model's are and
    finite."""
    _check_header(where, index, outer_step, layout, header)
    if key is not None:
        _check_signature(path, where, index, outer_step, key)
    expected = fragment_tensors(local, layout, index)
    problem = mismatch(tensors, expected, limit=3)
    if problem is not None and problem.name:
        raise FragmentFileError(
            f"{where}: {problem.name} has shape {problem.shape}, the model's is {problem.expected}"
        )
    if problem is not None:
        raise FragmentFileError(
            f"{where}: not fragment {index}'s tensors (missing {list(problem.missing)}, "
            f"unexpected {list(problem.extra)})"
        )
    for name, tensor in tensors.items():
        mine = expected[name]
        if is_floating(mine) != is_floating(tensor):
            raise FragmentFileError(f"{where}: {name} has dtype {tensor.dtype}, not {mine.dtype}")
        if is_floating(tensor) and not bool(torch.isfinite(tensor).all()):
            raise FragmentFileError(f"{where}: {name} has non-finite values")


def _check_header(
    where: str, index: int, outer_step: int, layout: FragmentLayout, header: Mapping[str, str]
) -> None:
    wanted = {
        "kind": "global",
        "outer_step": str(outer_step),
        FRAGMENT_META: str(index),
        FRAGMENT_COUNT_META: str(layout.count),
        FRAGMENT_LAYOUT_META: layout.fingerprint,
    }
    for name, value in wanted.items():
        found = header.get(name)
        if found != value:
            shown = "missing" if found is None else repr(found[:40])
            raise FragmentFileError(f"{where}: header field {name} is {shown}, expected {value!r}")


def _check_signature(path: Path, where: str, index: int, outer_step: int, key: bytes) -> None:
    try:
        signed = verify_file(path, key)
    except SignatureError as exc:
        text = str(exc).replace(str(path), where)  # the store path, not the local copy
        raise FragmentFileError(f"{text} ({exc.reason})") from None
    if signed.get(FRAGMENT_META) != str(index) or signed.get("outer_step") != str(outer_step):
        raise FragmentFileError(f"{where}: signed for another fragment or outer step")
