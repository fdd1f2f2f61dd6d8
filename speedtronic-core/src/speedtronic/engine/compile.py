"""``compile.enabled``: run the model through ``torch.compile``, and fall back to eager once.

A compiler failure must not cost the run: the failed step is redone eagerly on the same
micro-batches and the run continues eagerly. When eager execution fails too, the model itself
is wrong and its own error, not the compiler's, reaches the user.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from speedtronic.config import CompileConfig

__all__ = ["CompiledModel"]

log = logging.getLogger("speedtronic.trainer")

T = TypeVar("T")


class CompiledModel:
    """The eager model and, while compiling works, its ``torch.compile``'d twin."""

    def __init__(
        self, model: nn.Module, options: CompileConfig, units: list[nn.Module] | None = None
    ) -> None:
        self.eager = model
        self.compiled: Any = None
        # Given units (FSDP's), each is compiled in place instead of the whole model: the
        # sharding hooks between them stay eager and the state dict keys do not change.
        self.units = units or []
        if not options.enabled:
            return
        if self.units:
            for unit in self.units:
                unit.compile(
                    backend=options.backend,
                    mode=None if options.mode == "default" else options.mode,
                    fullgraph=options.fullgraph,
                    dynamic=options.dynamic,
                )
            self.compiled = model
            return
        try:
            self.compiled = torch.compile(
                model,
                backend=options.backend,
                mode=None if options.mode == "default" else options.mode,
                fullgraph=options.fullgraph,
                dynamic=options.dynamic,
            )
        except Exception as exc:  # torch.compile itself is unavailable here
            log.warning("torch.compile is unavailable (%s); training eagerly", exc)

    @property
    def active(self) -> bool:
        """True while steps run through the compiled model."""
        return self.compiled is not None

    def run(self, step: Callable[[Any], T], reset: Callable[[], None]) -> T:
        """``step(model)`` with the compiled model; after a failure, ``reset()`` and
        ``step(eager_model)``, and eager from then on."""
        if self.compiled is None:
            return step(self.eager)
        try:
            return step(self.compiled)
        except Exception as exc:
            # Keep only a description: the exception's traceback pins the failed attempt's
            # activations in memory.
            lines = str(exc).strip().splitlines()
            failure = f"{type(exc).__name__}: {lines[0] if lines else ''}"
        # Outside the except block, so an eager failure is reported as itself.
        reset()
        for unit in self.units:
            unit._compiled_call_impl = None  # nn.Module.compile undone: eager from now on
        result = step(self.eager)
        log.warning("torch.compile failed (%s); continuing eagerly", failure)
        self.compiled = None
        return result
