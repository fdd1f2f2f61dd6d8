"""How much arithmetic a run does: FLOPs per token, achieved TFLOP/s and MFU.

At train start :func:`measure_flops` counts the FLOPs of one micro-batch's forward and backward
with :class:`torch.utils.flop_counter.FlopCounterMode` on the real model's code, run on a
shadow of it (a deep copy that shares no Python state, so a counter or cache on the model does
not see the call) whose parameters and buffers are stand-ins: for a CUDA model or a small CPU
one, one sample on its own device (detached weights, copied buffers, forked random generators:
the run's gradients, statistics and randomness are left as they were); for a large CPU model,
meta tensors (shapes only: nothing is computed or allocated). When one way fails (the meta
device cannot run a data-dependent branch or a tensor kept outside the parameters and buffers;
a real sample does not fit) the other is tried. A model sharded by FSDP is counted on the
meta copy of it taken before sharding (:func:`speedtronic.parallel.fsdp.meta_shadow`). A model that
defines ``flops_per_token(seq_len)`` is asked instead. A model the counter cannot trace at all
gets ``None`` and one warning; training goes on without ``tflops`` and ``mfu``.

Per step, :meth:`FlopsReport.rates` turns tokens per second into achieved model TFLOP/s per
device (``flops_per_token x tokens/s / world size / 1e12``) and, when the device's peak is known,
MFU (``tflops / peak``, Chowdhery et al., PaLM, 2022, appendix B).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speedtronic.engine.batch import batch_size_and_tokens, call_model, loss_of

__all__ = [
    "PEAK_BF16_TFLOPS",
    "FlopsReport",
    "count_flops_per_token",
    "device_peak_tflops",
    "measure_flops",
    "measure_run_flops",
    "sample_batch",
    "trainable_parameters",
]

log = logging.getLogger("speedtronic.flops")

# Dense (no 2:4 sparsity) BF16 tensor-core peaks per device, in TFLOP/s, from the vendors' data
# sheets; the first pattern that matches torch.cuda.get_device_name() wins, so the more
# specific names come first.
#   NVIDIA H100 data sheet (nvidia.com/en-us/data-center/h100): SXM 989, PCIe 756, NVL 835
#   (the sheet prints the sparse figures, 1979 / 1513 / 1671, "with sparsity": halved here).
#   NVIDIA H200 data sheet (nvidia.com/en-us/data-center/h200): SXM 989, NVL 835 (sparse 1979 /
#   1671).
#   NVIDIA A100 data sheet (nvidia.com/en-us/data-center/a100): 312 for SXM4 and PCIe.
#   NVIDIA L4 data sheet: 121 (242 with sparsity); L40S: 362 (733); L40: 181 (362);
#   A10: 125 (250); RTX A6000: 155 (310).
#   AMD Instinct MI300X data sheet (amd.com): 1307 dense BF16.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H100.*NVL", 835.0),
    (r"H100.*PCIe", 756.0),
    (r"H100", 989.0),
    (r"GH200", 989.0),
    (r"H200.*NVL", 835.0),
    (r"H200", 989.0),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"L40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
    (r"RTX A6000", 155.0),
    (r"MI300X", 1307.0),
)


def device_peak_tflops(device: torch.device | str) -> float | None:
    """The table's dense BF16 peak of ``device`` in TFLOP/s (None: not a device it knows)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return peak
    return None


def trainable_parameters(model: nn.Module) -> int:
    """Elements of the parameters that train (a tied tensor counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def sample_batch(seq_len: int, label_mode: str = "shifted") -> dict[str, torch.Tensor]:
    """One sample as the built-in data sources shape it, on the meta device."""
    ids = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids if label_mode == "inputs" else ids.clone()}


def _to_meta(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.empty_like(batch, device="meta")
    if isinstance(batch, Mapping):
        return {key: _to_meta(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_meta(value) for value in batch)
    return batch


def _on_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.zeros(batch.shape, dtype=batch.dtype, device=device)
    if isinstance(batch, Mapping):
        return {key: _on_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_on_device(value, device) for value in batch)
    return batch


def _substitutes(model: nn.Module, meta: bool) -> dict[int, torch.Tensor]:
    """A stand-in for each parameter and buffer, by the original's id (a tied weight gets one):
    meta tensors of the same shapes, or detached views of the weights (autograd leaves of
    their own, so nothing reaches ``.grad``) and copies of the buffers (a batch-norm's running
    statistics stay as they were)."""
    found: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        data = torch.empty_like(param, device="meta") if meta else param.detach()
        found[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
    for buffer in model.buffers():
        found[id(buffer)] = (
            torch.empty_like(buffer, device="meta") if meta else buffer.detach().clone()
        )
    return found


def _sdpa_forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def _sdpa_backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad, query, key, value)


def _cpu_attention() -> dict[Any, Any]:
    """Formulas (on shapes) for the CPU flash-attention kernels, which torch's counter lacks
    (it has the CUDA ones): the same products as any scaled dot-product attention."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    found = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward),
    ):
        op = getattr(aten, name, None)
        if op is not None and op not in flop_registry:
            found[op] = formula
    return found


def _count(model: nn.Module, batch: Any, meta: bool) -> int:
    """FLOPs of one forward and backward of ``model`` on ``batch``, run on a shadow of the model
    holding stand-ins for its tensors (a deep copy that shares nothing but the Python code, so
    counters and caches on the model do not see the call), or through ``functional_call`` on
    the model itself when it cannot be copied. The gradients go to ``torch.autograd.grad``."""
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    stand_ins = _substitutes(model, meta)
    trainable = [t for t in stand_ins.values() if isinstance(t, nn.Parameter) and t.requires_grad]
    try:
        shadow: Any = copy.deepcopy(model, memo=dict(stand_ins))
    except Exception:
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(dict(model.named_buffers(remove_duplicate=False)))
        tensors = {name: stand_ins[id(tensor)] for name, tensor in named.items()}

        def shadow(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, tensors, args, kwargs, tie_weights=False)

    with FlopCounterMode(display=False, custom_mapping=_cpu_attention()) as counter:
        loss = loss_of(call_model(shadow, batch))
        if trainable:
            torch.autograd.grad(loss, trainable, allow_unused=True)
    return int(counter.get_total_flops())


# Below this many FLOPs (6 x parameters x tokens, the usual estimate) one real sample on a CPU
# costs less than the meta device's Python kernels (about a millisecond per operator).
REAL_ON_CPU_BELOW = 2e9


def count_flops_per_token(model: nn.Module, batch: Any) -> float:
    """FLOPs per token of one forward and backward of ``model`` on ``batch`` (any batch the
    trainer accepts, its values unused).

    Where it runs: on a CUDA model, one copy of ``batch`` on the device (its kernels take
    microseconds; the counter's own Python dispatch is the cost); elsewhere on the meta device,
    unless the model is small enough that a real sample is cheaper (:data:`REAL_ON_CPU_BELOW`).
    When the first way fails the other is tried; raises what the model raised when neither
    works."""
    _, tokens = batch_size_and_tokens(batch)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    estimate = 6 * sum(p.numel() for p in model.parameters()) * tokens
    ways = ["real", "meta"]
    if device.type != "cuda" and estimate >= REAL_ON_CPU_BELOW:
        ways.reverse()
    for index, way in enumerate(ways):
        try:
            if way == "meta":
                flops = _count(model, _to_meta(batch), meta=True)
            else:
                devices = [device] if device.type == "cuda" else []
                # A real pass draws dropout masks: the count must not move the run's generators.
                with torch.random.fork_rng(devices=devices):
                    flops = _count(model, _on_device(batch, device), meta=False)
            return flops / max(tokens, 1)
        except Exception as exc:
            if index == len(ways) - 1:
                raise
            log.debug("counting FLOPs (%s) failed (%s); trying %s", way, exc, ways[-1])
    raise AssertionError("unreachable")


@dataclass
class FlopsReport:
    """What a run knows about its arithmetic: the counted FLOPs per token, the trainable
    parameter count and the per-device peak used for MFU (None where unknown)."""

    parameters: int
    flops_per_token: float | None = None
    peak_tflops: float | None = None
    world_size: int = 1

    def start_fields(self) -> dict[str, Any]:
        """The ``train_start`` fields."""
        return {
            "parameters": self.parameters,
            "flops_per_token": self.flops_per_token,
            **({"peak_tflops": self.peak_tflops} if self.peak_tflops is not None else {}),
        }

    def rates(self, tokens_per_sec: float) -> dict[str, float]:
        """``tflops`` (model TFLOP/s per device) and ``mfu`` for a window's global token rate;
        empty without a FLOP count, ``mfu`` left out without a peak."""
        if self.flops_per_token is None:
            return {}
        tflops = self.flops_per_token * tokens_per_sec / self.world_size / 1e12
        if self.peak_tflops is None:
            return {"tflops": tflops}
        return {"tflops": tflops, "mfu": tflops / self.peak_tflops}


def _model_method(model: nn.Module) -> Callable[[int], Any] | None:
    method = getattr(model, "flops_per_token", None)
    return method if callable(method) else None


def measure_flops(
    model: nn.Module,
    *,
    seq_len: int | None,
    label_mode: str = "shifted",
    batch: Any = None,
    device: torch.device | None = None,
    peak_tflops: float | None = None,
    world_size: int = 1,
) -> FlopsReport:
    """Count ``model``'s FLOPs per token (its own ``flops_per_token(seq_len)`` when it has
    one, else on ``batch``, else on one ``[1, seq_len]`` token sample) and find the peak
    (``peak_tflops`` as given, else :func:`device_peak_tflops`). Activation checkpointing
    (a model's ``gradient_checkpointing`` switched by ``set_gradient_checkpointing``) is off
    while counting: the count is the model's arithmetic without the recomputation, as MFU is
    defined. Never raises: a model that cannot be counted gets ``flops_per_token=None`` and
    one warning."""
    report = FlopsReport(
        parameters=trainable_parameters(model),
        peak_tflops=peak_tflops
        if peak_tflops is not None
        else (device_peak_tflops(device) if device is not None else None),
        world_size=world_size,
    )
    method = _model_method(model)
    checkpointing = getattr(model, "gradient_checkpointing", None) is True and callable(
        getattr(model, "set_gradient_checkpointing", None)
    )
    if checkpointing:
        model.set_gradient_checkpointing(False)
    try:
        if method is not None:
            value = float(method(seq_len))
        else:
            if batch is None:
                if seq_len is None:
                    raise ValueError("no sample batch and no sequence length to make one")
                batch = sample_batch(seq_len, label_mode)
            value = count_flops_per_token(model, batch)
        if value > 0:
            report.flops_per_token = value
        else:  # nothing the counter counts (matmuls, convolutions, attention): no rate either
            log.info(
                "%s does no matmul FLOPs; tflops and mfu are not reported", type(model).__name__
            )
    except Exception as exc:
        log.warning(
            "cannot count the FLOPs of %s (%s: %s); tflops and mfu are not reported (give the "
            "model a flops_per_token(seq_len) method to report them)",
            type(model).__name__,
            type(exc).__name__,
            str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "",
        )
    finally:
        if checkpointing:
            model.set_gradient_checkpointing(True)
    return report


def measure_run_flops(trainer: Any) -> FlopsReport:
    """:func:`measure_flops` for a trainer's model, data and device, at train start.

    The sample is the first micro-batch of a list of batches when the run trains on one (its
    shape, never its values), else one ``[1, seq_len]`` token sample shaped as the built-in
    sources shape theirs."""
    from speedtronic.engine.model_limits import model_limits

    config = trainer.config
    model = trainer.model
    strategy = getattr(trainer, "strategy", None)
    if strategy is not None:
        # Under FSDP, the copy taken before sharding (speedtronic.parallel.fsdp.meta_shadow).
        model = strategy.flops_model(model)
        if model is None:
            log.warning(
                "cannot count the FLOPs of the sharded %s (it cannot be copied); tflops and "
                "mfu are not reported",
                type(trainer.model).__name__,
            )
            return FlopsReport(
                parameters=trainable_parameters(trainer.model),
                world_size=trainer.parallel.world_size,
            )
    batch = None
    data = trainer.data
    if isinstance(data, (list, tuple)) and data:
        batch = data[0]
    seq_len = config.data.seq_len or model_limits(model, config.model.params)["seq_len"]
    return measure_flops(
        model,
        seq_len=seq_len,
        label_mode=trainer.label_mode,
        batch=batch,
        device=trainer.device,
        peak_tflops=config.run.peak_tflops,
        world_size=trainer.parallel.world_size,
    )
