"""How long one optimizer step will take on this CPU, said before the first step runs.

A config sized for a GPU (``configs/reference-small.yaml``: 40M parameters, 64k tokens per
step) runs on a CPU too, at minutes per step; without a word that looks like a hang. So a CPU
run estimates its time per step at start (:func:`announce_long_steps`, warning when it is over
:data:`LONG_STEP_S`), and ``speedtronic validate`` prints the same estimate as a line
(:func:`estimate_config_step`).

The estimate is the step's work (:class:`StepWork`) against this machine's measured rates
(:class:`MachineRates`), combined by the pure :func:`seconds_per_step`:

- **matmul FLOPs**, the FLOPs counter's count (:mod:`speedtronic.observe.flops`: matmuls and
  attention, forward and backward) times the tokens per step, at the rate of this process's
  matmuls of the model's own weight shapes (rows: the tokens of a micro-batch);
- **the other operators** of a forward and backward (normalisations, activations, softmax,
  the loss, elementwise arithmetic; views are free) and the optimizer's passes over the
  parameters, counted on the same pass as the FLOPs: each costs this process's measured
  per-call overhead plus its output elements at the measured elementwise rate. On a small
  model these are most of the step (the smoke model spends about a third of it in matmuls).

The rates are measured once per process and shape (:func:`measure_rates`: short timed matmuls
and elementwise products, a few tenths of a second in all) with the thread count torch has
then, so call it after ``run.threads`` is applied. A compiled run fuses elementwise operators,
so its steps after the first can be faster than estimated; its first step adds the
compilation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from speedtronic.observe.flops import REAL_ON_CPU_BELOW, count_flops_per_token, sample_batch

__all__ = [
    "LONG_STEP_S",
    "OPTIMIZER_PASSES",
    "MachineRates",
    "StepEstimate",
    "StepWork",
    "announce_long_steps",
    "count_step_work",
    "estimate_config_step",
    "estimate_run_step",
    "measure_rates",
    "seconds_per_step",
]

log = logging.getLogger("speedtronic.step_estimate")

LONG_STEP_S = 5.0
"""A step estimated to take longer than this many seconds is said at the start of a run."""
SLOWEST_RATE = 1e9
"""FLOP/s. A step of fewer than ``LONG_STEP_S x SLOWEST_RATE`` FLOPs is not long on any CPU
this runs on (the smoke model trains at about 50 GFLOP/s on one core), so a training run does
not spend the measurement on it."""
COMPILED_OTHER = 0.5
"""The share of the other operators' calls and elements left in a compiled model: inductor
fuses chains of elementwise operators into single passes (measured on reference-small on a
CPU, about half the uncompiled time of those operators, ``benchmarks/step_estimate.py``)."""
OPTIMIZER_PASSES = 12
"""Elementwise passes over the parameters per optimizer step: AdamW's moments, bias
corrections and update (about 8), zeroing and clipping the gradients (about 4)."""
TIMED_S = 0.02
"""Seconds each rate measurement (one shape) runs at least."""
MATMUL_BUDGET = 2e9
"""FLOPs at most in one timed matmul: a large micro-batch is timed on fewer rows."""
LARGEST_TIMED = 1 << 22
"""Elements at most in one timed elementwise product (16 MiB in fp32); larger operators are
memory-bound alike, so their time scales from this one."""
TINY = 64
"""Elements of the tensors that time an operator call's fixed cost."""
CHAIN = 20
"""Products in the chain that times an operator call's fixed cost."""
COLD_BYTES = 64 << 20
"""Bytes of operands the timed elementwise products cycle through: more than a cache holds."""
COLD_PAIRS = 256
"""Operand pairs at most in that cycle."""
DOCS = "docs/troubleshooting.md, 'A step takes minutes on a CPU'"


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step computes on one rank, counted before it runs."""

    matmul_flops: float
    """The FLOPs counter's FLOPs (matmuls, attention) of every micro-batch of the step."""
    other_ops: int = 0
    """Calls of other operators (not views): every micro-batch's forward and backward, and
    the optimizer's passes."""
    other_elements: float = 0.0
    """Elements those calls write."""
    matmul_shapes: tuple[tuple[int, int, int, int], ...] = ()
    """``(rows, inner, columns, count)`` of the matmuls the rate is measured on: the model's
    2-D weights applied to a micro-batch's tokens, each distinct shape once with the number of
    weights of that shape."""
    tokens: int = 0
    """Tokens per step on this rank."""


@dataclass(frozen=True)
class MachineRates:
    """This process's measured speed: matmul FLOP/s, the fixed cost of an operator call in
    seconds, and elementwise elements written per second."""

    matmul_flops_per_s: float
    op_overhead_s: float = 0.0
    elements_per_s: float = float("inf")
    threads: int = field(default_factory=torch.get_num_threads)


def seconds_per_step(work: StepWork, rates: MachineRates) -> float:
    """The estimated seconds of one optimizer step: matmul FLOPs at the matmul rate, plus
    each other operator's fixed cost and elements."""
    if rates.matmul_flops_per_s <= 0 or rates.elements_per_s <= 0:
        raise ValueError(f"rates must be positive, got {rates}")
    return (
        work.matmul_flops / rates.matmul_flops_per_s
        + work.other_ops * rates.op_overhead_s
        + work.other_elements / rates.elements_per_s
    )


@dataclass(frozen=True)
class StepEstimate:
    """An estimate of one optimizer step's time on this CPU, and what it is made of."""

    seconds: float
    work: StepWork
    rates: MachineRates

    @property
    def long(self) -> bool:
        """Over :data:`LONG_STEP_S`: worth saying before the run starts."""
        return self.seconds > LONG_STEP_S

    def describe(self) -> str:
        """``about 240 s per step on this CPU (1 thread; ...)``: the figure and its parts."""
        threads = self.rates.threads
        return (
            f"about {_duration(self.seconds)} per step on this CPU ({threads} "
            f"thread{'' if threads == 1 else 's'}; {self.work.matmul_flops:.3g} matmul FLOPs "
            f"at a measured {self.rates.matmul_flops_per_s / 1e9:.3g} GFLOP/s, "
            f"{self.work.other_ops:,} other operator calls)"
        )

    def warning(self, steps: int) -> str:
        """The start-up line of a long run of ``steps`` more steps."""
        total = f"; {steps:,} steps take about {_duration(self.seconds * steps)}" if steps else ""
        return (
            f"{self.describe()}{total}: this config is sized for a GPU (or a long CPU run); "
            f"see {DOCS}"
        )


def _duration(seconds: float) -> str:
    """``0.02 s``, ``66 s``, ``4.1 min``, ``14 days``: two significant figures at most."""
    value, unit = seconds, "s"
    for name, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            value, unit = seconds / size, name
            break
    if value >= 10:
        return f"{value:.0f} {unit}"
    return f"{float(f'{value:.2g}'):g} {unit}"


# ------------------------------------------------------------------ counting the work
class _OperatorTally(TorchDispatchMode):
    """Counts the operator calls the FLOPs counter does not count (views aside) and the
    elements they write."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.counted = set(flop_registry)
        self.calls = 0
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        # Attention kernels are FLOP-counted too (the CPU ones through
        # speedtronic.observe.flops's own formulas, which are not in torch's registry).
        if func.is_view or packet in self.counted or "attention" in packet.__name__:
            return out
        self.calls += 1
        self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _matmul_shapes(model: nn.Module, rows: int) -> tuple[tuple[int, int, int, int], ...]:
    shapes: dict[tuple[int, int, int], int] = {}
    for p in model.parameters():
        if p.ndim == 2 and p.requires_grad:
            shape = (rows, int(p.shape[1]), int(p.shape[0]))
            shapes[shape] = shapes.get(shape, 0) + 1
    found = tuple((*shape, count) for shape, count in sorted(shapes.items()))
    return found or ((rows, 512, 512, 1),)


def count_step_work(
    model: nn.Module,
    batch: Any,
    *,
    micro_batches: int,
    tokens_per_micro_batch: int,
    flops_per_token: float | None = None,
    compiled: bool = False,
) -> StepWork:
    """The work of one step of ``micro_batches`` micro-batches of ``tokens_per_micro_batch``
    tokens, counted on one forward and backward of ``model`` on ``batch`` (one sample is
    enough: see :func:`speedtronic.observe.flops.count_flops_per_token`). ``flops_per_token`` (the
    run's own count) replaces the one counted here; ``compiled``: the model runs under
    ``torch.compile`` (:data:`COMPILED_OTHER`). A model the tally cannot follow is counted
    by its FLOPs alone."""
    from speedtronic.engine.batch import batch_size_and_tokens

    _, sample_tokens = batch_size_and_tokens(batch)
    tally = _OperatorTally()
    try:
        with tally:
            counted = count_flops_per_token(model, batch)
    except Exception as exc:  # the estimate is advice: never a reason to stop a run
        log.debug("counting the operators of %s failed (%s)", type(model).__name__, exc)
        counted, tally.calls, tally.elements = flops_per_token or 0.0, 0, 0
    per_token = flops_per_token if flops_per_token is not None else counted
    tokens = micro_batches * tokens_per_micro_batch
    share = COMPILED_OTHER if compiled else 1.0
    parameters = [p for p in model.parameters() if p.requires_grad]
    elements = share * tally.elements / max(sample_tokens, 1) * tokens
    elements += OPTIMIZER_PASSES * sum(p.numel() for p in parameters)
    rows = max(1, tokens_per_micro_batch)
    return StepWork(
        matmul_flops=per_token * tokens,
        other_ops=round(share * tally.calls * micro_batches) + OPTIMIZER_PASSES,
        other_elements=elements,
        matmul_shapes=_matmul_shapes(model, rows),
        tokens=tokens,
    )


# ------------------------------------------------------------------ measuring the machine
_RATES: dict[tuple[Any, ...], float] = {}


def _seconds_per_call(call: Callable[[], Any]) -> float:
    """``call``'s mean time over a window of at least :data:`TIMED_S` (after one warm-up
    call): a mean, not the best call, so that other work on the cores slows it as much as
    it slows the steps."""
    call()  # warm: allocator, kernels, caches
    calls, started = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= TIMED_S:
            return elapsed / calls


def _matmul_seconds(rows: int, inner: int, columns: int, dtype: torch.dtype) -> float:
    key = ("matmul", rows, inner, columns, dtype, torch.get_num_threads())
    if key not in _RATES:
        x = torch.randn(rows, inner).to(dtype)
        w = torch.randn(columns, inner).to(dtype)
        _RATES[key] = _seconds_per_call(lambda: torch.matmul(x, w.t()))
    return _RATES[key]


def _product_seconds(elements: int, dtype: torch.dtype) -> float:
    """One elementwise product of ``elements`` in a step's conditions: operands that are
    not in the cache (a step's activations outgrow it), a fresh output each call."""
    key = ("mul", elements, dtype, torch.get_num_threads())
    if key not in _RATES:
        pairs = [
            (torch.randn(elements).to(dtype), torch.randn(elements).to(dtype))
            for _ in range(max(1, min(COLD_PAIRS, COLD_BYTES // (8 * elements))))
        ]
        turn = iter(range(1 << 62))

        def product() -> Any:
            a, b = pairs[next(turn) % len(pairs)]
            return torch.mul(a, b)

        _RATES[key] = _seconds_per_call(product)
    return _RATES[key]


def _call_overhead_seconds(dtype: torch.dtype) -> float:
    """One operator call of a training step with next to no data: a chain of products of
    :data:`TINY` elements, forward and backward (autograd's bookkeeping included), per
    operator call."""
    key = ("call", dtype, torch.get_num_threads())
    if key not in _RATES:
        leaf = torch.randn(TINY).to(dtype).requires_grad_()

        def chain() -> None:
            value = leaf
            for _ in range(CHAIN):
                value = value * 1.0001
            value.sum().backward()

        # The chain's calls: CHAIN products and a sum forward, their gradients backward.
        _RATES[key] = _seconds_per_call(chain) / (2 * CHAIN + 2)
    return _RATES[key]


def measure_rates(work: StepWork, dtype: torch.dtype = torch.float32) -> MachineRates:
    """This process's rates for ``work``: its matmul shapes (rows cut so that one matmul is
    at most :data:`MATMUL_BUDGET` FLOPs; the rate is their mean weighted by each shape's
    share of the weights), an operator's fixed cost (a product of
    :data:`TINY` elements) and the elementwise rate at the work's mean operator size (at
    most :data:`LARGEST_TIMED`). Each is measured once per process and thread count."""
    # Seconds per FLOP of each shape, weighted by its share of the weights (of the FLOPs).
    weights = [count * inner * columns for _, inner, columns, count in work.matmul_shapes]
    per_flop = 0.0
    for (rows, inner, columns, _), weight in zip(work.matmul_shapes, weights, strict=True):
        rows = max(1, min(rows, int(MATMUL_BUDGET / (2 * inner * columns))))
        seconds = _matmul_seconds(rows, inner, columns, dtype)
        per_flop += weight / sum(weights) * seconds / (2.0 * rows * inner * columns)
    overhead = _call_overhead_seconds(dtype)
    mean = work.other_elements / work.other_ops if work.other_ops else 0
    size = int(min(max(mean, 16 * TINY), LARGEST_TIMED))
    bare = _product_seconds(TINY, dtype)
    per_element = max(_product_seconds(size, dtype) - bare, 1e-12) / (size - TINY)
    return MachineRates(
        matmul_flops_per_s=1 / per_flop, op_overhead_s=overhead, elements_per_s=1 / per_element
    )


def estimate_step(work: StepWork, dtype: torch.dtype = torch.float32) -> StepEstimate:
    """Measure this machine's rates for ``work`` and estimate its step."""
    rates = measure_rates(work, dtype)
    return StepEstimate(seconds_per_step(work, rates), work, rates)


# ------------------------------------------------------------------ for a run and a config
def estimate_run_step(trainer: Any, *, always: bool = False) -> StepEstimate | None:
    """The estimate for a trainer's model, data and precision at train start (its FLOPs
    counted already: ``trainer.flops``); None without a FLOP count, and, unless ``always``,
    for a step too small to be long on any CPU (:data:`SLOWEST_RATE`)."""
    from speedtronic.engine.model_limits import model_limits

    config = trainer.config
    per_token = trainer.flops.flops_per_token
    strategy = getattr(trainer, "strategy", None)
    model = strategy.flops_model(trainer.model) if strategy is not None else trainer.model
    if per_token is None or model is None:
        return None
    data = trainer.data
    if isinstance(data, (list, tuple)) and data:
        batch = data[0]
    else:
        seq_len = config.data.seq_len or model_limits(model, config.model.params)["seq_len"]
        if seq_len is None:
            return None
        batch = sample_batch(seq_len, trainer.label_mode)
    from speedtronic.engine.batch import batch_size_and_tokens

    samples, tokens = batch_size_and_tokens(batch)
    if not isinstance(data, (list, tuple)):
        tokens = tokens // max(samples, 1) * config.data.micro_batch_size
    micro_batches = trainer.accumulation_steps
    if not always and per_token * tokens * micro_batches < LONG_STEP_S * SLOWEST_RATE:
        return None
    work = count_step_work(
        model,
        batch,
        micro_batches=micro_batches,
        tokens_per_micro_batch=tokens,
        flops_per_token=per_token,
        compiled=bool(trainer.compiled.active),
    )
    return estimate_step(work, trainer.precision.dtype or torch.float32)


def announce_long_steps(trainer: Any) -> StepEstimate | None:
    """At train start on a CPU: estimate the step and warn when it is long (the rank that
    reports, once); the estimate, or None where none was made."""
    if trainer.device.type != "cpu" or not trainer.parallel.is_main:
        return None
    try:
        estimate = estimate_run_step(trainer)
    except Exception as exc:  # advice only: a failure to estimate never stops the run
        log.debug("estimating the step time failed (%s: %s)", type(exc).__name__, exc)
        return None
    if estimate is not None and estimate.long:
        log.warning(estimate.warning(trainer.config.run.max_steps - trainer.step))
    return estimate


def estimate_config_step(config: Any, model: nn.Module, world_size: int = 1) -> str:
    """The estimate line ``speedtronic validate`` prints for ``config`` with its ``model``
    (on the meta device is enough): the time per step on this CPU, or why there is none."""
    from speedtronic.engine.batch import label_mode
    from speedtronic.engine.model_limits import model_limits
    from speedtronic.engine.parts import accumulation_steps
    from speedtronic.engine.precision import resolve_precision

    device = config.run.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        return f"time per step: not estimated on {device} (the estimate is for CPU runs)"
    seq_len = config.data.seq_len or model_limits(model, config.model.params)["seq_len"]
    if seq_len is None:
        return "time per step: not estimated (no sequence length: set data.seq_len)"
    if config.gradient_checkpointing and callable(
        getattr(model, "set_gradient_checkpointing", None)
    ):
        model.set_gradient_checkpointing(True)  # its recomputation is part of the step's time
    if 6 * sum(p.numel() for p in model.parameters()) * seq_len < REAL_ON_CPU_BELOW:
        # Small enough to count on the CPU kernels it will train with, as a run counts it.
        model = model.to_empty(device="cpu") if _on_meta(model) else model
    batch = sample_batch(seq_len, label_mode(config.data.labels, model))
    own = getattr(model, "flops_per_token", None)  # a model's own count wins, as in a run
    micro = config.data.micro_batch_size
    work = count_step_work(
        model,
        batch,
        micro_batches=accumulation_steps(config, world_size),
        tokens_per_micro_batch=micro * seq_len,
        flops_per_token=float(own(seq_len)) if callable(own) else None,
        compiled=config.compile.enabled,
    )
    if not work.matmul_flops:
        return "time per step: not estimated (the FLOPs counter counts nothing in this model)"
    dtype = resolve_precision(config.precision.mode, torch.device("cpu")).dtype
    estimate = estimate_step(work, dtype or torch.float32)
    flag = f" (over {LONG_STEP_S:g} s: sized for a GPU; see {DOCS})" if estimate.long else ""
    return f"time per step (estimate): {estimate.describe()}{flag}"


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))
