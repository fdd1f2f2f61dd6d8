"""Training one model on several processes of one machine: the run's ranks
(:class:`ParallelContext`, :func:`init_parallel`) and how they share the work
(:class:`ParallelStrategy`: ``none``, ``ddp``, ``fsdp``, or a plugin's).

``speedtronic.parallel`` is the face of the family; its modules are
:mod:`~speedtronic.parallel.context` (process groups and the few collectives the engine needs),
:mod:`~speedtronic.parallel.strategy` (the interface and the single-process strategy),
:mod:`~speedtronic.parallel.builtin` (DDP and FSDP2) and :mod:`~speedtronic.parallel.registry`
(strategies by name). The cross-machine part is DumbDiLoCo.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speedtronic._lazy import by_module, lazy_exports

if TYPE_CHECKING:
    from speedtronic.parallel.builtin import DataParallel, FullyShardedDataParallel
    from speedtronic.parallel.context import (
        SINGLE_PROCESS,
        ParallelContext,
        init_parallel,
        launched_world_size,
    )
    from speedtronic.parallel.registry import (
        BUILTIN_STRATEGIES,
        build_strategy,
        known_strategies,
        register_strategy,
        unregister_strategy,
    )
    from speedtronic.parallel.strategy import ParallelStrategy, SingleProcess

__all__ = [
    "BUILTIN_STRATEGIES",
    "SINGLE_PROCESS",
    "DataParallel",
    "FullyShardedDataParallel",
    "ParallelContext",
    "ParallelStrategy",
    "SingleProcess",
    "build_strategy",
    "init_parallel",
    "known_strategies",
    "launched_world_size",
    "register_strategy",
    "unregister_strategy",
]

_EXPORTS = by_module(
    {
        "registry": (
            "BUILTIN_STRATEGIES",
            "build_strategy",
            "known_strategies",
            "register_strategy",
            "unregister_strategy",
        ),
        "builtin": ("DataParallel", "FullyShardedDataParallel"),
        "context": ("ParallelContext", "SINGLE_PROCESS", "init_parallel", "launched_world_size"),
        "strategy": ("ParallelStrategy", "SingleProcess"),
    }
)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
