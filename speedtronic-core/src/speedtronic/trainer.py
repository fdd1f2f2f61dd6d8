"""The training loop: accumulation, precision, compile fallback, hooks, metrics, checkpoints.

The trainer knows nothing about the model's architecture: any ``nn.Module`` that maps a batch to
a loss works (a tensor, ``{"loss": ...}``, or ``(loss, ...)``). Dict batches are passed as
keyword arguments and tuple batches as ``(inputs, labels)``.

The loss is summed on the device and read once per ``logging.log_every`` steps, so the loop
issues no host sync per micro-batch.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from speedtronic.checkpoint import CheckpointManager
from speedtronic.combined_optimizer import reset_optimizer_state
from speedtronic.config import SpeedtronicConfig
from speedtronic.data import DataSource, repeat_epochs
from speedtronic.errors import CheckpointError, DataError, SpeedtronicError
from speedtronic.metrics import MetricLogger
from speedtronic.precision import Precision, resolve_device, resolve_precision

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


def loss_of(output: Any) -> torch.Tensor:
    """Pick the scalar loss out of a model's output (tensor, ``{"loss"}`` mapping, or tuple)."""
    loss = _pick_loss(output)
    if loss.numel() != 1:
        raise SpeedtronicError(
            f"the model's loss must be a scalar, got a tensor of shape {list(loss.shape)}; "
            "reduce it (e.g. .mean()) inside the model"
        )
    return loss.reshape(())


def _pick_loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        if "loss" not in output:
            raise SpeedtronicError(
                "the model returned a dict without a 'loss' key; return a loss tensor, "
                "{'loss': ...}, or (loss, ...)"
            )
        return output["loss"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise SpeedtronicError(
        f"the model returned {type(output).__name__}; expected a loss tensor, {{'loss': ...}} "
        "or (loss, ...)"
    )


def call_model(model: Any, batch: Any) -> Any:
    """Dict batches go in as kwargs, (inputs, labels) tuples positionally, tensors as is."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch[:2])
    return model(batch)


def move_to(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensor, or dict/list/tuple of them) on ``device``; other values unchanged."""
    non_blocking = device.type == "cuda"
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def batch_size_and_tokens(batch: Any) -> tuple[int, int]:
    """Samples and token positions in a micro-batch, from shapes only (no device sync)."""
    first = batch.get("input_ids") if isinstance(batch, dict) else None
    if first is None:
        if isinstance(batch, dict):
            first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        elif isinstance(batch, (tuple, list)):
            first = batch[0]
        else:
            first = batch
    if not isinstance(first, torch.Tensor) or first.ndim == 0:
        return 1, 1
    return int(first.shape[0]), int(first.numel())


def process_memory_mb(device: torch.device) -> float:
    """CUDA peak allocated memory on GPU, resident set size of this process elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        # Peak rather than current RSS here; macOS reports bytes, Linux kilobytes.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**20 if sys.platform == "darwin" else 2**10)


# GradScaler halves its scale on every overflow; after this many skipped attempts in a row the
# loss itself is not finite and retrying cannot help.
MAX_CONSECUTIVE_SKIPS = 64


STATE_FORMAT = 1


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    """Runs optimizer steps on ``model`` until ``config.run.max_steps``.

    ``data`` is a :class:`~speedtronic.data.DataSource` (resumable) or any iterable of
    micro-batches. ``optimizer``/``scheduler`` default to the config's; a given ``optimizer``
    is wrapped with cautious masking when ``optimizer.cautious`` is set. Plugins come from
    ``plugin_manager`` (the process-wide one by default).
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
        from speedtronic.optim import build_optimizer, build_scheduler
        from speedtronic.plugins import get_plugin_manager

        self.config = config
        self.device = device or resolve_device(config.run.device)
        self.model = model.to(self.device)
        self.precision: Precision = resolve_precision(config.precision.mode, self.device)
        if optimizer is None:
            optimizer = build_optimizer(self.model, config.optimizer, self.device)
        elif config.optimizer.cautious:
            # `optimizer.cautious` wraps a caller's (third-party) optimizer the same way as a
            # configured one; one the caller already wrapped is kept as it is.
            from speedtronic.cautious import CautiousOptimizer

            if not isinstance(optimizer, CautiousOptimizer):
                log.info("cautious masking on around %s", type(optimizer).__name__)
                optimizer = CautiousOptimizer(optimizer)
        self.optimizer = optimizer
        self.scheduler = (
            scheduler
            if scheduler is not None
            else build_scheduler(self.optimizer, config.scheduler, config.run.max_steps)
        )
        self.plugin_manager = plugin_manager if plugin_manager is not None else get_plugin_manager()
        self.metrics = metric_logger or MetricLogger()
        if self.metrics.plugin_manager is None:
            # Plugins' on_metric must see every event, also with a caller-built logger.
            self.metrics.plugin_manager = self.plugin_manager
        self.data = data
        self.checkpoints = checkpoints or CheckpointManager(
            config.checkpoint_dir, config.checkpoint.keep_last
        )
        self.scaler = self.precision.grad_scaler(self.device)
        self.accumulation_steps = config.data.accumulation_steps
        self.reset_optimizer_on_weight_replace = True
        self.step = 0
        self.samples_seen = 0
        self.tokens_seen = 0
        self.weights_replaced = 0
        self.resumed_from: int | None = None
        self._resumed_rng: dict[str, Any] | None = None
        # The torch.compile'd model while compiling works; None means eager.
        self._compiled_model: Any = None
        self._consecutive_skips = 0
        self._configure_model()

    # ------------------------------------------------------------------ setup
    def _configure_model(self) -> None:
        if self.config.gradient_checkpointing:
            setter = getattr(self.model, "set_gradient_checkpointing", None)
            if callable(setter):
                setter(True)
            else:
                log.warning(
                    "gradient_checkpointing is on but %s has no set_gradient_checkpointing(); "
                    "training without it",
                    type(self.model).__name__,
                )
        if self.config.compile.enabled:
            options = self.config.compile
            try:
                self._compiled_model = torch.compile(
                    self.model,
                    backend=options.backend,
                    mode=None if options.mode == "default" else options.mode,
                    fullgraph=options.fullgraph,
                    dynamic=options.dynamic,
                )
            except Exception as exc:  # torch.compile itself is unavailable here
                log.warning("torch.compile is unavailable (%s); training eagerly", exc)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly (plugins add theirs via hooks)."""
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
            "plugins": plugins,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict` (plugins restore theirs via hooks).

        Raises :class:`CheckpointError` when the state does not fit this model or optimizer.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(
                f"unsupported trainer state format {found!r} (this version reads {STATE_FORMAT})"
            )
        try:
            self.model.load_state_dict(state["model"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(
                f"the checkpoint does not fit this model (was model.* changed?): "
                f"{str(exc).strip().splitlines()[0]}"
            ) from exc
        try:
            self.optimizer.load_state_dict(state["optimizer"])
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
        set_rng_state(state["rng"])
        # Applied again once the data iterator exists, see _restore_resumed_rng.
        self._resumed_rng = state["rng"]
        self.plugin_manager.hook.on_load_checkpoint(trainer=self, state=state.get("plugins") or {})

    def save_checkpoint(self) -> Path:
        """Durably write a checkpoint of the current state; returns its directory."""
        path = self.checkpoints.save(self.step, self.state_dict())
        log.debug("checkpoint at step %d: %s", self.step, path)
        self.metrics.emit("checkpoint", {"step": self.step, "path": str(path)})
        return path

    def _resume(self) -> None:
        """Load the newest usable checkpoint; no checkpoint at all means a fresh start."""
        try:
            loaded = self.checkpoints.load_latest()
        except CheckpointError as exc:
            if not self.config.checkpoint.allow_fresh_start:
                raise
            log.warning("%s; starting fresh because checkpoint.allow_fresh_start is set", exc)
            return
        if loaded is None:
            log.info("no checkpoint in %s yet; starting fresh", self.checkpoints.directory)
            return
        self.load_state_dict(loaded.state)
        self.resumed_from = loaded.step
        log.info(
            "resumed from %s (step %d of %d)", loaded.path, loaded.step, self.config.run.max_steps
        )
        self.metrics.emit("resumed", {"step": loaded.step, "path": str(loaded.path)})

    def _restore_resumed_rng(self) -> None:
        """Re-apply a resumed RNG state after the data iterator was created.

        Creating a DataLoader iterator draws its base seed from the global torch RNG. The
        uninterrupted run made that draw at step 0, so the resumed run must not see it.
        """
        if self._resumed_rng is not None:
            set_rng_state(self._resumed_rng)
            self._resumed_rng = None

    def _warn_if_checkpoints_exist(self) -> None:
        config = self.config.checkpoint
        if not (config.interval or config.save_final):
            return
        existing = self.checkpoints.candidates()
        if existing:
            log.warning(
                "%s already holds checkpoints up to %s from an earlier run; this run starts "
                "fresh and writes its own next to them (pass --resume / checkpoint.resume: true "
                "to continue instead)",
                self.checkpoints.directory,
                existing[0].name,
            )

    # ------------------------------------------------------------------ loop
    def _batches(self) -> Iterator[Any]:
        if isinstance(self.data, DataSource):
            # A source that can only resume by skipping says so itself (data._skip).
            return self.data.iterate(self.samples_seen)
        batches = repeat_epochs(self.data)
        if self.samples_seen:
            log.warning("resuming a plain iterable: skipping consumed batches is the only way")
            return islice(batches, self.step * self.accumulation_steps, None)
        return batches

    def _next_micro_batches(self, batches: Iterator[Any]) -> list[Any]:
        try:
            return [move_to(next(batches), self.device) for _ in range(self.accumulation_steps)]
        except StopIteration:
            raise DataError(
                f"the training data ran out at step {self.step} of {self.config.run.max_steps}; "
                "pass a re-iterable source (list, DataLoader, DataSource) or lower run.max_steps"
            ) from None

    def _forward_backward(self, batches: list[Any], model: Any) -> torch.Tensor:
        """Forward and backward over one optimizer step's micro-batches; returns their mean
        loss (fp32, unscaled, still on the device)."""
        accumulating = len(batches) > 1
        losses = []
        for batch in batches:
            with self.precision.autocast(self.device):
                loss = loss_of(call_model(model, batch))
            # Each micro-batch loss is a mean; dividing by their count makes the summed
            # gradients those of the mean over the whole optimizer batch.
            self.scaler.scale(loss / len(batches) if accumulating else loss).backward()
            losses.append(loss.detach())
        if accumulating:
            return torch.stack(losses).float().mean()
        return losses[0].float()

    def _step_loss(self, batches: list[Any]) -> torch.Tensor:
        if self._compiled_model is None:
            return self._forward_backward(batches, self.model)
        try:
            return self._forward_backward(batches, self._compiled_model)
        except Exception as exc:
            # Keep only a description: the exception's traceback pins the failed attempt's
            # activations in memory.
            lines = str(exc).strip().splitlines()
            failure = f"{type(exc).__name__}: {lines[0] if lines else ''}"
        # Re-run the same micro-batches eagerly, outside the except block: if eager execution
        # fails too, the model itself is wrong and its own error, not the compiler's, reaches
        # the user. Only when eager succeeds was it the compiler's failure.
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(batches, self.model)
        log.warning("torch.compile failed (%s); continuing eagerly", failure)
        self._compiled_model = None
        return loss

    def _optimizer_step(self, want_norm: bool = True) -> tuple[bool, torch.Tensor | None]:
        """Clip and step. Returns (stepped, grad_norm); stepped is False after a GradScaler
        overflow, which skips the update. Without clipping, the norm is only computed when
        ``want_norm`` (it is logged at the log cadence only)."""
        clip = self.config.optimizer.grad_clip
        grad_norm = None
        if clip is not None or want_norm:
            self.scaler.unscale_(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            grad_norm = torch.nn.utils.clip_grad_norm_(
                params, clip if clip is not None else float("inf")
            )
        if not self.scaler.is_enabled():
            self.optimizer.step()
            return True, grad_norm
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale_before, grad_norm

    def fit(self) -> TrainResult:
        """Train until ``run.max_steps`` (a global target: a resumed run continues to it)."""
        self.model.train()
        if self.config.checkpoint.resume:
            try:
                self._resume()
            except BaseException:
                self.metrics.close()
                raise
        else:
            self._warn_if_checkpoints_exist()
        max_steps = self.config.run.max_steps
        if self.step >= max_steps:
            message = f"run already finished: step {self.step} >= run.max_steps {max_steps}"
            log.info(message)
            self.metrics.emit("already_finished", {"step": self.step, "max_steps": max_steps})
            self.metrics.close()
            return TrainResult(
                self.step,
                None,
                self.samples_seen,
                self.tokens_seen,
                resumed_from=self.resumed_from,
                summary={"message": message},
            )

        error: BaseException | None = None
        started = time.perf_counter()
        final_loss: float | None = None
        try:
            self.plugin_manager.hook.on_train_start(trainer=self)
            self.metrics.emit(
                "train_start",
                {
                    "step": self.step,
                    "start_step": self.step,
                    "max_steps": max_steps,
                    "device": self.device.type,
                    "precision": self.precision.mode,
                    "accumulation_steps": self.accumulation_steps,
                    "compiled": self._compiled_model is not None,
                    "config": self.config.to_dict(redact=True),
                },
            )
            final_loss = self._loop(max_steps)
            if self.config.checkpoint.save_final and not self._saved_at(self.step):
                self.save_checkpoint()
        except BaseException as exc:
            error = exc
            raise
        finally:
            elapsed = time.perf_counter() - started
            summary = {
                "steps": self.step,
                "final_loss": final_loss,
                "samples": self.samples_seen,
                "tokens": self.tokens_seen,
                "elapsed_s": elapsed,
                "weights_replaced": self.weights_replaced,
                "status": "ok" if error is None else f"error: {type(error).__name__}",
            }
            # train_end goes out before the hooks so that sinks closing in on_train_end
            # still record the summary.
            self.metrics.emit("train_end", summary)
            try:
                self.plugin_manager.hook.on_train_end(trainer=self, error=error)
            finally:
                self.metrics.close()
        return TrainResult(
            self.step,
            final_loss,
            self.samples_seen,
            self.tokens_seen,
            elapsed,
            self.resumed_from,
            summary,
        )

    def _saved_at(self, step: int) -> bool:
        interval = self.config.checkpoint.interval
        return bool(interval) and step % interval == 0

    def _loop(self, max_steps: int) -> float | None:
        log_every = self.config.logging.log_every
        batches = self._batches()
        self._restore_resumed_rng()
        window_loss = torch.zeros((), device=self.device)
        window_steps = 0
        window_samples = 0
        window_tokens = 0
        window_start = time.perf_counter()
        last_loss: float | None = None
        while self.step < max_steps:
            micro = self._next_micro_batches(batches)
            step_loss = self._step_loss(micro)
            will_log = (self.step + 1) % log_every == 0 or self.step + 1 == max_steps
            stepped, grad_norm = self._optimizer_step(want_norm=will_log)
            self.optimizer.zero_grad(set_to_none=True)
            # Consumed samples count even when the update is skipped: they are the data
            # position a resumed run restarts from.
            for batch in micro:
                samples, tokens = batch_size_and_tokens(batch)
                self.samples_seen += samples
                self.tokens_seen += tokens
                window_samples += samples
                window_tokens += tokens
            if not stepped:
                self._skipped_step()
                continue
            self._consecutive_skips = 0
            self.scheduler.step()
            self.step += 1
            window_loss += step_loss
            window_steps += 1

            replaced = self.plugin_manager.hook.after_optimizer_step(
                trainer=self, model=self.model, step=self.step
            )
            if any(result is True for result in replaced):
                self.weights_replaced += 1
                if self.reset_optimizer_on_weight_replace:
                    reset_optimizer_state(self.optimizer)

            if self.step % log_every == 0 or self.step == max_steps:
                last_loss = float(window_loss.item() / window_steps)
                if not math.isfinite(last_loss):
                    log.warning("the loss is %s at step %d", last_loss, self.step)
                elapsed = max(time.perf_counter() - window_start, 1e-9)
                self.metrics.emit(
                    "step",
                    {
                        "step": self.step,
                        "loss": last_loss,
                        "lr": float(self.optimizer.param_groups[0]["lr"]),
                        "grad_norm": float(grad_norm.item()) if grad_norm is not None else None,
                        "steps_per_sec": window_steps / elapsed,
                        "samples_per_sec": window_samples / elapsed,
                        "tokens_per_sec": window_tokens / elapsed,
                        "memory_mb": process_memory_mb(self.device),
                        "samples": self.samples_seen,
                        "tokens": self.tokens_seen,
                    },
                )
                window_loss = torch.zeros((), device=self.device)
                window_steps = window_samples = window_tokens = 0
                window_start = time.perf_counter()
            if self._saved_at(self.step):
                saving_since = time.perf_counter()
                self.save_checkpoint()
                # Checkpoint time is not training time: keep it out of the step rates.
                window_start += time.perf_counter() - saving_since
        return last_loss

    def _skipped_step(self) -> None:
        """Report a GradScaler overflow; the step, scheduler and plugins do not advance."""
        self._consecutive_skips += 1
        self.metrics.emit(
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
