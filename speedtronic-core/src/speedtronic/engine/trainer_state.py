"""The checkpoint side of a run: :class:`TrainerState`, a component the
:class:`~speedtronic.engine.trainer.Trainer` holds as ``checkpointing``. It builds, writes,
resumes and loads the trainer state (what a decoded state must hold:
:mod:`speedtronic.engine.state_checks`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from speedtronic.checkpoint import (
    CheckpointManager,
    SavedCheckpoint,
    checkpoint_name,
    rng_state,
    set_rng_state,
)
from speedtronic.checkpoint.dcp import load_sharded_weights, sharded_model_shapes
from speedtronic.engine.run import ConfigLike
from speedtronic.engine.state_checks import STATE_FORMAT, check_trainer_state, state_mismatch
from speedtronic.errors import CheckpointError
from speedtronic.parallel.context import ParallelContext
from speedtronic.parallel.strategy import ParallelStrategy

__all__ = ["CheckpointedRun", "TrainerState"]

log = logging.getLogger("speedtronic.trainer")


class CheckpointedRun(Protocol):
    """What :class:`TrainerState` reads and sets of the run it checkpoints (the trainer is one):
    the parts a state is made of, and the counters a resume sets back."""

    config: ConfigLike
    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    data: Any
    plugin_manager: Any
    parallel: ParallelContext
    strategy: ParallelStrategy
    checkpoints: CheckpointManager
    step: int
    samples_seen: int
    tokens_seen: int
    weights_replaced: int
    best_eval: tuple[float, int] | None
    resumed_from: int | None
    emit: Callable[[str, dict[str, Any]], None]


class TrainerState:
    """Builds, writes, resumes and loads the state of one run (``run``: the trainer, passed
    to the plugins' ``on_checkpoint`` / ``on_load_checkpoint`` as ``trainer``)."""

    def __init__(self, run: CheckpointedRun) -> None:
        self.run = run
        # A resumed run's random generators, applied again once the data iterator exists.
        self._resumed_rng: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly (plugins add theirs via hooks)."""
        run = self.run
        plugins: dict[str, Any] = {}
        run.plugin_manager.hook.on_checkpoint(trainer=run, state=plugins)
        return {
            "format": STATE_FORMAT,
            "step": run.step,
            "samples_seen": run.samples_seen,
            "tokens_seen": run.tokens_seen,
            "weights_replaced": run.weights_replaced,
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
            "rng": rng_state(),
            # The data position is the global index of the next sample: the synthetic and byte
            # text streams restart exactly there (DataSource.iterate(start_sample)).
            "data": {
                "start_sample": run.samples_seen,
                "source": getattr(run.data, "description", type(run.data).__name__),
            },
            "config": run.config.to_dict(redact=True),
            "eval": {"best_loss": run.best_eval[0], "best_step": run.best_eval[1]}
            if run.best_eval is not None
            else {},
            "plugins": plugins,
        }

    def load_state_dict(self, state: dict[str, Any], shards: Path | None = None) -> None:
        """Restore a state made by :meth:`state_dict` (see ``Trainer.load_state_dict``)."""
        run = self.run
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(
                f"unsupported trainer state format {found!r} (this version reads {STATE_FORMAT})"
            )
        if shards is not None:
            self._check_fits(sharded_model_shapes(shards))
            load_sharded_weights(shards, run.model, run.optimizer, state["optimizer"])
        else:
            self._load_weights(state)
        try:
            run.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"the checkpoint's optimizer/scheduler state does not fit this "
                f"run (was optimizer.* changed?): {exc}"
            ) from exc
        if state.get("scaler") and run.scaler.is_enabled():
            run.scaler.load_state_dict(state["scaler"])
        run.step = int(state["step"])
        run.samples_seen = int(state["samples_seen"])
        run.tokens_seen = int(state["tokens_seen"])
        run.weights_replaced = int(state.get("weights_replaced", 0))
        best = state.get("eval") or {}
        if isinstance(best.get("best_loss"), float) and isinstance(best.get("best_step"), int):
            run.best_eval = (best["best_loss"], best["best_step"])
        rng = state["rng"]
        per_rank = state.get("rng_per_rank")
        if isinstance(per_rank, list) and len(per_rank) == run.parallel.world_size:
            rng = per_rank[run.parallel.rank]
        elif run.parallel.enabled:
            log.warning(
                "the checkpoint was written by a different number of ranks: every rank "
                "continues from rank 0's random generators (data positions are exact)"
            )
        set_rng_state(rng)
        # Applied again once the data iterator exists, see restore_resumed_rng.
        self._resumed_rng = rng
        run.plugin_manager.hook.on_load_checkpoint(trainer=run, state=state.get("plugins") or {})

    def _check_fits(self, saved: Any) -> None:
        """Raise :class:`CheckpointError` naming what of the saved model state (tensors, or
        meta tensors of a sharded checkpoint's whole shapes) does not fit this model."""
        mismatch = state_mismatch(self.run.model.state_dict(), saved)
        if mismatch:
            raise CheckpointError(f"the checkpoint does not fit this model ({mismatch})")

    def _load_weights(self, state: dict[str, Any]) -> None:
        """Model and optimizer from a full state (of a single-process, DDP or FSDP run)."""
        run = self.run
        self._check_fits(state["model"])
        try:
            run.strategy.load_full_model_state(run.model, state["model"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(
                f"the checkpoint does not fit this model (was model.* changed?): "
                f"{str(exc).strip().splitlines()[0]}"
            ) from exc
        try:
            run.strategy.load_optimizer_state(run.model, run.optimizer, state["optimizer"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"the checkpoint's optimizer state does not fit this run (was optimizer.* "
                f"changed?): {exc}"
            ) from exc

    # ------------------------------------------------------------------ writing
    def save_now(self) -> Path:
        """Durably write a checkpoint of the current state now (see
        ``Trainer.save_checkpoint``); returns its directory."""
        saved = self.run.checkpoints.save_now(self.run.step, self.checkpoint_state)
        self.report([saved])
        return saved.path

    def save_due(self, *, final: bool = False, force: bool = False) -> None:
        """Write a checkpoint of this step when the policy says one is due (``final``: the
        last step; ``force``: a stop), in the background where configured."""
        self.report(
            self.run.checkpoints.maybe_save(
                self.run.step, self.checkpoint_state, final=final, force=force
            )
        )

    def wait(self) -> None:
        """Wait for a background write to finish and report it."""
        self.report(self.run.checkpoints.wait())

    def checkpoint_state(self) -> dict[str, Any]:
        """The state a checkpoint holds: :meth:`state_dict`, and under several ranks every
        rank's random generators (a collective: every rank builds the state; rank 0 writes
        it, or under FSDP every rank its own shards)."""
        state = self.state_dict()
        if self.run.parallel.enabled:
            # So a resume with the same world size continues each rank exactly.
            state["rng_per_rank"] = self.run.parallel.gather(state["rng"])
        return state

    def report(self, saved: list[SavedCheckpoint]) -> None:
        for checkpoint in saved:
            log.debug("checkpoint at step %d: %s", checkpoint.step, checkpoint.path)
            self.run.emit("checkpoint", {"step": checkpoint.step, "path": str(checkpoint.path)})

    def save_on_stop(self, by: str, signal_name: str | None) -> None:
        """The ranks agreed to stop after this step: save it, wait for the write, say so."""
        run = self.run
        path: str | None = None
        if run.checkpoints.policy.writes:
            self.save_due(force=True)
            self.wait()
            path = str(run.checkpoints.directory / checkpoint_name(run.step))
            log.info(
                "stopped by %s at step %d; checkpoint saved to %s; resume with --resume",
                by,
                run.step,
                path,
            )
        else:
            log.info(
                "stopped by %s at step %d; no checkpoint (checkpoint.interval is 0 and "
                "save_final is false)",
                by,
                run.step,
            )
        run.emit("stopped", {"signal": signal_name, "step": run.step, "path": path})

    # ------------------------------------------------------------------ resuming
    def resume(self) -> None:
        """Load the newest usable checkpoint; no checkpoint at all means a fresh start."""
        run = self.run
        # A sharded checkpoint's weights stay on disk here: each rank loads its own shards.
        loaded = run.checkpoints.resume_point(check=check_trainer_state, weights=False)
        if loaded is None:
            return
        self.load_state_dict(loaded.state, shards=loaded.shards)
        run.resumed_from = loaded.step
        log.info(
            "resumed from %s (step %d of %d)", loaded.path, loaded.step, run.config.run.max_steps
        )
        run.emit("resumed", {"step": loaded.step, "path": str(loaded.path)})

    def restore_resumed_rng(self) -> None:
        """Re-apply a resumed RNG state after the data iterator was created.

        Creating a DataLoader iterator draws its base seed from the global torch RNG. The
        uninterrupted run made that draw at step 0, so the resumed run must not see it.
        """
        if self._resumed_rng is not None:
            set_rng_state(self._resumed_rng)
            self._resumed_rng = None
