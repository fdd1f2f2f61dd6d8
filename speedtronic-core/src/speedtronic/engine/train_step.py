"""One optimizer step of :class:`~speedtronic.engine.trainer.Trainer`: the micro-batches of an
accumulation window, forward and backward under the run's precision (the strategy's gradient
reduction on the last micro-batch only), out-of-order backprop drains, clipping, the
GradScaler, and the counts that stop a run whose loss or gradients are no longer finite."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from speedtronic.engine.batch import aux_metrics, call_model, labels_as_inputs, loss_of, move_to
from speedtronic.errors import DataError, SpeedtronicError

if TYPE_CHECKING:
    from speedtronic.engine.parts import TrainingParts

__all__ = ["MAX_CONSECUTIVE_SKIPS", "TrainStep"]

log = logging.getLogger("speedtronic.trainer")

# GradScaler halves its scale on every overflow; after this many skipped attempts in a row the
# loss itself is not finite and retrying cannot help.
MAX_CONSECUTIVE_SKIPS = 64


class TrainStep:
    """One optimizer step of a run, a component of its :class:`~speedtronic.engine.trainer.Trainer`
    (``trainer.train_step``): it holds the parts a step uses, the run's
    :class:`~speedtronic.parallel.ParallelStrategy` among them, and the step's own counters
    (the model-returned metrics of the last step, skipped and non-finite steps in a row).
    ``emit(event, payload)`` reports a skipped step; the caller passes the step number."""

    def __init__(self, parts: TrainingParts, emit: Callable[[str, dict[str, Any]], None]):
        self.config = parts.config
        self.device = parts.device
        self.precision = parts.precision
        self.scaler = parts.scaler
        self.optimizer = parts.optimizer
        self.compiled = parts.compiled
        self.ooo_backprop = parts.ooo_backprop
        self.strategy = parts.strategy
        self.parallel = parts.parallel
        self.label_mode = parts.label_mode
        self.accumulation_steps = parts.accumulation_steps
        self.emit = emit
        # The last step's mean of each model-returned scalar, kept on the device.
        self.aux: dict[str, torch.Tensor] = {}
        self.consecutive_skips = 0
        # Optimizer steps in a row whose loss was not finite (a device scalar; run.max_nan_steps).
        self.nan_steps = torch.zeros((), dtype=torch.int64)

    def next_micro_batches(self, batches: Iterator[Any], step: int) -> list[Any]:
        """The micro-batches of the optimizer step after ``step``, on the device."""
        try:
            micro = [move_to(next(batches), self.device) for _ in range(self.accumulation_steps)]
        except StopIteration:
            raise DataError(
                f"the training data ran out at step {step} of {self.config.run.max_steps}; "
                "pass a re-iterable source (list, DataLoader, DataSource) or lower run.max_steps"
            ) from None
        if self.label_mode == "inputs":
            return [labels_as_inputs(batch) for batch in micro]
        return micro

    def forward_backward(self, batches: list[Any], model: Any) -> torch.Tensor:
        """Forward and backward over one optimizer step's micro-batches; returns their mean
        loss (fp32, unscaled, still on the device)."""
        accumulating = len(batches) > 1
        losses = []
        self.aux = {}
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            # Gradients are reduced over the ranks on the last micro-batch only.
            with self.strategy.sync_gradients(last):
                with self.precision.autocast(self.device):
                    output = call_model(model, batch)
                    loss = loss_of(output)
                for key, value in aux_metrics(output).items():
                    # The step's mean of each model-returned scalar, kept on the device.
                    scaled = value.to(self.device) / len(batches)
                    previous = self.aux.get(key)
                    self.aux[key] = scaled if previous is None else previous + scaled
                del output
                # Each micro-batch loss is a mean; dividing by their count makes the summed
                # gradients those of the mean over the whole optimizer batch.
                self.strategy.backward(
                    self.scaler.scale(loss / len(batches) if accumulating else loss),
                    last=last,
                    accumulating=accumulating,
                )
            self.drain_grads(last=index == len(batches) - 1)
            losses.append(loss.detach())
        if accumulating:
            return torch.stack(losses).float().mean()
        return losses[0].float()

    def loss(self, batches: list[Any]) -> torch.Tensor:
        """Forward and backward of one step (compiled when ``compile`` says); its mean loss."""
        return self.compiled.run(
            lambda model: self.forward_backward(batches, model),
            reset=lambda: self.optimizer.zero_grad(set_to_none=True),
        )

    def drain_grads(self, last: bool = True) -> None:
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

    def optimizer_step(self, want_norm: bool = True) -> tuple[bool, torch.Tensor | None]:
        """Clip and step. Returns (stepped, grad_norm); stepped is False after a GradScaler
        overflow, which skips the update. Without clipping, the norm is only computed when
        ``want_norm`` (it is logged at the log cadence only)."""
        self.drain_grads()  # before unscale, clip and step read .grad
        clip = self.config.optimizer.grad_clip
        grad_norm = None
        if clip is not None or want_norm:
            self.scaler.unscale_(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            # Under FSDP each rank holds gradient shards: the strategy sums the norm over ranks.
            grad_norm = self.strategy.clip_grad_norm(
                params, clip if clip is not None else float("inf")
            )
        if not self.scaler.is_enabled():
            self.optimizer.step()
            return True, grad_norm
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale_before, grad_norm

    def count_nan_step(self, loss: torch.Tensor, step: int) -> None:
        """Count optimizer steps in a row with a non-finite loss (on the device: no sync), and
        stop the run once ``run.max_nan_steps`` failed in a row. The count is read every
        half of that (one host sync, not one per step); every rank reads it at the same
        step, as the mean of the ranks' counts, so all stop together."""
        limit = self.config.run.max_nan_steps
        if not limit:
            return
        finite = torch.isfinite(loss.detach())
        self.nan_steps = torch.where(finite, 0, self.nan_steps.to(loss.device) + 1)
        if step % max(1, limit // 2):
            return
        count = float(self.parallel.mean(self.nan_steps.float()).item())
        if count >= limit:
            raise SpeedtronicError(
                f"the loss was NaN or infinite for the last {int(count)} optimizer steps (step "
                f"{step}; run.max_nan_steps is {limit}): training has diverged or the "
                "weights are not finite (lower optimizer.lr, add optimizer.grad_clip, try "
                "precision.mode fp32, or check the data and init_from weights)"
            )

    def skipped_step(self, step: int) -> None:
        """Report a GradScaler overflow; the step, scheduler and plugins do not advance."""
        self.consecutive_skips += 1
        self.emit(
            "optimizer_step_skipped",
            {
                "step": step,
                "scale": self.scaler.get_scale(),
                "consecutive": self.consecutive_skips,
            },
        )
        if self.consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            raise SpeedtronicError(
                f"{self.consecutive_skips} optimizer steps in a row were skipped for inf/NaN "
                f"gradients at step {step}; the loss is not finite (lower optimizer.lr, or "
                "try precision.mode bf16/fp32)"
            )
