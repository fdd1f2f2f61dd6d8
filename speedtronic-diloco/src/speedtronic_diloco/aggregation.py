"""What protects the global: the checks every delta passes, the rules that combine a round's
deltas, and the policy that says when a round starts.

Per delta (:func:`inspect_delta`, one delta in memory at a time, tensor by tensor): size limit,
signature (with a key), the name it was stored under against its metadata, keys, shapes and
dtypes against the global, finiteness *in the dtype the outer step computes in*, and its L2
norm (whole and per tensor, in float64).

Per round (:func:`screen_round`): deltas more than ``max_staleness`` outer steps behind are
rejected; a delta whose norm exceeds ``max_norm_ratio`` x the median of recent typical delta
norms (one per node per round; while fewer than :data:`MIN_HISTORY` are known: the lower
median of this round's nodes) is rejected or clipped to that threshold; a node's several
deltas in one round are summed into one contribution (as if it had uploaded once) whose norm
is capped at ``k`` typical norms (the median the threshold derives from, for a sum of ``k``)
and at this round's lower median of the contributions' norms; each contribution counts once,
at full weight, so 50 deltas of one node weigh no more than the middle node's part. Staleness
weighting (``inverse``: 1 / (1 + s), renormalised) applies to the mean.

Combination (:func:`aggregate`): the weighted mean as a running float64 sum, one delta file at a
time; or coordinate-wise ``median`` / ``trimmed_mean``, one tensor at a time (memory: one tensor
per contribution). Before the outer step is kept, :func:`candidate_problem` checks the new
global: finite, and the update no larger than ``max_update_ratio`` x the global's norm.

:class:`RoundPolicy` decides when the master's outer thread starts a round: deltas from at least
``min_deltas`` distinct nodes pending with the same, newest base outer step, or
``round_timeout`` seconds since the first pending delta with at least one. It takes a clock, so
it is tested without sleeping.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from speedtronic_diloco.round_mode import round_mode
from speedtronic_diloco.signing import SignatureError, verify_file
from speedtronic_diloco.tensors import (
    TensorDict,
    compute_dtype,
    floating_only,
    is_floating,
    mismatch,
)
from speedtronic_diloco.transports.base import DeltaInfo

__all__ = [
    "HEADER_ALLOWANCE",
    "MIN_HISTORY",
    "AggregationRules",
    "CheckedDelta",
    "Contribution",
    "DeltaRejected",
    "aggregate",
    "candidate_problem",
    "default_max_bytes",
    "global_norm",
    "inspect_delta",
    "lower_median",
    "screen_round",
]

#: Accepted contributions needed before the outlier threshold uses history instead of the
#: round's own median.
MIN_HISTORY = 3
#: Bytes allowed on top of the tensor data by the default size limit (the safetensors header).
HEADER_ALLOWANCE = 1 << 20


@dataclass(frozen=True)
class AggregationRules:
    """The master's round settings (the ``distributed`` keys of the same names). A run's come
    from :meth:`from_config`; the field defaults are the bare rules in-process callers start
    from (async rounds, no outer warm-up, momentum on every round), not the config's defaults."""

    min_deltas: int | None = None
    round_timeout: float = 120.0
    max_delta_bytes: int | None = None
    max_norm_ratio: float = 4.0
    outlier_policy: str = "reject"
    aggregation: str = "mean"
    trimmed_fraction: float = 0.1
    max_staleness: int = 16
    staleness_weighting: str = "none"
    max_update_ratio: float = 10.0
    keep_history: int = 5
    rounds: str = "async"
    momentum_min_nodes: int = 1
    momentum_staleness: str = "none"
    outer_warmup: int = 0
    lease_ttl: float | None = None  # a node silent this long counts as gone (with round_timeout)
    signing_key: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config: Any, signing_key: bytes | None = None) -> AggregationRules:
        return cls(
            min_deltas=config.min_deltas if config.min_deltas is not None else config.num_nodes,
            round_timeout=config.round_timeout,
            max_delta_bytes=config.max_delta_bytes,
            max_norm_ratio=config.max_norm_ratio,
            outlier_policy=config.outlier_policy,
            aggregation=config.aggregation,
            trimmed_fraction=config.trimmed_fraction,
            max_staleness=config.max_staleness,
            staleness_weighting=config.staleness_weighting,
            max_update_ratio=config.max_update_ratio,
            keep_history=config.keep_history,
            rounds=config.rounds,
            momentum_min_nodes=config.momentum_min_nodes,
            momentum_staleness=config.momentum_staleness,
            outer_warmup=config.outer_warmup,
            lease_ttl=config.lease_ttl,
            signing_key=signing_key,
        )


class DeltaRejected(Exception):
    """A delta failed a check: ``reason`` is a short code (``too_large``, ``unsigned``,
    ``bad_signature``, ``unreadable``, ``name_mismatch``, ``keys``, ``shape``, ``dtype``,
    ``non_finite``, ``stale``, ``late``, ``norm_outlier``), ``norm`` its L2 norm when known."""

    def __init__(self, reason: str, message: str, norm: float | None = None) -> None:
        self.reason = reason
        self.norm = norm
        super().__init__(message)


@dataclass(frozen=True)
class CheckedDelta:
    """A delta that passed :func:`inspect_delta`, waiting on local disk for its round."""

    info: DeltaInfo
    path: Path
    base_outer_step: int | None
    norm: float
    tensor_norms: Mapping[str, float]
    final: bool = False
    signature: str | None = None

    @property
    def node_id(self) -> str:
        return self.info.node_id

    def staleness(self, outer_step: int) -> int:
        """Outer steps between the global this delta was computed from and ``outer_step``
        (0 when its base is unknown or ahead)."""
        if self.base_outer_step is None:
            return 0
        return max(0, outer_step - self.base_outer_step)


@dataclass
class Contribution:
    """One node's part of a round: the sum of its deltas (``delta_scales`` < 1 where a delta
    was clipped), counted once; ``scale`` < 1 when the sum was capped at the threshold."""

    node_id: str
    deltas: list[CheckedDelta]
    norm: float  # of the sum, before ``scale``
    staleness: int
    delta_scales: list[float] = field(default_factory=list)
    weight: float = 1.0
    scale: float = 1.0
    typical: float = 0.0  # the lower median of its deltas' norms (what the history records)

    def __post_init__(self) -> None:
        if not self.delta_scales:
            self.delta_scales = [1.0] * len(self.deltas)

    @property
    def keys(self) -> tuple[tuple[str, int], ...]:
        return tuple(delta.info.key for delta in self.deltas)

    def factors(self) -> list[float]:
        """The multiplier of each delta in this contribution."""
        return [self.scale * s for s in self.delta_scales]


def default_max_bytes(reference: Mapping[str, torch.Tensor]) -> int:
    """The default ``max_delta_bytes``: 4x the floating tensors of the global, plus a header
    allowance (a float64 delta of a float32 model is 2x)."""
    data = sum(t.numel() * t.element_size() for t in floating_only(reference).values())
    return 4 * data + HEADER_ALLOWANCE


def lower_median(values: Sequence[float]) -> float:
    """The median, taking the lower middle value for an even count: of one honest and one
    huge norm it picks the honest one."""
    if not values:
        raise ValueError("median of nothing")
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _shown(text: Any, limit: int = 100) -> str:
    """``text`` (a name or value read from a delta file) short enough to quote in a reason:
    whoever wrote the file chose its length."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float64)


@dataclass(frozen=True)
class _Shaped:
    """A tensor's shape as a safetensors header gives it, for :func:`tensors.mismatch`."""

    shape: tuple[int, ...]


def inspect_delta(
    path: Path,
    info: DeltaInfo,
    reference: Mapping[str, torch.Tensor],
    *,
    max_bytes: int | None = None,
    key: bytes | None = None,
) -> CheckedDelta:
    """Check the delta file at ``path`` (downloaded for ``info``) against the global
    ``reference``; DeltaRejected names the first rule it breaks."""
    limit = max_bytes if max_bytes is not None else default_max_bytes(reference)
    size = path.stat().st_size
    if size > limit:
        raise DeltaRejected("too_large", f"{size} bytes > max_delta_bytes {limit}")
    signature = None
    if key is not None:
        try:
            verify_file(path, key)
        except SignatureError as exc:
            raise DeltaRejected(exc.reason, str(exc)) from None
    expected = floating_only(reference)
    norms: dict[str, float] = {}
    total = 0.0
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            # Shapes from the header first: nothing is read for a delta of another model.
            names = handle.keys()  # a safetensors handle is not iterable itself
            shapes = {name: _Shaped(tuple(handle.get_slice(name).get_shape())) for name in names}
            problem = mismatch(shapes, expected)
            if problem is not None and not problem.name:
                raise DeltaRejected(
                    "keys",
                    f"delta keys differ (missing {list(problem.missing)}, extra "
                    f"{[_shown(n) for n in problem.extra]})",
                )
            if problem is not None:
                raise DeltaRejected(
                    "shape", f"{problem.name}: shape {problem.shape} != {problem.expected}"
                )
            for name in sorted(shapes):
                tensor = handle.get_tensor(name)
                target = expected[name]
                if not is_floating(tensor) or tensor.is_complex() != target.is_complex():
                    raise DeltaRejected("dtype", f"{name}: dtype {tensor.dtype} for {target.dtype}")
                # Finite where it is used: the outer step computes in the global's dtype.
                used = tensor.to(compute_dtype(target.dtype))
                if not bool(torch.isfinite(used).all()):
                    raise DeltaRejected(
                        "non_finite",
                        f"{name}: non-finite values in {compute_dtype(target.dtype)} "
                        f"(the delta is {tensor.dtype})",
                    )
                norm = float(torch.linalg.vector_norm(tensor.to(_wide(tensor.dtype))))
                norms[name] = norm
                total += norm * norm
                del tensor, used
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise DeltaRejected("unreadable", f"not a readable safetensors file ({exc})") from None
    if key is not None:
        signature = metadata.get("signature")
    node, step = metadata.get("node_id"), metadata.get("local_step")
    if (node is not None and node != info.node_id) or (
        step is not None and str(step) != str(info.local_step)
    ):
        raise DeltaRejected(
            "name_mismatch",
            f"stored as {info.node_id}@{info.local_step} but its metadata says "
            f"{_shown(node)}@{_shown(step)}",
        )
    if key is not None and (node is None or step is None):
        raise DeltaRejected("name_mismatch", "signed delta without node_id/local_step metadata")
    base = metadata.get("base_outer_step")
    try:
        base_step = int(base) if base is not None and int(base) >= 0 else None
    except ValueError:
        raise DeltaRejected("unreadable", f"bad base_outer_step {_shown(repr(base))}") from None
    norm = math.sqrt(total)
    if not math.isfinite(norm):
        raise DeltaRejected("non_finite", "its norm overflows float64", norm)
    return CheckedDelta(
        info=info,
        path=path,
        base_outer_step=base_step,
        norm=norm,
        tensor_norms=norms,
        final=metadata.get("final") == "1",
        signature=signature,
    )


def _sum_norm(deltas: Sequence[CheckedDelta], scales: Sequence[float]) -> float:
    """L2 norm of ``sum(scale * delta)``, one tensor at a time."""
    if len(deltas) == 1:
        return deltas[0].norm * scales[0]
    total = 0.0
    for name in deltas[0].tensor_norms:
        acc: torch.Tensor | None = None
        for delta, scale in zip(deltas, scales):
            with safe_open(str(delta.path), framework="pt", device="cpu") as handle:
                tensor = handle.get_tensor(name)
            wide = tensor.to(_wide(tensor.dtype)) * scale
            acc = wide if acc is None else acc + wide
        assert acc is not None
        total += float(torch.linalg.vector_norm(acc)) ** 2
    return math.sqrt(total)


def screen_round(
    deltas: Iterable[CheckedDelta],
    outer_step: int,
    history: Sequence[float],
    rules: AggregationRules,
) -> tuple[list[Contribution], list[tuple[CheckedDelta, DeltaRejected]], float | None]:
    """Apply the staleness, norm and one-vote-per-node rules to one round's deltas.

    The threshold is ``max_norm_ratio`` x the median of ``history`` (one typical delta norm
    per node per round) or, with fewer than :data:`MIN_HISTORY` entries, of this round's
    nodes' typical norms (lower median). A delta above it is rejected (``clip``: scaled to it).
    A node's remaining deltas are summed into one contribution, as if it had uploaded once
    (a node whose uploads were skipped sends that sum itself). A single delta's norm is capped
    at the threshold; a sum of ``k`` deltas at the smaller of ``k`` x the median above (each
    counts as at most a typical delta) and this round's lower median of the contributions'
    norms: however many deltas a node sends, its part is no larger than the middle node's,
    while a round in which every node sent several (the master's rounds lagging the nodes' inner
    loops) or a node alone keeps its whole progress. With ``outlier_policy: off`` nothing is
    rejected, clipped or capped.

    Returns ``(contributions, rejected, threshold)``."""
    rejected: list[tuple[CheckedDelta, DeltaRejected]] = []
    by_node: dict[str, list[CheckedDelta]] = {}
    refuses_late = round_mode(rules.rounds).refuses_late
    for delta in deltas:
        staleness = delta.staleness(outer_step)
        if refuses_late and staleness > 0:
            # Its round closed without it (round_timeout): the node installs the newest
            # global and is back in the next round; applying it now would apply a stale step.
            why = (
                f"computed from outer step {delta.base_outer_step}, whose round closed without "
                "it (rounds: sync)"
            )
            rejected.append((delta, DeltaRejected("late", why, delta.norm)))
            continue
        if staleness > rules.max_staleness:
            rejected.append(
                (
                    delta,
                    DeltaRejected(
                        "stale",
                        f"computed from outer step {delta.base_outer_step}, {staleness} behind "
                        f"(max_staleness {rules.max_staleness})",
                        delta.norm,
                    ),
                )
            )
            continue
        by_node.setdefault(delta.node_id, []).append(delta)
    groups = {
        node: sorted(group, key=lambda d: d.info.local_step)
        for node, group in sorted(by_node.items())
    }
    threshold: float | None = None
    reference = 0.0
    if groups and rules.outlier_policy != "off":
        typical = lower_median([lower_median([d.norm for d in g]) for g in groups.values()])
        reference = lower_median(history) if len(history) >= MIN_HISTORY else typical
        threshold = rules.max_norm_ratio * reference
    contributions = []
    for node, group in groups.items():
        kept: list[CheckedDelta] = []
        scales: list[float] = []
        for delta in group:
            if threshold is None or delta.norm <= threshold:
                kept.append(delta)
                scales.append(1.0)
            elif rules.outlier_policy == "clip":
                kept.append(delta)
                scales.append(threshold / delta.norm)
            else:
                why = (
                    f"norm {delta.norm:.4g} > max_norm_ratio {rules.max_norm_ratio:g} x "
                    f"median {threshold / rules.max_norm_ratio:.4g}"
                )
                rejected.append((delta, DeltaRejected("norm_outlier", why, delta.norm)))
        if not kept:
            continue
        contribution = Contribution(
            node_id=node,
            deltas=kept,
            norm=_sum_norm(kept, scales),
            staleness=max(d.staleness(outer_step) for d in kept),
            delta_scales=scales,
            typical=lower_median([d.norm * s for d, s in zip(kept, scales)]),
        )
        if rules.staleness_weighting == "inverse":
            contribution.weight = 1.0 / (1.0 + contribution.staleness)
        contributions.append(contribution)
    if threshold is not None and contributions:
        _cap_contributions(contributions, threshold, reference)
    return contributions, rejected, threshold


def _cap_contributions(
    contributions: list[Contribution], threshold: float, reference: float
) -> None:
    """Scale each contribution down to its cap (see :func:`screen_round`): one delta at
    ``threshold``; a sum of ``k`` at ``k x reference`` (the typical delta norm the threshold
    derives from) and at the round's middle part, so that
    sending many deltas never buys a node a larger part than the middle node's."""
    middle = lower_median([c.norm for c in contributions])
    for contribution in contributions:
        count = len(contribution.deltas)
        cap = threshold if count == 1 else min(count * reference, middle)
        if contribution.norm > cap:
            contribution.scale = cap / contribution.norm


def aggregate(
    contributions: Sequence[Contribution],
    reference: Mapping[str, torch.Tensor],
    method: str = "mean",
    trimmed_fraction: float = 0.1,
) -> TensorDict:
    """Combine ``contributions`` (scale applied) into one pseudo-gradient over the floating
    keys of ``reference``, in float64 (complex128 for complex tensors)."""
    if not contributions:
        raise ValueError("nothing to aggregate")
    names = sorted(floating_only(reference))
    if method == "mean":
        return _weighted_mean(contributions, reference, names)
    if method not in ("median", "trimmed_mean"):
        raise ValueError(f"unknown aggregation {method!r}")
    out: TensorDict = {}
    for name in names:
        stack = torch.stack([_contribution_tensor(c, name) for c in contributions])
        out[name] = _coordinate_wise(stack, method, trimmed_fraction)
    return out


def _weighted_mean(
    contributions: Sequence[Contribution], reference: Mapping[str, torch.Tensor], names: list[str]
) -> TensorDict:
    total = {
        name: torch.zeros(reference[name].shape, dtype=_wide(reference[name].dtype))
        for name in names
    }
    weights = 0.0
    for contribution in contributions:
        weights += contribution.weight
        for delta, factor in zip(contribution.deltas, contribution.factors()):
            with safe_open(str(delta.path), framework="pt", device="cpu") as handle:
                for name in names:  # one delta file open at a time
                    tensor = handle.get_tensor(name)
                    total[name].add_(
                        tensor.to(total[name].dtype), alpha=contribution.weight * factor
                    )
                    del tensor
    for value in total.values():
        value.div_(weights)
    return total


def _contribution_tensor(contribution: Contribution, name: str) -> torch.Tensor:
    acc: torch.Tensor | None = None
    for delta, factor in zip(contribution.deltas, contribution.factors()):
        with safe_open(str(delta.path), framework="pt", device="cpu") as handle:
            tensor = handle.get_tensor(name)
        wide = tensor.to(_wide(tensor.dtype)) * factor
        acc = wide if acc is None else acc + wide
    assert acc is not None
    return acc


def _coordinate_wise(stack: torch.Tensor, method: str, trimmed_fraction: float) -> torch.Tensor:
    count = stack.shape[0]
    if stack.is_complex():  # no order on complex numbers: real and imaginary parts apart
        real = _coordinate_wise(stack.real.contiguous(), method, trimmed_fraction)
        imag = _coordinate_wise(stack.imag.contiguous(), method, trimmed_fraction)
        return torch.complex(real, imag)
    ordered = torch.sort(stack, dim=0).values
    if method == "trimmed_mean":
        cut = math.floor(count * trimmed_fraction)
        if count - 2 * cut >= 1:
            return ordered[cut : count - cut].mean(dim=0)
    middle = (count - 1) // 2
    if count % 2:
        return ordered[middle].clone()
    return (ordered[middle] + ordered[middle + 1]) / 2


def global_norm(state: Mapping[str, torch.Tensor]) -> float:
    """L2 norm over the floating tensors of ``state``, in float64."""
    total = 0.0
    for tensor in floating_only(state).values():
        total += float(torch.linalg.vector_norm(tensor.to(_wide(tensor.dtype)))) ** 2
    return math.sqrt(total)


def candidate_problem(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    max_update_ratio: float,
) -> str | None:
    """Why the candidate global ``new`` must not be kept (None when it may): non-finite
    weights or momentum, or an update larger than ``max_update_ratio`` x ``||old||``."""
    for name, tensor in floating_only(new).items():
        if not bool(torch.isfinite(tensor).all()):
            return f"the new global has non-finite values in {name}"
    for name, tensor in momentum.items():
        if not bool(torch.isfinite(tensor).all()):
            return f"the outer momentum has non-finite values in {name}"
    change = 0.0
    for name, tensor in floating_only(new).items():
        wide = _wide(tensor.dtype)
        change += float(torch.linalg.vector_norm(tensor.to(wide) - old[name].to(wide))) ** 2
    change = math.sqrt(change)
    size = max(global_norm(old), 1e-12)
    if not math.isfinite(change) or change > max_update_ratio * size:
        return (
            f"the update's norm {change:.4g} exceeds max_update_ratio {max_update_ratio:g} x "
            f"the global's norm {size:.4g}"
        )
    return None
