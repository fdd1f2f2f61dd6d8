"""The store's current global weights, read without joining the run.

What ``--global`` of ``speedtronic eval``, ``export`` and ``generate`` loads (core's
``load_global_state`` hook): the newest published global is downloaded to a temporary file,
its size and sha256 checked by the transport, its signature checked when a signing key is set
(a worker refuses unsigned globals, and so does this), and returned as CPU tensors under the
model's own keys and dtypes. A global published as fragment files (streaming fragments) is
put together from every fragment's file, each bounded and checked as a node checks it
(:mod:`speedtronic_diloco.fragment_files`). The weights pass the checks a node makes before
installing a global (:mod:`speedtronic_diloco.global_check`: the model's dtypes, finite once
in them, an update from the model's own weights within ``max_update_ratio``), so a forged
global is one error, never a NaN score. Nothing is written to the store: no node
registration, no lease.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from speedtronic.errors import TransportError
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.fragment_files import (
    check_fragment_file,
    check_fragment_metadata,
    check_listed_size,
)
from speedtronic_diloco.fragments import FragmentLayout
from speedtronic_diloco.global_check import (
    GlobalRefusedError,
    check_global_size,
    checked_global,
    weights_norm,
)
from speedtronic_diloco.signing import SignatureError, resolve_key, verify_file
from speedtronic_diloco.tensors import TensorDict, cpu_state_dict, load_tensors
from speedtronic_diloco.transports import GlobalMetadata, Transport, open_transport

__all__ = ["read_global_state"]


def read_global_state(section: DistributedConfig, model: Any) -> dict[str, torch.Tensor]:
    """The newest published global weights for ``model`` (a CPU state dict), or a
    TransportError saying why there are none (nothing published yet, unsigned or tampered;
    :class:`~speedtronic_diloco.global_check.GlobalRefusedError` for weights not safe to use)."""
    transport = open_transport(section)
    metadata = transport.read_global_metadata()
    if metadata is None:
        raise TransportError(f"no global weights published yet in {section.repo_id}")
    try:
        return _read(section, transport, metadata, model)
    except GlobalRefusedError as exc:
        raise GlobalRefusedError(
            exc.reason, f"refusing the global of outer step {metadata.outer_step}: {exc}"
        ) from None


def _read(
    section: DistributedConfig, transport: Transport, metadata: GlobalMetadata, model: Any
) -> TensorDict:
    key = resolve_key(section.signing_key)
    reference = cpu_state_dict(model.state_dict())
    if metadata.fragment_files:
        return _read_fragment_files(transport, metadata, reference, key, section.max_update_ratio)
    check_global_size(metadata.size, reference, metadata.model_file)
    with tempfile.TemporaryDirectory(prefix="speedtronic-global-") as scratch:
        path = transport.download_global(metadata, Path(scratch) / "global.safetensors")
        if key is not None:
            try:
                signed = verify_file(path, key)
            except SignatureError as exc:
                text = str(exc).replace(str(path), metadata.model_file)
                raise TransportError(
                    f"the global of outer step {metadata.outer_step}: {text}"
                ) from None
            if signed.get("kind") != "global" or signed.get("outer_step") != str(
                metadata.outer_step
            ):
                raise TransportError(
                    f"the global of outer step {metadata.outer_step} is signed for another step"
                )
        tensors, header = load_tensors(path)
    return checked_global(
        tensors,
        reference,
        metadata.model_file,
        codec=header.get("codec"),
        max_update_ratio=section.max_update_ratio,
    )


def _read_fragment_files(
    transport: Transport,
    metadata: GlobalMetadata,
    local: TensorDict,
    key: bytes | None,
    max_update_ratio: float,
) -> TensorDict:
    """Every fragment file of ``metadata``, downloaded, bounded and checked (in the dtypes of
    ``local``, the model's weights), put together."""
    layout = FragmentLayout.build(local, len(metadata.fragment_files))
    check_fragment_metadata(metadata, layout)
    norm = weights_norm(local)  # each file's move is measured against the whole model's
    tensors: TensorDict = {}
    with tempfile.TemporaryDirectory(prefix="speedtronic-global-") as scratch:
        for j in range(layout.count):
            view = metadata.fragment_view(j)
            check_listed_size(view, layout, j, local)
            path = transport.download_global(view, Path(scratch) / f"fragment_{j}.safetensors")
            part, header = load_tensors(path)
            check_fragment_file(
                path, view.model_file, j, view.outer_step, layout, part, header, local, key
            )
            checked = checked_global(
                part,
                local,
                view.model_file,
                codec=header.get("codec"),
                max_update_ratio=max_update_ratio,
                norm=norm,
            )
            tensors.update(checked)
    return tensors
