"""The :class:`Trainer <speedtronic.trainer.Trainer>` methods that build, write, resume and
load its checkpoint state (what a decoded state must hold: :mod:`speedtronic.state_checks`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from speedtronic.checkpoint import SavedCheckpoint, rng_state, set_rng_state
from speedtronic.checkpoint.dcp import load_sharded_weights, sharded_model_shapes
from speedtronic.errors import CheckpointError
from speedtronic.parallel.strategy import ParallelStrategy
from speedtronic.state_checks import STATE_FORMAT, check_trainer_state, state_mismatch

__all__ = ["TrainerState"]

log = logging.getLogger("speedtronic.trainer")


class TrainerState:
    """The checkpoint side of :class:`~speedtronic.trainer.Trainer` (a base class of it: the
    attributes used here are the trainer's)."""

    # Set by the trainer; declared for readers of this class.
    strategy: ParallelStrategy
    step: int
    samples_seen: int
    tokens_seen: int

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly (plugins add theirs via hooks).
        Under FSDP ``model`` and ``optimizer`` hold this rank's shards (DTensors); for the
        whole model on the CPU use :func:`speedtronic.fsdp.full_model_state`."""
        plugins: dict[str, Any] = {}
        self.plugin_manager.hook.on_checkpoint(trainer=self, state=plugins)
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "weights_replaced": self.weights_replaced,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "rng": rng_state(),
            # The data position is the global index of the next sample: the synthetic and byte
            # text streams restart exactly there (DataSource.iterate(start_sample)).
            "data": {
                "start_sample": self.samples_seen,
                "source": getattr(self.data, "description", type(self.data).__name__),
            },
            "config": self.config.to_dict(redact=True),
            "eval": {"best_loss": self.best_eval[0], "best_step": self.best_eval[1]}
            if self.best_eval is not None
            else {},
            "plugins": plugins,
        }

    def load_state_dict(self, state: dict[str, Any], shards: Path | None = None) -> None:
        """Restore a state produced by :meth:`state_dict` (plugins restore theirs via hooks).
        ``shards``: the ``dcp/`` folder of a sharded checkpoint whose model and optimizer
        tensors are loaded from there (resharded to this run), not from ``state``.

        Raises :class:`CheckpointError` when the state does not fit this model or optimizer.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(
                f"unsupported trainer state format {found!r} (this version reads {STATE_FORMAT})"
            )
        if shards is not None:
            self._check_fits(sharded_model_shapes(shards))
            load_sharded_weights(shards, self.model, self.optimizer, state["optimizer"])
        else:
            self._load_weights(state)
        try:
            self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"the checkpoint's optimizer/scheduler state does not fit this "
                f"run (was optimizer.* changed?): {exc}"
            ) from exc
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.tokens_seen = int(state["tokens_seen"])
        self.weights_replaced = int(state.get("weights_replaced", 0))
        best = state.get("eval") or {}
        if isinstance(best.get("best_loss"), float) and isinstance(best.get("best_step"), int):
            self.best_eval = (best["best_loss"], best["best_step"])
        rng = state["rng"]
        per_rank = state.get("rng_per_rank")
        if isinstance(per_rank, list) and len(per_rank) == self.parallel.world_size:
            rng = per_rank[self.parallel.rank]
        elif self.parallel.enabled:
            log.warning(
                "the checkpoint was written by a different number of ranks: every rank "
                "continues from rank 0's random generators (data positions are exact)"
            )
        set_rng_state(rng)
        # Applied again once the data iterator exists, see _restore_resumed_rng.
        self._resumed_rng = rng
        self.plugin_manager.hook.on_load_checkpoint(trainer=self, state=state.get("plugins") or {})

    def _check_fits(self, saved: Any) -> None:
        """Raise :class:`CheckpointError` naming what of the saved model state (tensors, or
        meta tensors of a sharded checkpoint's whole shapes) does not fit this model."""
        mismatch = state_mismatch(self.model.state_dict(), saved)
        if mismatch:
            raise CheckpointError(f"the checkpoint does not fit this model ({mismatch})")

    def _load_weights(self, state: dict[str, Any]) -> None:
        """Model and optimizer from a full state (of a single-process, DDP or FSDP run)."""
        self._check_fits(state["model"])
        try:
            self.strategy.load_full_model_state(self.model, state["model"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(
                f"the checkpoint does not fit this model (was model.* changed?): "
                f"{str(exc).strip().splitlines()[0]}"
            ) from exc
        try:
            self.strategy.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"the checkpoint's optimizer state does not fit this run (was optimizer.* "
                f"changed?): {exc}"
            ) from exc

    def save_checkpoint(self) -> Path:
        """Durably write a checkpoint of the current state now; returns its directory.

        A failed save (disk full, I/O error) is retried once after
        ``checkpoint.save_retry_pause`` seconds; a second failure raises
        :class:`CheckpointError`, with the previous checkpoints intact and this trainer's state
        still in memory (a caller may free space and call this again)."""
        saved = self.checkpoints.save_now(self.step, self._checkpoint_state)
        self._report_saved([saved])
        return saved.path

    def request_stop(self) -> None:
        """Stop the run after the optimizer step in progress, with a checkpoint at that step,
        as a stop signal does (safe to call from another thread or a hook)."""
        self._stop.request()

    def _checkpoint_state(self) -> dict[str, Any]:
        state = self.state_dict()
        if self.parallel.enabled:
            # Every rank's generators, so a resume with the same world size continues each
            # rank exactly (a collective: every rank builds the state; rank 0 writes it, or under
            # FSDP every rank its own shards).
            state["rng_per_rank"] = self.parallel.gather(state["rng"])
        return state

    def _report_saved(self, saved: list[SavedCheckpoint]) -> None:
        for checkpoint in saved:
            log.debug("checkpoint at step %d: %s", checkpoint.step, checkpoint.path)
            self.emit("checkpoint", {"step": checkpoint.step, "path": str(checkpoint.path)})

    def _resume(self) -> None:
        """Load the newest usable checkpoint; no checkpoint at all means a fresh start."""
        # A sharded checkpoint's weights stay on disk here: each rank loads its own shards.
        loaded = self.checkpoints.resume_point(check=check_trainer_state, weights=False)
        if loaded is None:
            return
        self.load_state_dict(loaded.state, shards=loaded.shards)
        self.resumed_from = loaded.step
        log.info(
            "resumed from %s (step %d of %d)", loaded.path, loaded.step, self.config.run.max_steps
        )
        self.emit("resumed", {"step": loaded.step, "path": str(loaded.path)})

    def _restore_resumed_rng(self) -> None:
        """Re-apply a resumed RNG state after the data iterator was created.

        Creating a DataLoader iterator draws its base seed from the global torch RNG. The
        uninterrupted run made that draw at step 0, so the resumed run must not see it.
        """
        if self._resumed_rng is not None:
            set_rng_state(self._resumed_rng)
            self._resumed_rng = None
