"""The training loop: accumulation, precision, compile fallback, hooks, metrics, checkpoints.

The trainer knows nothing about the model's architecture: any ``nn.Module`` that maps a batch to
a loss works (a tensor, ``{"loss": ...}``, or ``(loss, ...)``). Dict batches are passed as
keyword arguments and tuple batches as ``(inputs, labels)``.

The loss is summed on the device and read once per ``logging.log_every`` steps, so the loop
issues no host sync per micro-batch.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from speedtronic.checkpoint import CheckpointManager
from speedtronic.config import SpeedtronicConfig
from speedtronic.data import DataSource
from speedtronic.errors import CheckpointError, SpeedtronicError
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
    """Pick the loss out of a model's output (tensor, ``{"loss"}`` mapping, or tuple)."""
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

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget per-parameter state (Adam moments, step counts, momentum buffers)."""
    reset = getattr(optimizer, "reset_state", None)
    if callable(reset):
        reset()
    else:
        optimizer.state.clear()


class Trainer:
    """Runs optimizer steps on ``model`` until ``config.run.max_steps``.

    ``data`` is a :class:`~speedtronic.data.DataSource` (resumable) or any iterable of
    micro-batches. ``optimizer``/``scheduler`` default to the config's. Plugins come from
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
        self.optimizer = optimizer or build_optimizer(self.model, config.optimizer, self.device)
        self.scheduler = scheduler or build_scheduler(
            self.optimizer, config.scheduler, config.run.max_steps
        )
        self.plugin_manager = plugin_manager if plugin_manager is not None else get_plugin_manager()
        self.metrics = metric_logger or MetricLogger(plugin_manager=self.plugin_manager)
        self.data = data
        self.checkpoints = checkpoints or CheckpointManager(
            config.checkpoint_dir, config.checkpoint.keep_last
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.use_grad_scaler)
        self.accumulation_steps = config.data.accumulation_steps
        self.reset_optimizer_on_weight_replace = True
        self.step = 0
        self.samples_seen = 0
        self.tokens_seen = 0
        self.weights_replaced = 0
        self.resumed_from: int | None = None
        self._forward_model: Any = self.model
        self._compiled = False
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
                    "training without it", type(self.model).__name__,
                )
        if self.config.compile.enabled:
            options = self.config.compile
            try:
                self._forward_model = torch.compile(
                    self.model, mode=None if options.mode == "default" else options.mode,
                    fullgraph=options.fullgraph, dynamic=options.dynamic,
                )
                self._compiled = True
            except Exception as exc:  # torch.compile itself is unavailable here
                log.warning("torch.compile is unavailable (%s); training eagerly", exc)

    def request_optimizer_reset(self) -> None:
        """Clear the optimizer's per-parameter state now (used by plugins)."""
        reset_optimizer_state(self.optimizer)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly (plugins add theirs via hooks)."""
        plugins: dict[str, Any] = {}
        self.plugin_manager.hook.on_checkpoint(trainer=self, state=plugins)
        return {
            "format": 1,
            "step": self.step,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "rng": rng_state(),
            "data": {"samples": self.samples_seen},
            "config": self.config.to_dict(redact=True),
            "plugins": plugins,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict` (plugins restore theirs via hooks)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.tokens_seen = int(state["tokens_seen"])
        set_rng_state(state["rng"])
        self.plugin_manager.hook.on_load_checkpoint(trainer=self, state=state.get("plugins", {}))

    def save_checkpoint(self) -> None:
        path = self.checkpoints.save(self.step, self.state_dict())
        self.metrics.emit("checkpoint", {"step": self.step, "path": str(path)})

    def _resume(self) -> None:
        try:
            loaded = self.checkpoints.load_latest()
        except CheckpointError:
            if not self.config.checkpoint.allow_fresh_start:
                raise
            log.warning("no usable checkpoint; starting fresh as checkpoint.allow_fresh_start "
                        "asks")
            return
        if loaded is None:
            log.info("no checkpoint in %s yet; starting fresh", self.checkpoints.directory)
            return
        self.load_state_dict(loaded.state)
        self.resumed_from = loaded.step
        log.info("resumed from %s (step %d)", loaded.path, loaded.step)

    # ------------------------------------------------------------------ loop
    def _batches(self) -> Iterator[Any]:
        if isinstance(self.data, DataSource):
            if self.samples_seen and not self.data.exact_resume:
                log.warning("this data source resumes by skipping %d consumed samples",
                            self.samples_seen)
            return self.data.iterate(self.samples_seen)
        if self.samples_seen:
            log.warning("resuming a plain iterable: skipping consumed batches is the only way")
            from itertools import islice

            return islice(iter(self.data), self.step * self.accumulation_steps, None)
        return iter(self.data)

    def _forward_backward(self, batches: list[Any], model: Any) -> torch.Tensor:
        """Forward and backward over one optimizer step's micro-batches; returns the summed
        (unscaled) mean loss on the device."""
        total = torch.zeros((), device=self.device)
        for batch in batches:
            with self.precision.autocast(self.device):
                loss = loss_of(call_model(model, batch))
            self.scaler.scale(loss / self.accumulation_steps).backward()
            total += loss.detach().float()
        return total / self.accumulation_steps

    def _step_loss(self, batches: list[Any]) -> torch.Tensor:
        if not self._compiled:
            return self._forward_backward(batches, self.model)
        try:
            return self._forward_backward(batches, self._forward_model)
        except Exception as compiled_error:
            self.optimizer.zero_grad(set_to_none=True)
            # Re-run eagerly: if eager fails too, the model itself is wrong and that error
            # is the one the user must see.
            loss = self._forward_backward(batches, self.model)
            log.warning("torch.compile failed (%s: %s); continuing eagerly",
                        type(compiled_error).__name__, str(compiled_error).splitlines()[0]
                        if str(compiled_error) else "")
            self._compiled = False
            self._forward_model = self.model
            return loss

    def _optimizer_step(self) -> tuple[bool, torch.Tensor | None]:
        """Clip and step. Returns (stepped, grad_norm); stepped is False after a GradScaler
        overflow, which skips the update."""
        clip = self.config.optimizer.grad_clip
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
            self._resume()
        max_steps = self.config.run.max_steps
        if self.step >= max_steps:
            message = f"run already finished: step {self.step} >= run.max_steps {max_steps}"
            log.info(message)
            self.metrics.emit("already_finished", {"step": self.step, "max_steps": max_steps})
            self.metrics.close()
            return TrainResult(self.step, None, self.samples_seen, self.tokens_seen,
                               resumed_from=self.resumed_from, summary={"message": message})

        error: BaseException | None = None
        started = time.perf_counter()
        final_loss: float | None = None
        try:
            self.plugin_manager.hook.on_train_start(trainer=self)
            self.metrics.emit("train_start", {
                "step": self.step, "start_step": self.step, "max_steps": max_steps,
                "device": self.device.type, "precision": self.precision.mode,
                "accumulation_steps": self.accumulation_steps,
                "compiled": self._compiled, "config": self.config.to_dict(redact=True),
            })
            final_loss = self._loop(max_steps)
            if self.config.checkpoint.save_final and not self._saved_at(self.step):
                self.save_checkpoint()
        except BaseException as exc:
            error = exc
            raise
        finally:
            elapsed = time.perf_counter() - started
            try:
                self.plugin_manager.hook.on_train_end(trainer=self, error=error)
            finally:
                summary = {
                    "steps": self.step, "final_loss": final_loss, "samples": self.samples_seen,
                    "tokens": self.tokens_seen, "elapsed_s": elapsed,
                    "weights_replaced": self.weights_replaced,
                    "status": "ok" if error is None else f"error: {type(error).__name__}",
                }
                self.metrics.emit("train_end", summary)
                self.metrics.close()
        return TrainResult(self.step, final_loss, self.samples_seen, self.tokens_seen, elapsed,
                           self.resumed_from, summary)

    def _saved_at(self, step: int) -> bool:
        interval = self.config.checkpoint.interval
        return bool(interval) and step % interval == 0

    def _loop(self, max_steps: int) -> float | None:
        log_every = self.config.logging.log_every
        interval = self.config.checkpoint.interval
        batches = self._batches()
        window_loss = torch.zeros((), device=self.device)
        window_steps = 0
        window_samples = 0
        window_tokens = 0
        window_start = time.perf_counter()
        last_loss: float | None = None
        while self.step < max_steps:
            micro = [move_to(next(batches), self.device) for _ in range(self.accumulation_steps)]
            step_loss = self._step_loss(micro)
            stepped, grad_norm = self._optimizer_step()
            self.optimizer.zero_grad(set_to_none=True)
            if not stepped:
                self.metrics.emit("optimizer_step_skipped", {
                    "step": self.step, "scale": self.scaler.get_scale(),
                })
                continue
            self.scheduler.step()
            self.step += 1
            for batch in micro:
                samples, tokens = batch_size_and_tokens(batch)
                self.samples_seen += samples
                self.tokens_seen += tokens
                window_samples += samples
                window_tokens += tokens
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
                elapsed = max(time.perf_counter() - window_start, 1e-9)
                self.metrics.emit("step", {
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
                })
                window_loss = torch.zeros((), device=self.device)
                window_steps = window_samples = window_tokens = 0
                window_start = time.perf_counter()
            if interval and self.step % interval == 0:
                self.save_checkpoint()
        return last_loss
