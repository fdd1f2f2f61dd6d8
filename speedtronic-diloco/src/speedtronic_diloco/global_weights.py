"""The store's current global weights, read without joining the run.

What ``--global`` of ``speedtronic eval``, ``export`` and ``generate`` loads (core's
``load_global_state`` hook): the newest published global is downloaded to a temporary file,
its size and sha256 checked by the transport, its signature checked when a signing key is set
(a worker refuses unsigned globals, and so does this), and returned as CPU tensors under the
model's own keys and dtypes. Nothing is written to the store: no node registration, no lease.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from speedtronic.errors import TransportError
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.signing import SignatureError, resolve_key, verify_file
from speedtronic_diloco.tensors import load_tensors
from speedtronic_diloco.transports import open_transport

__all__ = ["read_global_state"]


def read_global_state(section: DistributedConfig, model: Any) -> dict[str, torch.Tensor]:
    """The newest published global weights for ``model`` (a CPU state dict), or a
    TransportError saying why there are none (nothing published yet, unsigned or tampered)."""
    transport = open_transport(section)
    metadata = transport.read_global_metadata()
    if metadata is None:
        raise TransportError(f"no global weights published yet in {section.repo_id}")
    key = resolve_key(section.signing_key)
    with tempfile.TemporaryDirectory(prefix="speedtronic-global-") as scratch:
        path = transport.download_global(metadata, Path(scratch) / "global.safetensors")
        if key is not None:
            try:
                signed = verify_file(path, key)
            except SignatureError as exc:
                raise TransportError(
                    f"the global of outer step {metadata.outer_step}: {exc}"
                ) from None
            if signed.get("kind") != "global" or signed.get("outer_step") != str(
                metadata.outer_step
            ):
                raise TransportError(
                    f"the global of outer step {metadata.outer_step} is signed for another step"
                )
        tensors, _ = load_tensors(path)
    expected = model.state_dict()
    return {
        name: tensor.to(expected[name].dtype) if name in expected else tensor
        for name, tensor in tensors.items()
    }
