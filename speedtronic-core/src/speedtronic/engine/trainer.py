"""The training loop: micro-batches, accumulation, precision, hooks, metrics, checkpoints.

The trainer knows nothing about the model's architecture (see :mod:`speedtronic.engine.batch`
for what it accepts) and builds nothing itself: its parts come from
:func:`speedtronic.engine.parts.build_parts`.
The loss is summed on the device and read once per ``logging.log_every`` steps, so the loop
issues no host sync per micro-batch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.checkpoint import (
    CheckpointManager,
)
from speedtronic.config import SpeedtronicConfig
from speedtronic.data import DataSource, repeat_epochs
from speedtronic.engine.batch import (
    batch_size_and_tokens,
)
from speedtronic.engine.parts import TrainingParts, build_parts
from speedtronic.engine.state_checks import STATE_FORMAT, check_trainer_state, state_mismatch
from speedtronic.engine.stopping import StopRequest, StopSignals
from speedtronic.engine.train_step import MAX_CONSECUTIVE_SKIPS, TrainStep
from speedtronic.engine.trainer_state import TrainerState
from speedtronic.observe.flops import FlopsReport, measure_run_flops
from speedtronic.observe.metrics import MetricLogger, ThroughputMeter, process_memory_mb
from speedtronic.observe.profiling import StepProfiler, build_profiler
from speedtronic.observe.step_estimate import StepEstimate, announce_long_steps
from speedtronic.observe.threads import ThreadGovernor
from speedtronic.optim import reset_optimizer_state
from speedtronic.plugins import call_each

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


class Trainer:
    """Runs optimizer steps on ``model`` until ``config.run.max_steps``.

    ``data`` is a :class:`~speedtronic.data.DataSource` (resumable) or any iterable of
    micro-batches. Every other part defaults to what the config says (see
    :func:`~speedtronic.engine.parts.build_parts`); a given ``optimizer`` is wrapped with cautious
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
        """A trainer over parts that :func:`~speedtronic.engine.parts.build_parts` made."""
        trainer = cls.__new__(cls)
        trainer._adopt(parts)
        return trainer

    def _adopt(self, parts: TrainingParts) -> None:
        self.config = parts.config
        self.device = parts.device
        self.model = parts.model
        self.precision = parts.precision
        self.scheduler = parts.scheduler
        self.plugin_manager = parts.plugin_manager
        self.metrics = parts.metrics
        self.data = parts.data
        self.checkpoints = parts.checkpoints
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
        self.strategy = parts.strategy
        self.reset_optimizer_on_weight_replace = True
        self.plugin_state: dict[str, Any] = {}
        self.step = 0
        self.samples_seen = 0
        self.tokens_seen = 0
        self.weights_replaced = 0
        self.resumed_from: int | None = None
        # The last loss read at the log cadence; kept so a run that fails still reports it.
        self.last_loss: float | None = None
        # Builds, writes, resumes and loads this run's checkpoint state.
        self.checkpointing = TrainerState(self)
        # One optimizer step: micro-batches, backward, clipping, the GradScaler, the counts.
        self.train_step = TrainStep(parts, self.emit)
        # Counted at train start (speedtronic.observe.flops); the profiler window, when configured.
        self.flops = FlopsReport(parameters=0)
        # A CPU run's estimated time per step (speedtronic.observe.step_estimate), when made.
        self.step_estimate: StepEstimate | None = None
        self.profiler: StepProfiler | None = None
        # run.threads: auto following the machine's load while training (CPU runs).
        self.threads: ThreadGovernor | None = None

    # The step's own parts, also the trainer's (a caller may replace either before fit()).
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.train_step.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.train_step.optimizer = optimizer

    @property
    def scaler(self) -> Any:
        """The run's GradScaler (disabled unless the precision needs one)."""
        return self.train_step.scaler

    @scaler.setter
    def scaler(self, scaler: Any) -> None:
        self.train_step.scaler = scaler

    @property
    def ddp(self) -> Any:
        """The DistributedDataParallel wrapper the forward runs through under ``ddp``, else
        None (``trainer.strategy.ddp``)."""
        return self.strategy.ddp

    @property
    def fsdp(self) -> Any:
        """The :class:`~speedtronic.parallel.fsdp.ShardedRun` when the model is sharded over several
        ranks, else None (``trainer.strategy.sharded_run``)."""
        return self.strategy.sharded_run

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
        whole model on the CPU use :func:`speedtronic.parallel.fsdp.full_model_state`."""
        return self.checkpointing.state_dict()

    def load_state_dict(self, state: dict[str, Any], shards: Path | None = None) -> None:
        """Restore a state produced by :meth:`state_dict` (plugins restore theirs via hooks).
        ``shards``: the ``dcp/`` folder of a sharded checkpoint whose model and optimizer
        tensors are loaded from there (resharded to this run), not from ``state``.

        Raises :class:`CheckpointError` when the state does not fit this model or optimizer.
        """
        self.checkpointing.load_state_dict(state, shards)

    def save_checkpoint(self) -> Path:
        """Durably write a checkpoint of the current state now; returns its directory.

        A failed save (disk full, I/O error) is retried once after
        ``checkpoint.save_retry_pause`` seconds; a second failure raises
        :class:`CheckpointError`, with the previous checkpoints intact and this trainer's state
        still in memory (a caller may free space and call this again)."""
        return self.checkpointing.save_now()

    def request_stop(self) -> None:
        """Stop the run after the optimizer step in progress, with a checkpoint at that step,
        as a stop signal does (safe to call from another thread or a hook)."""
        self._stop.request()

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
            self.checkpointing.resume()
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
            self.step_estimate = announce_long_steps(self)  # a long CPU step: said now
            self.profiler = build_profiler(
                self.config.profile,
                self.config.output_dir,
                self.device,
                self.parallel.rank,
                self.parallel.is_main,
            )
            self.emit("train_start", train_start_payload(self, max_steps))
            if self.device.type == "cpu":
                self.threads = ThreadGovernor.for_setting(
                    self.config.run.threads, torch.get_num_threads(), torch.set_num_threads
                )
            with StopSignals(self.config.run.stop_signals, self._stop):
                final_loss = self._loop(max_steps)
                if not self._stop.agreed:
                    self.checkpointing.save_due(final=True)
                    if self.config.eval.runs_at_end and self._last_eval_step != self.step:
                        self.evaluate()
                # Never return (nor exit 0) with a checkpoint still being written.
                self.checkpointing.wait()
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

    def _loop(self, max_steps: int) -> float | None:
        log_every = self.config.logging.log_every
        batches = self._batches()
        self.checkpointing.restore_resumed_rng()
        meter = ThroughputMeter(self.device)
        world = self.parallel.world_size
        last_loss: float | None = None
        profiler = self.profiler
        steps = self.train_step
        while self.step < max_steps:
            if profiler is not None:
                profiler.step_begins(self.step + 1)
            micro = steps.next_micro_batches(batches, self.step)
            step_loss = steps.loss(micro)
            will_log = (self.step + 1) % log_every == 0 or self.step + 1 == max_steps
            stepped, grad_norm = steps.optimizer_step(want_norm=will_log)
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
                steps.skipped_step(self.step)
                continue
            steps.consecutive_skips = 0
            self.scheduler.step()
            self.step += 1
            meter.count_step(step_loss, steps.aux)
            steps.count_nan_step(step_loss, self.step)
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
                self.checkpointing.save_due()
            every = self.config.eval.every
            if self.evaluator is not None and every and self.step % every == 0:
                with meter.paused():  # nor is evaluation
                    self.evaluate()
            if self.threads is not None and (change := self.threads.tick()) is not None:
                self.emit("threads_changed", {"step": self.step, **change})
            if profiler is not None and (trace := profiler.step_ended(self.step)) is not None:
                self.emit("profile", {"step": self.step, "path": str(trace)})
            if self._stop.agree(self.parallel):
                with meter.paused():
                    self.checkpointing.save_on_stop(self._stop.reason, self._stop.signal_name)
                break
        return last_loss

    def evaluate(self) -> Any:
        """Score the model on the held-out samples now; emits an ``eval`` event and, with
        ``checkpoint.keep_best``, keeps a checkpoint of a new best. Returns the
        :class:`~speedtronic.engine.eval.EvalResult` (None without an evaluator)."""
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
                self.checkpointing.wait()  # best.json names complete ones
            if self.parallel.is_main:
                self.checkpoints.mark_best(self.step, result.loss)
            log.info("best eval loss so far: %.4f at step %d", result.loss, self.step)
        return result


def train_start_payload(trainer: Trainer, max_steps: int) -> dict[str, Any]:
    """The ``train_start`` event: where the run starts, on what, and its whole config."""
    data = trainer.data
    return {
        "step": trainer.step,
        "start_step": trainer.step,
        "max_steps": max_steps,
        "device": trainer.device.type,
        "threads": torch.get_num_threads(),
        "precision": trainer.precision.mode,
        "accumulation_steps": trainer.accumulation_steps,
        "compiled": trainer.compiled.active,
        **trainer.flops.start_fields(),
        "data": {
            "source": getattr(data, "description", type(data).__name__),
            "split": getattr(data, "split", "") or "not split",
        },
        "config": trainer.config.to_dict(redact=True),
    }
