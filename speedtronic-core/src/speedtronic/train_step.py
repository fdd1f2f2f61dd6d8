"""One optimizer step of :class:`~speedtronic.trainer.Trainer`: the micro-batches of an
accumulation window, forward and backward under the run's precision (the strategy's gradient
reduction on the last micro-batch only), out-of-order backprop drains, clipping, the
GradScaler, and the counts that stop a run whose loss or gradients are no longer finite."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from speedtronic.batch import aux_metrics, call_model, labels_as_inputs, loss_of, move_to
from speedtronic.errors import DataError, SpeedtronicError

__all__ = ["MAX_CONSECUTIVE_SKIPS", "TrainStep"]

log = logging.getLogger("speedtronic.trainer")

# GradScaler halves its scale on every overflow; after this many skipped attempts in a row the
# loss itself is not finite and retrying cannot help.
MAX_CONSECUTIVE_SKIPS = 64


class TrainStep:
    """The step side of :class:`~speedtronic.trainer.Trainer` (a base class of it: the
    attributes used here are the trainer's)."""

    step: int

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
            # Gradients are reduced over the ranks on the last micro-batch only.
            with self.strategy.sync_gradients(last):
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
                self.strategy.backward(
                    self.scaler.scale(loss / len(batches) if accumulating else loss),
                    last=last,
                    accumulating=accumulating,
                )
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
