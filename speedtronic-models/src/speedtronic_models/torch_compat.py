"""The newer PyTorch features the model uses, with equivalents for torch 2.1-2.4.

SDPA's ``enable_gqa`` arrived in torch 2.5: older versions get key/value heads repeated to
the query head count, which computes the same attention with more memory. The per-device
autocast queries (:func:`compute_dtype`) arrived in 2.4 and ``torch.compiler`` in 2.3.
(``F.rms_norm``, new in 2.4, has its fallback in :mod:`speedtronic_models.norm`.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _probe_gqa() -> bool:
    # SDPA is a C builtin without an inspectable signature: ask it directly, once, at import.
    q = torch.zeros(1, 2, 1, 2)
    kv = torch.zeros(1, 1, 1, 2)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


SDPA_HAS_GQA = _probe_gqa()


def is_compiling() -> bool:
    """True while ``torch.compile`` traces the caller (``torch.compiler`` arrived in 2.3)."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    return torch._dynamo.is_compiling()


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Tensor:
    """``scaled_dot_product_attention`` where ``k``/``v`` may have fewer heads than ``q``."""
    n_head, n_kv_head = q.shape[1], k.shape[1]
    if n_head == n_kv_head:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    repeat = n_head // n_kv_head
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), **kwargs
    )


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the matmuls on ``x``'s device compute in: autocast's when it is on, else
    ``x``'s own."""
    kind = x.device.type
    try:
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    except TypeError:  # torch < 2.4: a flag per device kind, CPU and CUDA only
        if kind == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        if kind == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    except RuntimeError:  # a device kind autocast does not know (meta: a FLOP count's shapes)
        pass
    return x.dtype


def eager_cpu_training(x: Tensor) -> bool:
    """True where the model's hand-differentiated CPU paths apply to ``x``: an fp32 CPU
    tensor in eager mode (not traced by ``torch.compile``, not under autocast) while autograd
    records. Elsewhere the plain PyTorch operations are used as they are."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and torch.is_grad_enabled()
        and compute_dtype(x) == x.dtype
        and not is_compiling()
    )
