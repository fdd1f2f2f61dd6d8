"""How a master starts: provision the store, load its outer state, and choose where the run
continues from (the startup-selection table of ``docs/diloco.md``).

The coordinator calls :func:`prepare_master` from :meth:`DumbDiLoCoCoordinator.start
<speedtronic_diloco.coordinator.DumbDiLoCoCoordinator.start>`, then installs the chosen
weights (unless a checkpoint already provided them) and starts the outer thread.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedtronic.errors import TransportError
from speedtronic_diloco.aggregation import AggregationRules
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.fragments import FragmentLayout
from speedtronic_diloco.lease import LeaseKeeper
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.master.report import Emit
from speedtronic_diloco.master.store_state import read_store_state
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.tensors import TensorDict
from speedtronic_diloco.transports.base import (
    GlobalMetadata,
    LeaseError,
    Transport,
    UnsupportedOperation,
)

__all__ = [
    "StartupChoice",
    "prepare_master",
    "provision_store",
    "select_startup_state",
    "take_lease",
]

log = logging.getLogger("speedtronic.diloco")


class StartupChoice(enum.Enum):
    """Which global state a starting master continues from."""

    LOCAL = "local"  # the master's own persisted outer state
    REMOTE = "remote"  # the store's newer global; momentum resets
    STORE = "store"  # the store's newer global and the outer state kept with it: exact
    REMOTE_INITIAL = "remote_initial"  # both at outer step 0: install the store's weights
    BOOTSTRAP = "bootstrap"  # nothing anywhere: the current model becomes outer step 0


def select_startup_state(
    has_local: bool, local_step: int, remote: GlobalMetadata | None
) -> StartupChoice:
    """The startup-selection table: L = ``local_step``, R = ``remote.outer_step``."""
    if remote is not None and remote.outer_step > local_step:
        return StartupChoice.REMOTE
    if remote is not None and remote.outer_step == 0 and local_step == 0:
        return StartupChoice.REMOTE_INITIAL
    if has_local:
        return StartupChoice.LOCAL
    return StartupChoice.BOOTSTRAP


def provision_store(transport: Transport, config: DistributedConfig) -> None:
    """Create the store and grant ``collaborators`` write access; failures are warnings (a
    store that cannot grant says how to do it by hand)."""
    try:
        transport.create_store(private=config.private)
    except TransportError as exc:
        log.warning(
            "creating store %s failed (%s); training continues locally", transport.description, exc
        )
    if not config.collaborators:
        return
    try:
        transport.grant_write_access(list(config.collaborators))
    except UnsupportedOperation as exc:
        log.info("%s; grant write access to %s by hand", exc, config.collaborators)
    except TransportError as exc:
        log.warning("granting write access failed (%s); training continues", exc)


def prepare_master(
    transport: Transport,
    config: DistributedConfig,
    *,
    node_id: str,
    state_dir: Path,
    cache_dir: Path,
    retry: RetryPolicy,
    stop: threading.Event,
    emit: Emit,
    fetch_global: Callable[[GlobalMetadata], TensorDict | None],
    current_weights: Callable[[], TensorDict],
    checkpointed: dict[str, Any] | None = None,
    signing_key: bytes | None = None,
    evaluate: Callable[[TensorDict], float] | None = None,
    fragments: FragmentLayout | None = None,
    lease: LeaseKeeper | None = None,
) -> MasterOuterLoop:
    """Provision the store and build the outer loop at the state the run continues from; the
    loop is returned unstarted.

    ``checkpointed`` is the outer state of a trainer checkpoint (used when it is ahead of the
    state directory); ``fetch_global`` downloads (through the cache) the store's weights;
    ``current_weights`` snapshots the model for a bootstrap; ``signing_key`` and ``evaluate``
    go to the outer loop (with the round rules of ``config``); ``fragments`` is the streaming
    fragment layout (set before a global is adopted, so that its fragment files are kept);
    ``lease`` a lease already held (a standby that took it over), else it is taken here.
    A newer global of the store comes with the outer state it was published with, when the
    store keeps one (:mod:`~speedtronic_diloco.master.store_state`): the run continues from
    it exactly (``store``), else from the weights alone with the momentum restarted.
    """
    provision_store(transport, config)
    if lease is None:
        lease = take_lease(transport, config, node_id, retry, stop)
    outer = MasterOuterLoop(
        transport,
        node_id=node_id,
        state_dir=state_dir,
        cache_dir=cache_dir,
        outer_lr=config.outer_lr,
        outer_momentum=config.outer_momentum,
        retry=retry,
        emit=emit,
        rules=AggregationRules.from_config(config, signing_key),
        evaluate=evaluate,
        keep_outer_steps=config.keep_outer_steps,
        squash_history_every=config.squash_history_every,
        cache_keep=config.cache_keep,
        fragments=fragments,
        global_compression=config.global_compression,
        lease=lease,
    )
    if checkpointed is not None and outer.load_state_dict(checkpointed):
        log.info("master: outer state from the checkpoint (outer step %d)", outer.outer_step)
    _, remote = retry.attempt(
        f"reading global metadata from {transport.description}",
        transport.read_global_metadata,
        stop,
        then="using local state",
    )
    choice = select_startup_state(outer.keeper.has_local_state, outer.outer_step, remote)
    store_step: int | None = None
    if choice in (StartupChoice.REMOTE, StartupChoice.REMOTE_INITIAL):
        assert remote is not None
        tensors = fetch_global(remote)
        stored = None
        if tensors is not None and choice is StartupChoice.REMOTE:
            stored = read_store_state(transport, remote, cache_dir, tensors)
        if stored is not None:
            outer.keeper.adopt_state(stored, remote)
            choice = StartupChoice.STORE
        elif tensors is not None:
            outer.keeper.adopt(remote.outer_step, tensors, remote.processed, remote.nodes, remote)
        else:
            # Train on, but number the next outer step after the store's version.
            choice = (
                StartupChoice.LOCAL if outer.keeper.has_local_state else StartupChoice.BOOTSTRAP
            )
            store_step = remote.outer_step
    if choice is StartupChoice.BOOTSTRAP:
        outer.keeper.bootstrap(current_weights())
    if store_step is not None:
        outer.keeper.continue_after(store_step)
    elif choice is StartupChoice.LOCAL and (remote is None or remote.outer_step < outer.outer_step):
        outer.keeper.mark_unpublished()
    log.info("master startup: %s state at outer step %d", choice.value, outer.outer_step)
    outer.check_current()
    return outer


def take_lease(
    transport: Transport,
    config: DistributedConfig,
    node_id: str,
    retry: RetryPolicy,
    stop: threading.Event,
) -> LeaseKeeper:
    """Take the store's master lease and start renewing it (see :mod:`speedtronic_diloco.lease`).

    Another master's live lease raises :class:`~speedtronic_diloco.lease.LeaseHeldError`, so a
    second master refuses to start. A store that cannot be reached now is a warning: the lease
    is taken before the first publication instead."""
    keeper = LeaseKeeper(
        transport,
        node_id,
        ttl=config.lease_ttl,
        take_over=config.take_over,
        retry=retry,
        failover=config.failover,
    )
    try:
        keeper.acquire(stop)
    except LeaseError:
        raise
    except TransportError as exc:
        log.warning(
            "taking the master lease of %s failed (%s); nothing is published until it is held",
            transport.description,
            exc,
        )
        return keeper
    keeper.start()
    return keeper
