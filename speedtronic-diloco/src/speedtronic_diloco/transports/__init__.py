"""DumbDiLoCo stores behind one small interface, and :func:`open_transport`, which picks one.

- :mod:`~speedtronic_diloco.transports.base`: the :class:`Transport` interface, its errors, the
  store layout and :class:`GlobalMetadata`;
- :mod:`~speedtronic_diloco.transports.shared_dir`: a directory on one machine or a network
  filesystem;
- :mod:`~speedtronic_diloco.transports.hub`: a Hugging Face Hub repository (with
  ``hub_session``, the bounded client, and ``hub_errors``, the error classification). It is
  imported only when a Hub repository is configured.

Every implementation imports ``base`` and nothing imports an implementation back, except
:func:`open_transport` here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from speedtronic_diloco.transports.base import (
    GLOBAL_METADATA,
    GLOBAL_WEIGHTS,
    LEASE_FILE,
    DeltaInfo,
    FragmentFile,
    GlobalMetadata,
    IntegrityError,
    Lease,
    LeaseConflictError,
    LeaseError,
    LeaseLostError,
    MalformedLeaseError,
    PermanentTransportError,
    TransientTransportError,
    Transport,
    TransportError,
    UnsupportedOperation,
    delta_path,
    is_global_file,
    parse_delta_path,
)
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport, shared_dir_root

if TYPE_CHECKING:
    from speedtronic_diloco.config import DistributedConfig

__all__ = [
    "GLOBAL_METADATA",
    "GLOBAL_WEIGHTS",
    "LEASE_FILE",
    "DeltaInfo",
    "FragmentFile",
    "GlobalMetadata",
    "IntegrityError",
    "Lease",
    "LeaseConflictError",
    "LeaseError",
    "LeaseLostError",
    "MalformedLeaseError",
    "PermanentTransportError",
    "SharedDirectoryTransport",
    "TransientTransportError",
    "Transport",
    "TransportError",
    "UnsupportedOperation",
    "delta_path",
    "is_global_file",
    "open_transport",
    "parse_delta_path",
]

HUB_MODULE = "speedtronic_diloco.transports.hub"


def open_transport(config: DistributedConfig) -> Transport:
    """The transport ``config.repo_id`` selects: a ``file://`` URL or an absolute path opens a
    shared directory, anything else is a Hugging Face Hub repository id."""
    repo_id = config.repo_id
    if not repo_id:
        raise PermanentTransportError("distributed.repo_id is not set")
    root = shared_dir_root(repo_id)
    if root is not None:
        return SharedDirectoryTransport(root)
    try:
        hub = importlib.import_module(HUB_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "huggingface_hub":
            raise PermanentTransportError(
                f"distributed.repo_id {repo_id!r} names a Hugging Face Hub repository, which "
                "needs the huggingface-hub package (pip install 'huggingface-hub>=1.4,<3'); "
                "use a file:// URL or an absolute path for a shared directory instead"
            ) from None
        raise
    return hub.HubTransport.from_config(config)
