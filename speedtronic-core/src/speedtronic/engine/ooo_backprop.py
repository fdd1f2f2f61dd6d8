"""Out-of-order backprop (``ooo_backprop``): the input gradient first, the weight gradient later.

The backward of a linear layer ``y = x W^T + b`` has two independent products: the input
gradient ``dX = dY W`` (on the critical path to the layer below) and the weight gradient
``dW = dY^T X`` (needed only by whoever reads ``.grad``: clipping, the GradScaler, the optimizer,
a gradient reduction). Oh et al., "Out-of-order backprop" (EuroSys 2022) compute ``dX`` first and
run the ``dW`` products later or on a second CUDA stream, so that they fill the GPU while the
next layer down waits for nothing.

:class:`OOOBackprop` does that for the ``nn.Linear`` layers of one model:

* **The swap.** :meth:`OOOBackprop.install` sets an instance attribute ``forward`` on each
  plain ``nn.Linear`` (one whose class keeps ``nn.Linear.forward``). ``nn.Module.__call__``
  finds it before the class's method, so the module keeps its type, its parameters (the same
  ``Parameter`` objects: tying, optimizers and ``state_dict`` keys are untouched) and its hooks;
  :meth:`OOOBackprop.remove` deletes the attribute again. A forward pre-hook cannot replace the
  computation, and a parametrization or a wrapper module would change ``state_dict`` keys or
  module types, so the instance attribute is the smallest swap. A copy of the model
  (``copy.deepcopy``, pickle) keeps the attribute but not the queue: the copy's linears run the
  ordinary ``F.linear``.
* **The backward.** The swapped forward calls :func:`ooo_linear`, a custom autograd function
  whose backward returns ``dX`` and hands ``dW`` and the bias gradient to the queue instead of
  returning them, so autograd's own accumulation never runs for those weights.
* **The queue.** With ``stream: same`` (and always off CUDA) the products wait in order on the
  device's current stream: when more than ``window`` layer calls wait (default
  :data:`SAME_STREAM_WINDOW`, 1: a layer's ``dW`` runs after the ``dX`` of the layer below) the
  oldest runs, and :meth:`~OOOBackprop.flush` / :meth:`~OOOBackprop.drain` run the rest; each
  is added to ``.grad`` the way autograd does. The window keeps memory as autograd's (holding
  every layer's ``dY`` and ``X`` to the end of backward would not speed up a single stream).
  With ``stream: side`` on CUDA each product is launched at once on a dedicated stream that
  first waits for the default stream (an event: the product's inputs exist), its inputs are
  ``record_stream``-ed so the caching allocator cannot reuse their memory early, and the result
  accumulates into a private buffer per parameter; :meth:`~OOOBackprop.drain` makes the default
  stream wait for the side stream and only then moves the buffers into ``.grad``, so nothing
  races with autograd's own accumulation of a weight that is also used elsewhere (a tied
  embedding).

``.grad`` of a swapped weight is complete only after :meth:`~OOOBackprop.drain`. The trainer
drains after the last micro-batch's backward and again before it unscales, clips or steps
(``TrainStep.drain_grads``); a gradient reduction (DDP) must call ``drain()`` before it reduces.
:meth:`OOOBackprop.guard_optimizer` makes ``optimizer.step()`` fail loudly when a drain was
missed.

What autograd would do, and what happens here:

* accumulation: ``.grad`` is set on first use and added to in place afterwards, in the param's
  dtype and layout, in the order the backward passes ran;
* autocast: the inputs are cast as autocast casts them for ``linear`` (floating, not fp64,
  to the autocast dtype), the products run in that dtype and are cast to the parameter's dtype,
  as autograd's cast backward does;
* frozen weights or biases (``requires_grad=False``): no product is computed or queued;
* ``backward(inputs=...)`` that excludes a weight: no product; ``torch.autograd.grad`` with
  respect to a weight, and weights that are not leaves (computed from other tensors): the
  product is computed at once and returned to autograd, nothing is deferred;
* gradient checkpointing: the recomputed forward saves its tensors through the checkpoint's
  hooks like any op, and a queued product holds its own references to them.

Not covered: tensor hooks and post-accumulate-grad hooks registered on a swapped weight do not
fire (autograd never accumulates it), ``torch.compile`` (mutually exclusive, see
``config.py``), double backward through a swapped layer (an error), and subclasses of
``nn.Linear`` that override ``forward`` (left as they are).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from speedtronic.errors import SpeedtronicError

if TYPE_CHECKING:
    from speedtronic.config import OOOBackpropConfig

__all__ = ["SAME_STREAM_WINDOW", "OOOBackprop", "install_ooo_backprop", "ooo_linear"]

log = logging.getLogger("speedtronic.ooo_backprop")

_warned: set[str] = set()

SAME_STREAM_WINDOW = 1
"""Layer calls whose products may wait in ``same`` mode before the oldest runs."""


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


# ---------------------------------------------------------------------------- autocast
def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for ``device_type``, or None when autocast is off there."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: per-device functions
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        if device_type == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        return None


def _autocast_cast(tensor: Tensor | None, dtype: torch.dtype, device_type: str) -> Tensor | None:
    """``tensor`` cast the way autocast casts the arguments of a lower-precision op."""
    if (
        tensor is None
        or not tensor.is_floating_point()
        or tensor.dtype in (dtype, torch.float64)
        or tensor.device.type != device_type
    ):
        return tensor
    return tensor.to(dtype)


@contextmanager
def _without_autocast(device_type: str) -> Iterator[None]:
    """Backward products run in their inputs' dtypes, even if backward runs inside autocast."""
    if _autocast_dtype(device_type) is None:
        yield
        return
    with torch.autocast(device_type, enabled=False):
        yield


# ---------------------------------------------------------------------------- products
def _weight_products(
    grad_output: Tensor, inputs: Tensor, want_weight: bool, want_bias: bool
) -> tuple[Tensor | None, Tensor | None]:
    """``dW = dY^T X`` and ``db = sum(dY)`` over every leading dimension."""
    grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
    weight_grad = grad_2d.t().mm(inputs.reshape(-1, inputs.shape[-1])) if want_weight else None
    bias_grad = grad_2d.sum(0) if want_bias else None
    return weight_grad, bias_grad


def _as_grad_of(param: Tensor, grad: Tensor) -> Tensor:
    """``grad`` in ``param``'s dtype and strides (autograd's layout contract for ``.grad``)."""
    grad = grad.to(param.dtype)
    if grad.stride() != param.stride():
        grad = torch.empty_like(param).copy_(grad)
    return grad


def _accumulate(param: Tensor, grad: Tensor) -> None:
    """Add ``grad`` into ``param.grad`` as autograd's AccumulateGrad does (no graph)."""
    if param.grad is None:
        param.grad = _as_grad_of(param, grad)
    else:
        param.grad.add_(grad.to(param.grad.dtype))


@dataclass
class _Job:
    """One layer call's deferred products: which leaves receive them, and their operands."""

    weight: Tensor | None  # the leaf that receives dW (None: no dW wanted)
    bias: Tensor | None  # the leaf that receives db
    grad_output: Tensor
    inputs: Tensor

    def products(self) -> tuple[Tensor | None, Tensor | None]:
        with _without_autocast(self.grad_output.device.type):
            return _weight_products(
                self.grad_output, self.inputs, self.weight is not None, self.bias is not None
            )


# ---------------------------------------------------------------------------- autograd
_DEFER, _NOW, _SKIP = "defer", "now", "skip"
_will_execute = getattr(torch._C, "_will_engine_execute_node", None)


def _plan(ctx: Any, index: int, leaf: bool) -> str:
    """What to do with the gradient of the ``index``-th input of the function being run:
    defer it into ``.grad``, compute it now and return it to autograd, or skip it."""
    if not ctx.needs_input_grad[index]:
        return _SKIP
    if not leaf:  # a computed weight: its gradient must flow on through the graph
        return _NOW
    if _will_execute is None:
        return _DEFER
    try:
        node = ctx.next_functions[index][0]
        return _DEFER if node is None or _will_execute(node) else _SKIP
    except RuntimeError:  # torch.autograd.grad() is capturing this leaf's gradient
        return _NOW


class _OOOLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns ``dX`` and queues ``dW`` / ``db``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        inputs: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        queue: OOOBackprop,
    ) -> Tensor:
        device_type = inputs.device.type
        dtype = _autocast_dtype(device_type)
        x, w, b = inputs, weight, bias
        if dtype is not None:
            x = _autocast_cast(x, dtype, device_type)
            w = _autocast_cast(w, dtype, device_type)
            b = _autocast_cast(b, dtype, device_type)
        output = F.linear(x, w, b)  # type: ignore[arg-type]
        # The operands as the products will use them (cast, like autocast's saved tensors);
        # save_for_backward routes them through saved-tensor hooks (checkpointing).
        ctx.save_for_backward(x, w)
        ctx.queue = queue
        ctx.input_dtype = inputs.dtype
        ctx.leaves = (weight, bias)
        ctx.leaf = (weight.is_leaf, bias is not None and bias.is_leaf)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        weight, bias = ctx.leaves
        grad_input = grad_weight = grad_bias = None
        with _without_autocast(grad_output.device.type):
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(w).to(ctx.input_dtype)
            weight_plan = _plan(ctx, 1, ctx.leaf[0])
            bias_plan = _plan(ctx, 2, ctx.leaf[1]) if bias is not None else _SKIP
            if _NOW in (weight_plan, bias_plan):
                now_w, now_b = _weight_products(
                    grad_output, x, weight_plan == _NOW, bias_plan == _NOW
                )
                if now_w is not None:
                    grad_weight = now_w.to(weight.dtype)
                if now_b is not None:
                    grad_bias = now_b.to(bias.dtype)
        if _DEFER in (weight_plan, bias_plan):
            ctx.queue.submit(
                _Job(
                    weight if weight_plan == _DEFER else None,
                    bias if bias_plan == _DEFER else None,
                    grad_output,
                    x,
                )
            )
        return grad_input, grad_weight, grad_bias, None


def ooo_linear(inputs: Tensor, weight: Tensor, bias: Tensor | None, queue: OOOBackprop) -> Tensor:
    """``F.linear(inputs, weight, bias)`` whose weight and bias gradients go to ``queue``
    (see :class:`OOOBackprop`); the input gradient is returned to autograd as usual."""
    return _OOOLinear.apply(inputs, weight, bias, queue)


# ---------------------------------------------------------------------------- the swap
class _SwappedForward:
    """The instance ``forward`` of a swapped ``nn.Linear``.

    It holds its module weakly (no reference cycle) and reads ``weight`` / ``bias`` at call
    time, so a parameter replaced after installation is the one used. A copy of it (deepcopy,
    pickle) has no queue and runs the ordinary ``F.linear``.
    """

    __slots__ = ("module", "queue")

    def __init__(self, module: nn.Linear, queue: OOOBackprop | None) -> None:
        self.module = weakref.ref(module)
        self.queue = queue

    def __call__(self, inputs: Tensor) -> Tensor:
        module = self.module()
        if module is None:  # pragma: no cover - only reachable through a stray reference
            raise RuntimeError("the swapped nn.Linear no longer exists")
        weight, bias = module.weight, module.bias
        needs_grad = weight.requires_grad or (bias is not None and bias.requires_grad)
        if self.queue is None or not needs_grad or not torch.is_grad_enabled():
            return F.linear(inputs, weight, bias)
        return ooo_linear(inputs, weight, bias, self.queue)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_SwappedForward, (self.module(), None))


def _swappable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


# ---------------------------------------------------------------------------- queues
class _SideStreams:
    """The ``stream: side`` machinery: one side stream per device, lazily created."""

    def __init__(self, api: Any) -> None:
        self.api = api  # torch.cuda (tests pass torch.cpu, whose streams are no-ops)
        self.streams: dict[torch.device, Any] = {}

    def side(self, device: torch.device) -> Any:
        stream = self.streams.get(device)
        if stream is None:
            # torch.cpu.Stream (the tests' stand-in) takes no device.
            on = {"device": device} if self.api is torch.cuda else {}
            stream = self.streams[device] = self.api.Stream(**on)
        return stream

    def current(self, device: torch.device) -> Any:
        return self.api.current_stream(device)


class OOOBackprop:
    """The deferred weight gradients of the swapped ``nn.Linear`` layers of a model.

    ``stream`` is ``"side"`` (CUDA: a dedicated stream) or ``"same"`` (queued, run in order,
    at most ``window`` layer calls behind; ``window=None`` holds them all until the drain). Off
    CUDA ``"side"`` behaves as ``"same"``: :func:`install_ooo_backprop` warns once about it.
    Use :meth:`install` to swap a model's linears, :meth:`drain` before anything reads
    ``.grad`` and :meth:`remove` to undo the swap.
    """

    def __init__(
        self,
        device: torch.device | str,
        stream: str = "side",
        *,
        window: int | None = SAME_STREAM_WINDOW,
        stream_api: Any = None,
    ) -> None:
        if stream not in ("side", "same"):
            raise ValueError(f"stream must be 'side' or 'same', got {stream!r}")
        if window is not None and window < 0:
            raise ValueError(f"window must be >= 0 or None, got {window}")
        self.device = torch.device(device)
        self.window = window
        # The module providing Stream / current_stream / stream for the side path: torch.cuda
        # on CUDA; the tests pass torch.cpu (whose streams do nothing) to run it on CPU.
        api = stream_api or (torch.cuda if self.device.type == "cuda" else None)
        self._side = _SideStreams(api) if stream == "side" and api is not None else None
        self._queue: deque[_Job] = deque()  # same: products waiting to run, in backward order
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}  # side: id -> (leaf, buffer)
        self._swapped: list[tuple[weakref.ref[nn.Module], _SwappedForward]] = []
        self._hooks: list[Any] = []

    @property
    def mode(self) -> str:
        """``"side"`` when products run on a side stream, else ``"same"``."""
        return "same" if self._side is None else "side"

    @property
    def pending(self) -> int:
        """Products queued, or buffers not yet moved into ``.grad`` (0 after :meth:`drain`)."""
        return len(self._queue) + len(self._buffers)

    @property
    def modules(self) -> list[nn.Module]:
        """The modules currently swapped by this queue."""
        return [m for ref, fwd in self._swapped if (m := ref()) is not None and _owns(m, fwd)]

    # ------------------------------------------------------------------ install
    def install(self, model: nn.Module, modules: str = "linear") -> int:
        """Swap the backward of every plain ``nn.Linear`` in ``model``; returns how many.

        A module swapped by another queue is taken over; one whose ``forward`` someone else
        replaced, or a subclass with its own ``forward``, is left alone (logged).
        """
        if modules != "linear":
            raise ValueError(f"modules must be 'linear', got {modules!r}")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            # DDP's reducer waits for autograd to accumulate every weight, which never happens
            # for a swapped one: it would have to drain() and then reduce.
            raise SpeedtronicError("ooo_backprop does not support DistributedDataParallel yet")
        count = 0
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            current = module.__dict__.get("forward")
            if not _swappable(module) or not (
                current is None or isinstance(current, _SwappedForward)
            ):
                log.info("ooo_backprop leaves %s (%s) alone", name, type(module).__name__)
                continue
            swapped = _SwappedForward(module, self)
            module.forward = swapped  # type: ignore[method-assign]
            self._swapped.append((weakref.ref(module), swapped))
            count += 1
        return count

    def guard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` raise while products are still queued (a missed drain
        would otherwise step on incomplete gradients)."""

        def check(*_: Any) -> None:
            if self.pending:
                raise SpeedtronicError(
                    f"ooo_backprop: optimizer.step() with {self.pending} weight-gradient "
                    "product(s) not drained; call drain() before reading .grad (unscale, clip, "
                    "step, reduce)"
                )

        register = getattr(optimizer, "register_step_pre_hook", None)
        if callable(register):
            self._hooks.append(register(check))

    def remove(self) -> None:
        """Drain, then restore the ordinary ``forward`` of every module this queue swapped."""
        self.drain()
        for ref, swapped in self._swapped:
            module = ref()
            if module is not None and _owns(module, swapped):
                del module.__dict__["forward"]
        self._swapped.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ queue
    def submit(self, job: _Job) -> None:
        """Called from a swapped layer's backward: queue the job, or launch it on the side
        stream."""
        if self._side is None:
            self._queue.append(job)
            if self.window is not None and len(self._queue) > self.window:
                self._run(self._queue.popleft())
            return
        device = job.grad_output.device
        main, side = self._side.current(device), self._side.side(device)
        # The products read dY (just produced on the main stream) and X; the buffers they
        # accumulate into are only touched by the side stream until drain().
        side.wait_stream(main)
        with self._side.api.stream(side):
            weight_grad, bias_grad = job.products()
            if device.type == "cuda":
                # X and dY were allocated on the main stream: keep their memory until the
                # side stream is done with it, although this host reference goes away now.
                job.grad_output.record_stream(side)
                job.inputs.record_stream(side)
            for leaf, grad in ((job.weight, weight_grad), (job.bias, bias_grad)):
                if leaf is None or grad is None:
                    continue
                entry = self._buffers.get(id(leaf))
                if entry is None:
                    self._buffers[id(leaf)] = (leaf, _as_grad_of(leaf, grad))
                else:
                    entry[1].add_(grad.to(entry[1].dtype))

    @staticmethod
    @torch.no_grad()
    def _run(job: _Job) -> None:
        weight_grad, bias_grad = job.products()
        if weight_grad is not None:
            _accumulate(job.weight, weight_grad)  # type: ignore[arg-type]
        if bias_grad is not None:
            _accumulate(job.bias, bias_grad)  # type: ignore[arg-type]

    def flush(self) -> None:
        """Run the queued products now (``same``), in the order the backward queued them;
        with ``side`` they were launched already. ``.grad`` is complete only after
        :meth:`drain`."""
        while self._queue:
            self._run(self._queue.popleft())

    @torch.no_grad()
    def drain(self) -> None:
        """Finish every deferred product and add it to ``.grad``: call before anything reads
        ``.grad``. Cheap and idempotent when nothing is pending."""
        self.flush()
        if self._side is None or not self._buffers:
            return
        for device, side in self._side.streams.items():
            self._side.current(device).wait_stream(side)
        buffers, self._buffers = self._buffers, {}
        for leaf, buffer in buffers.values():
            if buffer.device.type == "cuda":
                # Allocated on the side stream, read and freed through the main stream now.
                buffer.record_stream(self._side.current(buffer.device))
            if leaf.grad is None:
                leaf.grad = buffer
            else:
                leaf.grad.add_(buffer)


def _owns(module: nn.Module, swapped: _SwappedForward) -> bool:
    return module.__dict__.get("forward") is swapped


def install_ooo_backprop(
    model: nn.Module, config: OOOBackpropConfig, device: torch.device
) -> OOOBackprop | None:
    """The ``ooo_backprop`` section applied to ``model`` (already on ``device``): None when
    disabled, else the queue its swapped linears feed. Off CUDA this warns once that the
    active path is CUDA-only and runs the products in order on the same device."""
    if not config.enabled:
        return None
    if device.type != "cuda":
        _warn_once(
            f"device-{device.type}",
            "ooo_backprop is enabled on %s: its active path (weight-gradient products on a "
            "side CUDA stream) is CUDA-only; here the deferred products run in order on the "
            "same device at each drain (the same math, no speed-up)",
            device.type,
        )
    queue = OOOBackprop(device, config.stream)
    count = queue.install(model, config.modules)
    if not count:
        log.warning("ooo_backprop is enabled but %s has no nn.Linear layer", type(model).__name__)
    else:
        log.info("ooo_backprop: %d nn.Linear layer(s), %s stream", count, queue.mode)
    return queue
