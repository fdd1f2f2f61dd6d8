"""Streaming fragments (``distributed.fragments: K``), as in Streaming DiLoCo.

**Layout.** The floating tensors of the model, in ``state_dict`` order, are grouped into layers
(consecutive tensors sharing a prefix up to the first numeric component, ``blocks.3.``, else
their module path) and the layers are cut into K contiguous fragments balanced by bytes: the
cut minimises the largest fragment (:func:`balanced_partition`). When whole layers cannot be
balanced (fewer layers than K, or a largest fragment more than :data:`LAYER_SLACK` times the
best cut between single tensors, as in a small model with a few uneven layers), tensors are
the units. The layout depends only on the names, shapes and dtypes of the model, so every
node computes the same one; its :attr:`FragmentLayout.fingerprint` travels with every fragment
delta and every global so a node with another layout is noticed.

**Schedule.** Fragment ``j`` syncs after the optimizer steps ``s`` with
``(s - j * H // K) % H == 0`` (H = ``inner_steps``; :class:`FragmentSchedule`): each fragment
every H steps, the K of them staggered by H / K steps, so one fragment (1/K of the model) is in
flight at a time. K = 1 is the classic schedule (every ``s % H == 0``). The final step of a run
uploads every fragment's partial progress in one delta.

**Deltas.** A fragment delta holds that fragment's tensors only, with ``fragments`` (the indices
it covers, comma separated), ``fragment_count`` and ``fragment_layout`` in its metadata. A delta
without them covers every fragment (a K = 1 node's, or an older node's).

**The master** keeps one outer step counter per fragment (``fragment_steps``) and, since the
Nesterov momentum buffers are per tensor and fragments are disjoint, a fragment's momentum is
the buffers of its tensors: fragment ``j``'s outer step touches nothing else. A round that has
deltas for several fragments steps each of them once. Each fragment also has a *version*: the
(global) outer step of its last update, monotone across master restarts and adoptions. Every
publication carries ``{"count", "layout", "steps", "versions"}`` in the metadata's ``extra``
under ``fragments``; on a store with fragment files each fragment's global is a file of its
own, and a round publishes only the files of the fragments it stepped, atomically with the
metadata listing every fragment's file (:mod:`speedtronic_diloco.fragment_files`); elsewhere
the whole global goes in one file.

**A node** remembers the fragment versions it installed
(:class:`~speedtronic_diloco.node.fragments.NodeFragments`) and downloads
and installs, from a newer global, only the fragments whose version advanced; with
``install_at: boundary`` fragment ``j`` only at its own sync step, right after its upload.
Other fragments' weights and baselines, hence their local progress, are left alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from speedtronic.errors import SpeedtronicError
from speedtronic_diloco.tensors import TensorDict, is_floating

__all__ = [
    "FRAGMENTS_META",
    "FRAGMENT_COUNT_META",
    "FRAGMENT_LAYOUT_META",
    "LAYER_SLACK",
    "FragmentError",
    "FragmentLayout",
    "FragmentPlan",
    "FragmentSchedule",
    "balanced_partition",
    "delta_fragments",
    "fragment_metadata",
    "fragment_view",
    "global_fragment_info",
    "layer_of",
    "step_fragments",
]

FRAGMENTS_META = "fragments"
FRAGMENT_COUNT_META = "fragment_count"
FRAGMENT_LAYOUT_META = "fragment_layout"
#: Fragments keep whole layers unless that makes the largest one more than this factor larger
#: than the best cut between tensors (a small model with few, uneven layers).
LAYER_SLACK = 1.25


class FragmentError(SpeedtronicError, ValueError):
    """A fragment layout cannot be built, or a delta's fragment metadata does not fit this
    run's layout."""


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to the first all-digit component
    (``blocks.3.attn.q.weight`` -> ``blocks.3``), else its module path (``tok_emb``)."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return ".".join(parts[:-1]) or name


def balanced_partition(sizes: Sequence[int], count: int) -> list[int]:
    """Cut ``sizes`` (in order) into ``count`` non-empty contiguous parts whose largest sum is
    as small as possible; returns the index where each part starts. Deterministic."""
    n = len(sizes)
    if not 1 <= count <= n:
        raise FragmentError(f"cannot cut {n} units into {count} fragments")

    def parts_needed(capacity: int) -> int:
        parts, current = 1, 0
        for size in sizes:
            if current and current + size > capacity:
                parts, current = parts + 1, 0
            current += size
        return parts

    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        if parts_needed(middle) <= count:
            high = middle
        else:
            low = middle + 1
    starts, current = [0], 0
    for index, size in enumerate(sizes):
        remaining_units = n - index
        still_needed = count - len(starts)  # parts to start after the current one
        if index > starts[-1] and (current + size > low or remaining_units == still_needed):
            starts.append(index)
            current = 0
        current += size
    return starts


def _cut(
    units: list[list[str]], nbytes: Mapping[str, int], count: int
) -> tuple[tuple[str, ...], ...]:
    sizes = [sum(nbytes[n] for n in unit) for unit in units]
    starts = [*balanced_partition(sizes, count), len(units)]
    return tuple(
        tuple(n for unit in units[a:b] for n in unit) for a, b in itertools.pairwise(starts)
    )


def _sizes(fragments: tuple[tuple[str, ...], ...], nbytes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(sum(nbytes[n] for n in fragment) for fragment in fragments)


@dataclass(frozen=True)
class FragmentLayout:
    """The K fragments: tuples of tensor names, in model order (see the module docstring)."""

    fragments: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...] = field(default=(), compare=False)

    @classmethod
    def build(cls, state: Mapping[str, torch.Tensor], count: int) -> FragmentLayout:
        """The layout of the floating tensors of ``state`` in ``count`` fragments."""
        names = [name for name, tensor in state.items() if is_floating(tensor)]
        nbytes = {n: state[n].numel() * state[n].element_size() for n in names}
        if count == 1:
            return cls((tuple(names),), (sum(nbytes.values()),))
        if count > len(names):
            raise FragmentError(
                f"distributed.fragments is {count} but the model has only {len(names)} "
                "floating tensors",
            )
        layers: list[list[str]] = []
        for name in names:
            if layers and layer_of(layers[-1][-1]) == layer_of(name):
                layers[-1].append(name)
            else:
                layers.append([name])
        by_tensor = _cut([[name] for name in names], nbytes, count)
        if len(layers) >= count:
            by_layer = _cut(layers, nbytes, count)
            if max(_sizes(by_layer, nbytes)) <= LAYER_SLACK * max(_sizes(by_tensor, nbytes)):
                return cls(by_layer, _sizes(by_layer, nbytes))
        return cls(by_tensor, _sizes(by_tensor, nbytes))

    @property
    def count(self) -> int:
        return len(self.fragments)

    @cached_property
    def index(self) -> dict[str, int]:
        """Tensor name -> fragment."""
        return {name: j for j, names in enumerate(self.fragments) for name in names}

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of the fragments' names (equal on every node with this layout)."""
        raw = json.dumps(self.fragments, separators=(",", ":")).encode("utf-8")
        return hashlib.sha256(raw).hexdigest()[:16]

    def keys(self, fragments: Iterable[int]) -> list[str]:
        """The tensor names of ``fragments``, in model order."""
        wanted = set(fragments)
        return [n for j, names in enumerate(self.fragments) if j in wanted for n in names]

    def select(self, state: Mapping[str, torch.Tensor], fragments: Iterable[int]) -> TensorDict:
        """The entries of ``state`` that belong to ``fragments``."""
        return {n: state[n] for n in self.keys(fragments) if n in state}

    def covering(self, names: Iterable[str]) -> tuple[int, ...]:
        """The fragments any of ``names`` belongs to."""
        return tuple(sorted({self.index[n] for n in names if n in self.index}))


@dataclass(frozen=True)
class FragmentSchedule:
    """Which fragment syncs after which optimizer step (see the module docstring)."""

    inner_steps: int
    count: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.count <= self.inner_steps:
            raise FragmentError(
                f"distributed.fragments ({self.count}) must be between 1 and inner_steps "
                f"({self.inner_steps})"
            )

    def offset(self, fragment: int) -> int:
        """The step offset of ``fragment``: ``fragment * H // K``."""
        return fragment * self.inner_steps // self.count

    def due(self, step: int) -> tuple[int, ...]:
        """The fragments that sync after optimizer step ``step`` (at most one)."""
        return tuple(
            j for j in range(self.count) if (step - self.offset(j)) % self.inner_steps == 0
        )

    def next_sync(self, fragment: int, after: int) -> int:
        """The first step above ``after`` at which ``fragment`` syncs."""
        offset = self.offset(fragment)
        k = math.floor((after - offset) / self.inner_steps) + 1
        step = offset + k * self.inner_steps
        return step if step > 0 else step + self.inner_steps


def fragment_metadata(fragments: Sequence[int], layout: FragmentLayout) -> dict[str, str]:
    """The metadata entries of a delta that covers ``fragments`` (none for K = 1)."""
    if layout.count == 1:
        return {}
    return {
        FRAGMENTS_META: ",".join(str(j) for j in sorted(fragments)),
        FRAGMENT_COUNT_META: str(layout.count),
        FRAGMENT_LAYOUT_META: layout.fingerprint,
    }


def delta_fragments(metadata: Mapping[str, str], layout: FragmentLayout) -> tuple[int, ...]:
    """The fragments a delta covers, from its metadata (none named: all of them).
    FragmentError when it was made for another count or layout, or names no valid one."""
    named = metadata.get(FRAGMENTS_META)
    if named is None:
        return tuple(range(layout.count))
    if metadata.get(FRAGMENT_COUNT_META) != str(layout.count):
        raise FragmentError(
            f"made for {metadata.get(FRAGMENT_COUNT_META)!r} fragments, this run has {layout.count}"
        )
    if metadata.get(FRAGMENT_LAYOUT_META) != layout.fingerprint:
        raise FragmentError(
            f"fragment layout {metadata.get(FRAGMENT_LAYOUT_META)!r} differs from the "
            f"master's {layout.fingerprint!r} (another model?)"
        )
    try:
        found = sorted({int(part) for part in named.split(",")})
    except ValueError:
        raise FragmentError(f"bad fragments entry {named!r}") from None
    if not found or found[0] < 0 or found[-1] >= layout.count:
        raise FragmentError(f"bad fragments entry {named!r}")
    return tuple(found)


def fragment_view(delta: Any, names: Iterable[str]) -> Any:
    """A checked delta (any dataclass with ``norm`` and ``tensor_norms``) restricted to
    ``names``: its norm becomes the norm over those tensors, so the outlier rule compares
    like with like within one fragment."""
    wanted = [n for n in names if n in delta.tensor_norms]
    norms = {n: delta.tensor_norms[n] for n in wanted}
    return dataclasses.replace(
        delta, norm=math.sqrt(sum(v * v for v in norms.values())), tensor_norms=norms
    )


def global_fragment_info(extra: Mapping[str, Any] | None) -> tuple[tuple[int, ...], str] | None:
    """``(versions, layout fingerprint)`` from a global's metadata ``extra``, or None. A
    fragment's version is the outer step of its last update."""
    info = (extra or {}).get(FRAGMENTS_META)
    if not isinstance(info, Mapping):
        return None
    steps, layout = info.get("versions"), info.get("layout")
    if not isinstance(steps, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in steps
    ):
        return None
    return tuple(steps), str(layout)


def step_fragments(
    step: Callable[[TensorDict, TensorDict, TensorDict], tuple[TensorDict, TensorDict]],
    params: Mapping[str, torch.Tensor],
    grads: Mapping[int, TensorDict],
    momentum: Mapping[str, torch.Tensor],
    fragment_steps: Sequence[int],
) -> tuple[TensorDict, TensorDict, list[int]]:
    """One outer step for each fragment in ``grads`` (fragment -> its averaged
    pseudo-gradient): ``step(params, grads, momentum) -> (params, buffers)`` is the outer
    optimizer (Nesterov SGD). Returns the new weights, the momentum (other fragments' buffers
    untouched) and the fragment steps (those stepped + 1)."""
    new_params = dict(params)
    new_momentum = dict(momentum)
    steps = list(fragment_steps)
    for j in sorted(grads):
        stepped, buffers = step(dict(params), grads[j], dict(momentum))
        for name in grads[j]:
            new_params[name] = stepped[name]
            new_momentum[name] = buffers[name]
        steps[j] += 1
    return new_params, new_momentum, steps


class FragmentPlan:
    """What both sides of a run agree on about its fragments: the layout (None for K = 1, or a
    master built without one: a plan of one fragment over every floating tensor) and the
    schedule (nodes only). Holds no state that changes during a run; each side keeps its own
    next to it (:class:`~speedtronic_diloco.node.fragments.NodeFragments`,
    :class:`~speedtronic_diloco.master.fragments.MasterFragments`), so the callers never ask
    whether there are fragments."""

    def __init__(
        self, layout: FragmentLayout | None, schedule: FragmentSchedule | None = None
    ) -> None:
        self.layout = layout if layout is not None and layout.count > 1 else None
        self.schedule = schedule

    @property
    def count(self) -> int:
        return 1 if self.layout is None else self.layout.count

    @property
    def fingerprint(self) -> str:
        return "" if self.layout is None else self.layout.fingerprint

    @property
    def whole(self) -> bool:
        """True for a plan of one fragment (the whole model syncs at once)."""
        return self.layout is None

    def everything(self) -> tuple[int, ...]:
        return tuple(range(self.count))

    def due(self, step: int) -> tuple[int, ...]:
        """The fragments that sync after optimizer step ``step`` (one fragment: ``(0,)``
        every ``inner_steps``)."""
        assert self.schedule is not None
        return self.schedule.due(step)

    def select(self, state: Mapping[str, torch.Tensor], fragments: Iterable[int]) -> TensorDict:
        """The entries of ``state`` in ``fragments`` (a plan of one: all of ``state``)."""
        if self.layout is None:
            return dict(state)
        return self.layout.select(state, fragments)

    def names(self, fragments: Iterable[int]) -> set[str] | None:
        """The tensor names of ``fragments``; None for a plan of one (every name)."""
        return None if self.layout is None else set(self.layout.keys(fragments))

    def fragment_field(self, fragments: Iterable[int]) -> dict[str, str]:
        """The ``fragments`` field of an event about ``fragments`` (a plan of one: none)."""
        if self.layout is None:
            return {}
        return {FRAGMENTS_META: ",".join(str(j) for j in fragments)}
