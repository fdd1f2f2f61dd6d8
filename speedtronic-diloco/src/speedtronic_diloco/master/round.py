"""One outer round, as a pure function: :func:`run_round` takes the master's state, the
round's intaken deltas and the policy, and returns a :class:`RoundResult` holding the state
after the round. No store, no state file, no clock: it reads only the checked delta files on
local disk (the round's data) and calls ``policy.evaluate`` when one is given.

The outer step is exactly ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum,
nesterov=True)`` applied to the averaged pseudo-gradient (:func:`nesterov_step`)::

    buf = g                      (first step)      buf = momentum * buf + g   (later)
    global -= outer_lr * (g + momentum * buf)

The round screens the deltas per fragment (staleness, norm outliers, one vote per node:
:func:`~speedtronic_diloco.aggregation.screen_round`; with ``rounds: sync`` only deltas of the
current global, the others refused as ``late``), averages each fragment's contributions,
steps each fragment once, and checks the candidate global (finite, bounded update, finite
held-out loss): a bad candidate is refused and the result says the loop halts. A round of
fewer than ``momentum_min_nodes`` distinct nodes steps without momentum (the buffer kept as
it was); ``momentum_staleness: inverse`` divides the round's momentum by 1 + the mean
staleness of its contributions (:func:`round_momentum`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from speedtronic_diloco.aggregation import (
    AggregationRules,
    CheckedDelta,
    aggregate,
    candidate_problem,
    screen_round,
)
from speedtronic_diloco.fragments import step_fragments
from speedtronic_diloco.ledger import DeltaLedger
from speedtronic_diloco.master.intake import Fetched, Intaken, Refused, Rejection
from speedtronic_diloco.master.state import KEEP_SIGNATURES, NORM_HISTORY, OuterState
from speedtronic_diloco.tensors import TensorDict, compute_dtype, floating_only
from speedtronic_diloco.transports.base import DeltaInfo

__all__ = [
    "OuterPolicy",
    "RoundResult",
    "guarded",
    "nesterov_step",
    "round_momentum",
    "run_round",
    "warmed",
]

log = logging.getLogger("speedtronic.diloco.outer")


def nesterov_step(
    params: TensorDict,
    grads: TensorDict,
    momentum_buffers: TensorDict,
    lr: float,
    momentum: float,
    *,
    use_momentum: bool = True,
) -> tuple[TensorDict, TensorDict]:
    """One SGD step with Nesterov momentum; returns new ``(params, buffers)`` and leaves the
    inputs untouched (readers may still hold them). Without ``use_momentum`` (a thin round)
    the step is plain SGD and every buffer keeps its value (zeros where there was none, which
    the next step treats exactly like a missing buffer)."""
    new_params = dict(params)
    new_buffers: TensorDict = {}
    for name, grad in grads.items():
        param = params[name]
        work = compute_dtype(param.dtype)
        g = grad.to(work)
        previous = momentum_buffers.get(name)
        if not use_momentum:
            new_params[name] = (param.to(work) - lr * g).to(param.dtype)
            new_buffers[name] = torch.zeros_like(g) if previous is None else previous.to(work)
            continue
        buf = g.clone() if previous is None else previous.to(work) * momentum + g
        update = g + momentum * buf if momentum else g
        new_params[name] = (param.to(work) - lr * update).to(param.dtype)
        new_buffers[name] = buf
    return new_params, new_buffers


@dataclass(frozen=True)
class OuterPolicy:
    """How a round turns deltas into an outer step."""

    outer_lr: float
    outer_momentum: float
    rules: AggregationRules = field(default_factory=AggregationRules)
    #: ``evaluate(candidate global) -> held-out loss`` (None: not evaluated, or it failed).
    evaluate: Callable[[TensorDict], float | None] | None = None


@dataclass(frozen=True)
class RoundResult:
    """What one outer round did."""

    outer_step: int
    deltas_found: int
    deltas_included: int
    included: tuple[tuple[str, int], ...]
    rejected: tuple[tuple[str, int], ...]
    nodes: tuple[str, ...] = ()  # the nodes whose contributions went in
    base_outer_steps: tuple[int | None, ...] = ()  # per included delta
    staleness: tuple[int, ...] = ()  # per included delta
    waited_s: float = 0.0
    reason: str = "forced"  # quorum | timeout | final | forced
    reasons: tuple[str, ...] = ()  # per rejected delta
    halted: bool = False
    eval_loss: float | None = None
    mode: str = "async"  # distributed.rounds
    momentum_applied: bool = True  # False: a thin round, plain SGD (momentum_min_nodes)
    momentum: float | None = None  # the round's outer momentum (momentum_staleness)
    # What the loop records, reports and keeps (not part of the result's value):
    state: OuterState | None = field(default=None, compare=False, repr=False)
    problem: str | None = field(default=None, compare=False, repr=False)
    refusals: tuple[tuple[DeltaInfo, Rejection], ...] = field(default=(), compare=False, repr=False)
    accepted: tuple[DeltaInfo, ...] = field(default=(), compare=False, repr=False)
    checked: tuple[CheckedDelta, ...] = field(default=(), compare=False, repr=False)
    contributions: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    groups: dict[int, list[Any]] = field(default_factory=dict, compare=False, repr=False)
    threshold: float | None = field(default=None, compare=False, repr=False)

    def record(self, ledger: DeltaLedger, contents: Mapping[tuple[str, int], str | None]) -> None:
        """Note this round's deltas in ``ledger``, by content (``contents``: key -> sha256 of
        the downloaded bytes; the listing's etag where there is none)."""
        checked = {d.info.key: d for d in self.checked}
        marks = [(i, True, None) for i in self.accepted]
        marks += [(i, False, why) for i, why in self.refusals]
        for info, accepted, why in marks:
            delta = checked.get(info.key)
            ledger.record(
                info,
                contents.get(info.key) or f"etag:{info.etag}",
                outer_step=self.outer_step,
                accepted=accepted,
                reason=None if why is None else f"{why.reason}: {why}",
                base_outer_step=delta.base_outer_step if delta is not None else None,
                norm=delta.norm if delta is not None else (why.norm if why else None),
            )

    def published_extra(self) -> dict[str, Any]:
        """This round's entry in the published metadata's ``extra``."""
        return {
            "outer_step": self.outer_step,
            "deltas_included": len(self.accepted),
            "round": {
                "nodes": list(self.nodes),
                "base_outer_steps": list(self.base_outer_steps),
                "waited_s": round(self.waited_s, 3),
                "reason": self.reason,
                "mode": self.mode,
                "staleness": list(self.staleness),
                "momentum": self.momentum if self.momentum_applied else 0.0,
            },
            **({"eval_loss": self.eval_loss} if self.eval_loss is not None else {}),
        }


def round_momentum(momentum: float, contributions: Sequence[Any], rule: str) -> float:
    """The outer momentum of a round of ``contributions`` (each with its ``staleness``).

    ``inverse``: ``momentum / (1 + mean staleness)``. A pseudo-gradient s outer steps stale
    already carries s steps of the global's past direction (asynchrony acts like momentum of
    its own), so full Nesterov momentum on top overshoots: 0.9 at staleness 1 oscillated,
    where 0.45 is about what measured best for async rounds. Fresh rounds keep all of it."""
    if rule != "inverse" or not contributions:
        return momentum
    mean = sum(c.staleness for c in contributions) / len(contributions)
    return momentum / (1.0 + mean)


def warmed(lr: float, momentum: float, completed: int, warmup: int) -> tuple[float, float]:
    """The outer ``(lr, momentum)`` of the round after ``completed`` outer steps under
    ``outer_warmup: warmup``: plain averaging (1, 0) first, then linearly to ``(lr,
    momentum)``, reached at round ``warmup + 1``."""
    if warmup <= 0 or completed >= warmup:
        return lr, momentum
    t = max(0, completed) / warmup
    return 1.0 + t * (lr - 1.0), t * momentum


def guarded(
    evaluate: Callable[[TensorDict], float] | None,
) -> Callable[[TensorDict], float | None] | None:
    """``evaluate`` returning None (with a warning) instead of raising: an evaluation problem
    must not stop the outer loop."""
    if evaluate is None:
        return None

    def safely(weights: TensorDict) -> float | None:
        try:
            return float(evaluate(weights))
        except Exception as exc:
            log.warning("evaluating the new global failed (%s: %s)", type(exc).__name__, exc)
            return None

    return safely


def run_round(
    state: OuterState,
    deltas: Sequence[Intaken],
    policy: OuterPolicy,
    *,
    reason: str = "forced",
    waited_s: float = 0.0,
    found: int | None = None,
) -> RoundResult:
    """One outer round over ``deltas`` (the new deltas' intake outcomes, in listing order).

    The result's ``state`` is the state after the round: the next outer step when any delta
    was accepted and the candidate is good, else ``state``'s weights (halted when the
    candidate was refused). ``state`` itself is not changed. ``found`` is how many new deltas
    the listing had (default: ``len(deltas)``)."""
    assert state.global_state is not None
    reference, base, book = state.global_state, state.outer_step, state.fragments
    rules = policy.rules
    refused = [(d.info, d.why) for d in deltas if isinstance(d, Refused)]
    fetched = [d for d in deltas if isinstance(d, Fetched)]
    checked = [d.delta for d in fetched]
    covers = {d.info.key: d.covers for d in fetched}
    groups, late, threshold = _screen(checked, covers, base, state, rules)
    refused.extend((delta.info, Rejection.of(why)) for delta, why in late)
    contributions = [c for group in groups.values() for c in group]
    candidate: tuple[TensorDict, TensorDict] | None = None
    lr, configured = warmed(policy.outer_lr, policy.outer_momentum, base, rules.outer_warmup)
    full, momentum = True, configured
    problem: str | None = None
    eval_loss: float | None = None
    if contributions:
        grads = {
            j: aggregate(
                group,
                book.plan.select(floating_only(reference), [j]),
                rules.aggregation,
                rules.trimmed_fraction,
            )
            for j, group in groups.items()
        }

        # A thin round (few nodes) moves the global by its own pseudo-gradient only: under
        # momentum one node's noisy delta would keep pushing for the rounds after it.
        full = len({c.node_id for c in contributions}) >= rules.momentum_min_nodes
        momentum = round_momentum(configured, contributions, rules.momentum_staleness)

        def step(params: TensorDict, g: TensorDict, m: TensorDict) -> tuple[TensorDict, TensorDict]:
            return nesterov_step(params, g, m, lr, momentum, use_momentum=full)

        params, buffers, _ = step_fragments(
            step, floating_only(reference), grads, state.momentum, [0] * book.plan.count
        )
        del grads
        new_global = {**reference, **params}
        problem = candidate_problem(reference, new_global, buffers, rules.max_update_ratio)
        if problem is None and policy.evaluate is not None:
            eval_loss = policy.evaluate(new_global)
            if eval_loss is not None and not math.isfinite(eval_loss):
                problem = f"the new global's held-out loss is {eval_loss}"
        candidate = (new_global, buffers)
    if problem is not None:  # never kept, never published; these deltas never again
        for contribution in contributions:
            for delta in contribution.deltas:
                why = Rejection("bad_round", problem, contribution.norm)
                refused.append((delta.info, why))
        contributions, candidate, groups = [], None, {}
    # (a final delta of several fragments is in several contributions: counted once)
    accepted = list({d.info.key: d.info for c in contributions for d in c.deltas}.values())
    after = _after(state, candidate, contributions, problem)
    included = [d for c in contributions for d in c.deltas]
    return RoundResult(
        after.outer_step,
        len(deltas) if found is None else found,
        len(accepted),
        tuple(i.key for i in accepted),
        tuple(i.key for i, _ in refused),
        nodes=tuple(c.node_id for c in contributions),
        base_outer_steps=tuple(d.base_outer_step for d in included),
        staleness=tuple(d.staleness(base) for d in included),
        waited_s=waited_s,
        reason=reason,
        reasons=tuple(why.reason for _, why in refused),
        halted=problem is not None,
        eval_loss=eval_loss,
        mode=rules.rounds,
        momentum_applied=full and bool(contributions),
        momentum=momentum,
        state=after,
        problem=problem,
        refusals=tuple(refused),
        accepted=tuple(accepted),
        checked=tuple(checked),
        contributions=tuple(contributions),
        groups=groups,
        threshold=threshold,
    )


def _screen(
    checked: list[CheckedDelta],
    covers: dict[tuple[str, int], tuple[int, ...]],
    base: int,
    state: OuterState,
    rules: AggregationRules,
) -> tuple[dict[int, list[Any]], list[tuple[CheckedDelta, Any]], float | None]:
    """:func:`screen_round` per fragment (each with its own norm history, over each delta's
    tensors of that fragment); a delta rejected in one fragment is rejected in all."""
    book = state.fragments
    groups: dict[int, list[Any]] = {}
    late: list[tuple[CheckedDelta, Any]] = []
    thresholds: list[float] = []
    for j in book.plan.everything():
        mine = [book.view(d, j) for d in checked if j in covers.get(d.info.key, (j,))]
        if not mine:
            continue
        history = book.norm_history(j, state.norm_history)
        kept, rejected, threshold = screen_round(mine, base, history, rules)
        late.extend(rejected)
        if threshold is not None:
            thresholds.append(threshold)
        if kept:
            groups[j] = kept
    refused = {d.info.key for d, _ in late}
    groups = {
        j: [c for c in group if not {d.info.key for d in c.deltas} & refused]
        for j, group in groups.items()
    }
    groups = {j: g for j, g in groups.items() if g}
    unique = {d.info.key: (d, why) for d, why in late}
    return groups, list(unique.values()), max(thresholds) if thresholds else None


def _after(
    state: OuterState,
    candidate: tuple[TensorDict, TensorDict] | None,
    contributions: list[Any],
    problem: str | None,
) -> OuterState:
    """The state after the round (a new object; its fragments are the loop's to update)."""
    norms = [*state.norm_history, *(c.typical for c in contributions)][-NORM_HISTORY:]
    signatures = [
        *state.signatures,
        *(d.signature for c in contributions for d in c.deltas if d.signature),
    ][-KEEP_SIGNATURES:]
    after = replace(state, norm_history=norms, signatures=signatures)
    if candidate is not None:
        after = replace(
            after,
            global_state=candidate[0],
            momentum=candidate[1],
            outer_step=state.outer_step + 1,
        )
    if problem is not None:
        after = replace(after, halted=f"outer step {state.outer_step + 1} refused: {problem}")
    return after
