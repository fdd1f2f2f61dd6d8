"""The training loop: micro-batches, accumulation, precision, hooks, metrics, checkpoints.

The trainer knows nothing about the model's architecture (see :mod:`speedtronic.batch` for what
it accepts) and builds nothing itself: its parts come from :func:`speedtronic.parts.build_parts`.
The loss is summed on the device and read once per ``logging.log_every`` steps, so the loop
issues no host sync per micro-batch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.batch import (
    aux_metrics,
    batch_size_and_tokens,
    call_model,
    labels_as_inputs,
    loss_of,
    move_to,
)
from speedtronic.checkpoint import (
    CheckpointManager,
    SavedCheckpoint,
    checkpoint_name,
    rng_state,
    set_rng_state,
)
from speedtronic.checkpoint.dcp import load_sharded_weights, sharded_model_shapes
from speedtronic.config import SpeedtronicConfig
from speedtronic.data import DataSource, repeat_epochs
from speedtronic.errors import CheckpointError, DataError, SpeedtronicError
from speedtronic.flops import FlopsReport, measure_run_flops
from speedtronic.fsdp import load_full_model_state, load_optimizer_state
from speedtronic.metrics import MetricLogger, ThroughputMeter, process_memory_mb
from speedtronic.optim import reset_optimizer_state
from speedtronic.parts import TrainingParts, build_parts
from speedtronic.plugins import call_each
from speedtronic.profiling import StepProfiler, build_profiler
from speedtronic.stopping import StopRequest, StopSignals

__all__ = [
    "MAX_CONSECUTIVE_SKIPS",
    "STATE_FORMAT",
    "TrainResult",
    "Trainer",
    "check_trainer_state",
    "state_mismatch",
]

log = logging.getLogger("speedtronic.trainer")


@dataclass
class TrainResult:
    """What ``fit`` returns: counters, the last logged loss and a bounded summary."""

    steps: int
    final_loss: float | None
    samples: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    resumed_from: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False
    """True when the run stopped early (a stop signal or ``request_stop()``), checkpointed."""
    stop_signal: int | None = None
    """The signal that stopped it; the CLI exits with 128 + this number."""


# The keys of a `step` event; a model-returned metric of the same name is logged as model/<name>.
STEP_KEYS = frozenset(
    {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "steps_per_sec",
        "samples_per_sec",
        "tokens_per_sec",
        "tflops",
        "mfu",
        "memory_mb",
        "samples",
        "tokens",
    }
)

# GradScaler halves its scale on every overflow; after this many skipped attempts in a row the
# loss itself is not finite and retrying cannot help.
MAX_CONSECUTIVE_SKIPS = 64


STATE_FORMAT = 1


# What a trainer state must hold to be resumed; anything else is a corrupt checkpoint.
_STATE_INTS = ("step", "samples_seen", "tokens_seen")
_STATE_MAPPINGS = ("model", "optimizer", "scheduler", "rng")
_RNG_KEYS = ("python", "numpy", "torch")


def check_trainer_state(state: Any) -> None:
    """Raise :class:`CheckpointError` unless ``state`` has the shape :meth:`Trainer.state_dict`
    writes (a decoded checkpoint can still be tampered with consistently)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"the trainer state is a {type(state).__name__}, not a mapping")
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(
            f"unsupported trainer state format {state.get('format')!r} "
            f"(this version reads {STATE_FORMAT})"
        )
    for key in _STATE_INTS:
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"the trainer state's {key!r} is not a count: {value!r:.40}")
    for key in _STATE_MAPPINGS:
        if not isinstance(state.get(key), dict):
            raise CheckpointError(f"the trainer state has no {key!r} mapping")
    missing = [key for key in _RNG_KEYS if key not in state["rng"]]
    if missing:
        raise CheckpointError(f"the trainer state's rng lacks {missing}")


def state_mismatch(expected: dict[str, Any], saved: Any, shown: int = 4) -> str:
    """Why ``saved`` (a state dict) cannot load into a model whose state dict is ``expected``:
    each tensor whose shape differs, with both shapes, then missing and unexpected names (the
    first few, then a count); ``""`` when it fits."""
    if not isinstance(saved, dict):
        return f"the saved model state is a {type(saved).__name__}"
    problems: list[str] = []
    shapes = [
        f"{name}: checkpoint {list(saved[name].shape)} vs model {list(tensor.shape)}"
        for name, tensor in expected.items()
        if name in saved
        and hasattr(saved[name], "shape")
        and tuple(saved[name].shape) != tuple(tensor.shape)
    ]
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    for label, items in (
        ("shape mismatch", shapes),
        ("missing in the checkpoint", missing),
        ("not in this model", unexpected),
    ):
        if items:
            more = f" and {len(items) - shown} more" if len(items) > shown else ""
            problems.append(f"{label}: {'; '.join(items[:shown])}{more}")
    if problems:
        problems.append("was model.* changed?")
    return "; ".join(problems)


class Trainer:
    """Runs optimizer steps on ``model`` until ``config.run.max_steps``.

    ``data`` is a :class:`~speedtronic.data.DataSource` (resumable) or any iterable of
    micro-batches. Every other part defaults to what the config says (see
    :func:`~speedtronic.parts.build_parts`); a given ``optimizer`` is wrapped with cautious
    masking when ``optimizer.cautious`` is set. Plugins come from ``plugin_manager`` (the
    process-wide one by default).

    ``plugin_state`` is the per-run home of plugins: a dict, empty when a run begins
    (``on_load_checkpoint`` fills it on resume) and emptied after ``on_train_end``, where a
    plugin keeps what it knows about this run under its own name
    (``trainer.plugin_state["diloco"]``).
    """

    def __init__(
        self,
        model: nn.Module,
        config: SpeedtronicConfig,
        *,
        data: DataSource | Iterable[Any],
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        metric_logger: MetricLogger | None = None,
        plugin_manager: Any = None,
        device: torch.device | None = None,
        checkpoints: CheckpointManager | None = None,
    ) -> None:
        self._adopt(
            build_parts(
                config,
                model,
                data,
                optimizer=optimizer,
                scheduler=scheduler,
                metric_logger=metric_logger,
                plugin_manager=plugin_manager,
                device=device,
                checkpoints=checkpoints,
            )
        )

    @classmethod
    def from_parts(cls, parts: TrainingParts) -> Trainer:
        """A trainer over parts that :func:`~speedtronic.parts.build_parts` made."""
        trainer = cls.__new__(cls)
        trainer._adopt(parts)
        return trainer

    def _adopt(self, parts: TrainingParts) -> None:
        self.config = parts.config
        self.device = parts.device
        self.model = parts.model
        self.precision = parts.precision
        self.optimizer = parts.optimizer
        self.scheduler = parts.scheduler
        self.plugin_manager = parts.plugin_manager
        self.metrics = parts.metrics
        self.data = parts.data
        self.checkpoints = parts.checkpoints
        self.scaler = parts.scaler
        self.compiled = parts.compiled
        self.label_mode = parts.label_mode
        self.ooo_backprop = parts.ooo_backprop
        self.evaluator = parts.evaluator
        # The lowest eval loss so far and its step (checkpoint.keep_best); checkpointed.
        self.best_eval: tuple[float, int] | None = None
        self._last_eval_step: int | None = None
        self._stop = StopRequest()
        self.accumulation_steps = parts.accumulation_steps
        self.parallel = parts.parallel
        self.ddp = parts.ddp
        self.fsdp = parts.fsdp
        self.reset_optimizer_on_weight_replace = True
        self.plugin_state: dict[str, Any] = {}
        self.step = 0
        self.samples_seen = 0
        self.tokens_seen = 0
        self.weights_replaced = 0
        self.resumed_from: int | None = None
        # The last loss read at the log cadence; kept so a run that fails still reports it.
        self.last_loss: float | None = None
        self._resumed_rng: dict[str, Any] | None = None
        self._step_aux: dict[str, torch.Tensor] = {}
        self._consecutive_skips = 0
        # Optimizer steps in a row whose loss was not finite (a device scalar; run.max_nan_steps).
        self._nan_steps = torch.zeros((), dtype=torch.int64)
        # Counted at train start (speedtronic.flops); the profiler window, when configured.
        self.flops = FlopsReport(parameters=0)
        self.profiler: StepProfiler | None = None

    # ------------------------------------------------------------------ events
    def emit(self, event: str, payload: dict[str, Any]) -> None:
        """Send one metric event of this run to its sinks and to every plugin's ``on_metric``
        (a failing plugin is warned about once and never stops training)."""
        if not self.parallel.is_main:
            return  # under DDP rank 0 alone reports: one set of metrics per run
        self.metrics.emit(event, payload)
        call_each(
            self.plugin_manager.hook.on_metric,
            {"trainer": self, "event": event, "payload": payload},
            lambda name, exc: self.metrics.warn_once(f"plugin {name}", exc),
        )

    # ------------------------------------------------------------------ state
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
            load_full_model_state(self.model, state["model"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(
                f"the checkpoint does not fit this model (was model.* changed?): "
                f"{str(exc).strip().splitlines()[0]}"
            ) from exc
        try:
            load_optimizer_state(self.model, self.optimizer, state["optimizer"])
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

    # ------------------------------------------------------------------ loop
    def _batches(self) -> Iterator[Any]:
        if isinstance(self.data, DataSource):
            # A source that can only resume by skipping says so itself (data._skip). The
            # position is the global sample count; each rank reads its own share of it.
            return self.data.iterate(self.samples_seen // self.parallel.world_size)
        batches = repeat_epochs(self.data)
        if self.samples_seen:
            log.warning("resuming a plain iterable: skipping consumed batches is the only way")
            return islice(batches, self.step * self.accumulation_steps, None)
        return batches

    def _next_micro_batches(self, batches: Iterator[Any]) -> list[Any]:
        try:
            micro = [move_to(next(batches), self.device) for _ in range(self.accumulation_steps)]
        except StopIteration:
            raise DataError(
                f"the training data ran out at step {self.step} of {self.config.run.max_steps}; "
                "pass a re-iterable source (list, DataLoader, DataSource) or lower run.max_steps"
            ) from None
        if self.label_mode == "inputs":
            return [labels_as_inputs(batch) for batch in micro]
        return micro

    def _forward_backward(self, batches: list[Any], model: Any) -> torch.Tensor:
        """Forward and backward over one optimizer step's micro-batches; returns their mean
        loss (fp32, unscaled, still on the device)."""
        accumulating = len(batches) > 1
        losses = []
        self._step_aux = {}
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            # Under DDP only the last micro-batch's backward all-reduces the gradients.
            with self.ddp.no_sync() if self.ddp is not None and not last else nullcontext():
                with self.precision.autocast(self.device):
                    output = call_model(model, batch)
                    loss = loss_of(output)
                for key, value in aux_metrics(output).items():
                    # The step's mean of each model-returned scalar, kept on the device.
                    scaled = value.to(self.device) / len(batches)
                    previous = self._step_aux.get(key)
                    self._step_aux[key] = scaled if previous is None else previous + scaled
                del output
                # Each micro-batch loss is a mean; dividing by their count makes the summed
                # gradients those of the mean over the whole optimizer batch.
                if self.fsdp is not None and accumulating:
                    self.fsdp.before_backward(last)
                self.scaler.scale(loss / len(batches) if accumulating else loss).backward()
            self._drain_grads(last=index == len(batches) - 1)
            losses.append(loss.detach())
        if accumulating:
            return torch.stack(losses).float().mean()
        return losses[0].float()

    def _step_loss(self, batches: list[Any]) -> torch.Tensor:
        return self.compiled.run(
            lambda model: self._forward_backward(batches, model),
            reset=lambda: self.optimizer.zero_grad(set_to_none=True),
        )

    def _drain_grads(self, last: bool = True) -> None:
        """A drain point of out-of-order backprop (``ooo_backprop``): after a micro-batch's
        backward the queued weight-gradient products are run (``last=False``: only started, on
        a CUDA side stream they may overlap the next forward); with ``last`` they are finished
        and in ``.grad``. Whatever reads ``.grad`` (GradScaler unscale, clipping, the optimizer
        step, a future DDP reduction) must come after a ``last`` drain."""
        if self.ooo_backprop is None:
            return
        if last:
            self.ooo_backprop.drain()
        else:
            self.ooo_backprop.flush()

    def _optimizer_step(self, want_norm: bool = True) -> tuple[bool, torch.Tensor | None]:
        """Clip and step. Returns (stepped, grad_norm); stepped is False after a GradScaler
        overflow, which skips the update. Without clipping, the norm is only computed when
        ``want_norm`` (it is logged at the log cadence only)."""
        self._drain_grads()  # before unscale, clip and step read .grad
        clip = self.config.optimizer.grad_clip
        grad_norm = None
        if clip is not None or want_norm:
            self.scaler.unscale_(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            # Under FSDP each rank holds gradient shards: the norm is summed over ranks.
            clip_fn = (
                self.fsdp.clip_grad_norm
                if self.fsdp is not None
                else torch.nn.utils.clip_grad_norm_
            )
            grad_norm = clip_fn(params, clip if clip is not None else float("inf"))
        if not self.scaler.is_enabled():
            self.optimizer.step()
            return True, grad_norm
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale_before, grad_norm

    def fit(self) -> TrainResult:
        """Train until ``run.max_steps`` (a global target: a resumed run continues to it), or
        until a stop signal or :meth:`request_stop` (a checkpoint at the last step, then
        ``TrainResult.stopped``)."""
        # Not emptied here: a Python caller may have restored plugins' state with
        # load_state_dict() before calling fit().
        try:
            try:
                return self._fit()
            finally:
                self.checkpoints.close()  # a background write is never left half done
                self.metrics.close()
        finally:
            self.plugin_state = {}

    def _fit(self) -> TrainResult:
        self.model.train()
        if self.config.checkpoint.resume:
            self._resume()
        else:
            self.checkpoints.refuse_to_overwrite(self.step)
        max_steps = self.config.run.max_steps
        if self.step >= max_steps:
            message = f"run already finished: step {self.step} >= run.max_steps {max_steps}"
            log.info(message)
            self.emit("already_finished", {"step": self.step, "max_steps": max_steps})
            return TrainResult(
                self.step,
                None,
                self.samples_seen,
                self.tokens_seen,
                resumed_from=self.resumed_from,
                summary={"message": message},
            )
        self.checkpoints.start_run()

        error: BaseException | None = None
        started = time.perf_counter()
        final_loss: float | None = None
        try:
            self.plugin_manager.hook.on_train_start(trainer=self)
            self.flops = measure_run_flops(self)
            self.profiler = build_profiler(
                self.config.profile,
                self.config.output_dir,
                self.device,
                self.parallel.rank,
                self.parallel.is_main,
            )
            self.emit(
                "train_start",
                {
                    "step": self.step,
                    "start_step": self.step,
                    "max_steps": max_steps,
                    "device": self.device.type,
                    "threads": torch.get_num_threads(),
                    "precision": self.precision.mode,
                    "accumulation_steps": self.accumulation_steps,
                    "compiled": self.compiled.active,
                    **self.flops.start_fields(),
                    "data": {
                        "source": getattr(self.data, "description", type(self.data).__name__),
                        "split": getattr(self.data, "split", "") or "not split",
                    },
                    "config": self.config.to_dict(redact=True),
                },
            )
            with StopSignals(self.config.run.stop_signals, self._stop):
                final_loss = self._loop(max_steps)
                if not self._stop.agreed:
                    self._report_saved(
                        self.checkpoints.maybe_save(self.step, self._checkpoint_state, final=True)
                    )
                    if self.config.eval.runs_at_end and self._last_eval_step != self.step:
                        self.evaluate()
                # Never return (nor exit 0) with a checkpoint still being written.
                self._report_saved(self.checkpoints.wait())
        except BaseException as exc:
            error = exc
            raise
        finally:
            if self.profiler is not None:
                self.profiler.close()
            elapsed = time.perf_counter() - started
            summary = {
                "steps": self.step,
                "final_loss": final_loss if final_loss is not None else self.last_loss,
                "samples": self.samples_seen,
                "tokens": self.tokens_seen,
                "elapsed_s": elapsed,
                "weights_replaced": self.weights_replaced,
                "status": "ok" if error is None else f"error: {type(error).__name__}",
            }
            if error is None and self._stop.agreed:
                summary["status"] = "stopped"
            # train_end goes out before the hooks so that sinks closing in on_train_end
            # still record the summary.
            self.emit("train_end", summary)
            # Every plugin gets to release its resources, even when another one raises.
            call_each(
                self.plugin_manager.hook.on_train_end,
                {"trainer": self, "error": error},
                lambda name, exc: log.error(
                    "plugin %r failed in on_train_end (%s: %s)", name, type(exc).__name__, exc
                ),
            )
        return TrainResult(
            self.step,
            final_loss,
            self.samples_seen,
            self.tokens_seen,
            elapsed,
            self.resumed_from,
            summary,
            stopped=self._stop.agreed,
            stop_signal=self._stop.signal,
        )

    def _stop_now(self) -> None:
        """The ranks agreed to stop after this step: save it, wait for the write, say so."""
        by = self._stop.reason
        if self.checkpoints.policy.writes:
            saved = self.checkpoints.maybe_save(self.step, self._checkpoint_state, force=True)
            self._report_saved(saved + self.checkpoints.wait())
            path: str | None = str(self.checkpoints.directory / checkpoint_name(self.step))
            log.info(
                "stopped by %s at step %d; checkpoint saved to %s; resume with --resume",
                by,
                self.step,
                path,
            )
        else:
            path = None
            log.info(
                "stopped by %s at step %d; no checkpoint (checkpoint.interval is 0 and "
                "save_final is false)",
                by,
                self.step,
            )
        self.emit("stopped", {"signal": self._stop.signal_name, "step": self.step, "path": path})

    def _loop(self, max_steps: int) -> float | None:
        log_every = self.config.logging.log_every
        batches = self._batches()
        self._restore_resumed_rng()
        meter = ThroughputMeter(self.device)
        world = self.parallel.world_size
        last_loss: float | None = None
        profiler = self.profiler
        while self.step < max_steps:
            if profiler is not None:
                profiler.step_begins(self.step + 1)
            micro = self._next_micro_batches(batches)
            step_loss = self._step_loss(micro)
            will_log = (self.step + 1) % log_every == 0 or self.step + 1 == max_steps
            stepped, grad_norm = self._optimizer_step(want_norm=will_log)
            self.optimizer.zero_grad(set_to_none=True)
            # Consumed samples count even when the update is skipped: they are the data
            # position a resumed run restarts from.
            for batch in micro:
                samples, tokens = batch_size_and_tokens(batch)
                # Global counts: every rank consumed a micro-batch of the same shape.
                samples, tokens = samples * world, tokens * world
                self.samples_seen += samples
                self.tokens_seen += tokens
                meter.count_batch(samples, tokens)
            if not stepped:
                self._skipped_step()
                continue
            self._consecutive_skips = 0
            self.scheduler.step()
            self.step += 1
            meter.count_step(step_loss, self._step_aux)
            self._count_nan_step(step_loss)
            self.metrics.progress(self.step)

            replaced = self.plugin_manager.hook.after_optimizer_step(
                trainer=self, model=self.model, step=self.step
            )
            if any(result is True for result in replaced):
                self.weights_replaced += 1
                if self.reset_optimizer_on_weight_replace:
                    reset_optimizer_state(self.optimizer)

            if self.step % log_every == 0 or self.step == max_steps:
                last_loss = self.last_loss = meter.mean_loss(self.parallel.mean)
                if not math.isfinite(last_loss):
                    log.warning("the loss is %s at step %d", last_loss, self.step)
                rates = meter.rates()
                self.emit(
                    "step",
                    {
                        "step": self.step,
                        "loss": last_loss,
                        "lr": float(self.optimizer.param_groups[0]["lr"]),
                        "grad_norm": float(grad_norm.item()) if grad_norm is not None else None,
                        **rates,
                        **self.flops.rates(rates["tokens_per_sec"]),
                        "memory_mb": process_memory_mb(self.device),
                        "samples": self.samples_seen,
                        "tokens": self.tokens_seen,
                        **meter.mean_aux(self.parallel.mean, reserved=STEP_KEYS),
                    },
                )
                meter.reset()
            # Checkpoint time is not training time: keep it out of the step rates.
            with meter.paused():
                self._report_saved(self.checkpoints.maybe_save(self.step, self._checkpoint_state))
            every = self.config.eval.every
            if self.evaluator is not None and every and self.step % every == 0:
                with meter.paused():  # nor is evaluation
                    self.evaluate()
            if profiler is not None and (trace := profiler.step_ended(self.step)) is not None:
                self.emit("profile", {"step": self.step, "path": str(trace)})
            if self._stop.agree(self.parallel):
                with meter.paused():
                    self._stop_now()
                break
        return last_loss

    def evaluate(self) -> Any:
        """Score the model on the held-out samples now; emits an ``eval`` event and, with
        ``checkpoint.keep_best``, keeps a checkpoint of a new best. Returns the
        :class:`~speedtronic.eval.EvalResult` (None without an evaluator)."""
        if self.evaluator is None:
            return None
        result = self.evaluator.evaluate(self.model, self.step)
        self._last_eval_step = self.step
        self.emit("eval", result.payload())
        if self.config.checkpoint.keep_best and (
            self.best_eval is None or result.loss < self.best_eval[0]
        ):
            self.best_eval = (result.loss, self.step)
            if self.checkpoints.last_saved_step != self.step:
                self.save_checkpoint()
            else:
                self._report_saved(self.checkpoints.wait())  # best.json names complete ones
            if self.parallel.is_main:
                self.checkpoints.mark_best(self.step, result.loss)
            log.info("best eval loss so far: %.4f at step %d", result.loss, self.step)
        return result

    def _count_nan_step(self, loss: torch.Tensor) -> None:
        """Count optimizer steps in a row with a non-finite loss (on the device: no sync), and
        stop the run once ``run.max_nan_steps`` failed in a row. The count is read every
        half of that (one host sync, not one per step); every rank reads it at the same
        step, as the mean of the ranks' counts, so all stop together."""
        limit = self.config.run.max_nan_steps
        if not limit:
            return
        finite = torch.isfinite(loss.detach())
        self._nan_steps = torch.where(finite, 0, self._nan_steps.to(loss.device) + 1)
        if self.step % max(1, limit // 2):
            return
        count = float(self.parallel.mean(self._nan_steps.float()).item())
        if count >= limit:
            raise SpeedtronicError(
                f"the loss was NaN or infinite for the last {int(count)} optimizer steps (step "
                f"{self.step}; run.max_nan_steps is {limit}): training has diverged or the "
                "weights are not finite (lower optimizer.lr, add optimizer.grad_clip, try "
                "precision.mode fp32, or check the data and init_from weights)"
            )

    def _skipped_step(self) -> None:
        """Report a GradScaler overflow; the step, scheduler and plugins do not advance."""
        self._consecutive_skips += 1
        self.emit(
            "optimizer_step_skipped",
            {
                "step": self.step,
                "scale": self.scaler.get_scale(),
                "consecutive": self._consecutive_skips,
            },
        )
        if self._consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            raise SpeedtronicError(
                f"{self._consecutive_skips} optimizer steps in a row were skipped for inf/NaN "
                f"gradients at step {self.step}; the loss is not finite (lower optimizer.lr, or "
                "try precision.mode bf16/fp32)"
            )
