"""A node's side of streaming fragments: :class:`NodeFragments` keeps, beside the run's
:class:`~speedtronic_diloco.fragments.FragmentPlan`, the fragment versions this node installed
and one generation counter per fragment, and answers what to download, install and send."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from speedtronic_diloco.fragments import FragmentLayout, FragmentPlan, fragment_metadata
from speedtronic_diloco.tensors import TensorDict

__all__ = ["NodeFragments"]

FragmentInfo = tuple[tuple[int, ...], str]  # (versions, layout fingerprint) of a global


class NodeFragments:
    """The fragment versions a node installed (``installed``; None before any: the first
    global installs every fragment) and one generation counter per fragment (an upload of a
    fragment that was reinstalled since must not move that fragment's baseline)."""

    def __init__(self, plan: FragmentPlan) -> None:
        self.plan = plan
        self.installed: list[int] | None = None
        self.generations = [0] * plan.count

    # ----------------------------------------------------------------- sending
    def delta_metadata(self, fragments: Sequence[int]) -> dict[str, str]:
        """The metadata entries of a delta covering ``fragments`` (a plan of one: none, its
        delta covers the whole model)."""
        layout = self.plan.layout
        return {} if layout is None else fragment_metadata(fragments, layout)

    def pending_fields(self, fragments: Sequence[int]) -> dict[str, list[int]]:
        """What a checkpointed outstanding upload records about its fragments."""
        return {} if self.plan.whole else {"fragments": list(fragments)}

    def advanced(self, baseline: TensorDict, target: TensorDict, job: Any) -> TensorDict:
        """The baseline after the upload ``job`` landed: the target's tensors of each fragment
        it covers that was not reinstalled since (a plan of one: the whole target, or the
        baseline as it is)."""
        moved = [j for j in job.fragments if self.generations[j] == job.fragment_generations[j]]
        layout = self.plan.layout
        if layout is None:
            return target if moved else baseline
        return {**baseline, **{k: target[k] for k in layout.keys(moved)}}

    # ----------------------------------------------------------------- receiving
    def describe(self, fragments: Sequence[int]) -> str:
        """How a log line names an install of ``fragments`` of a global."""
        return "global weights of" if self.plan.whole else f"fragments {list(fragments)} of global"

    def own_progress(self, wanted: bool) -> bool:
        """Whether a node keeps its own unaggregated deltas across installs
        (``keep_own_progress``): defined for whole-model installs, a plan of one."""
        return wanted and self.plan.whole

    def exact_target(self) -> bool:
        """True when a landed delta's target is the node's weights at its step (one fragment);
        with several, the other fragments moved on since."""
        return self.plan.whole

    def file_layout(self, local: Mapping[str, torch.Tensor], count: int) -> FragmentLayout:
        """The layout a global published as ``count`` fragment files is read with: this
        run's (a plan of one: the model's own cut into ``count``; FragmentError if it cannot
        be)."""
        layout = self.plan.layout
        return layout if layout is not None else FragmentLayout.build(local, count)

    def files_wanted(
        self, versions: Sequence[int], layout: FragmentLayout, complete: bool
    ) -> tuple[int, ...]:
        """The fragment files of a global to download: every one ``complete`` (and for a plan
        of one, which installs the whole global), else those whose version advanced."""
        if complete or self.plan.whole:
            return tuple(range(layout.count))
        return self.to_install((tuple(versions), layout.fingerprint))

    def to_install(
        self, info: FragmentInfo | None, allowed: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        """The fragments to install from a global with fragment ``info`` (versions, layout),
        limited to ``allowed`` (None: any). A global without usable info, or the first one,
        installs every fragment."""
        plan = self.plan
        everything = plan.everything()
        if info is None or len(info[0]) != plan.count or info[1] != plan.fingerprint:
            return everything
        if self.installed is None:
            return everything
        wanted = set(everything if allowed is None else allowed)
        return tuple(j for j in everything if j in wanted and info[0][j] > self.installed[j])

    def pending(self, info: FragmentInfo | None) -> tuple[int, ...]:
        """Fragments of that global not installed yet (empty: fully absorbed)."""
        if info is None or self.installed is None or len(info[0]) != self.plan.count:
            return ()
        return tuple(j for j in self.plan.everything() if info[0][j] > self.installed[j])

    def mark(self, fragments: Sequence[int], info: FragmentInfo | None) -> None:
        """``fragments`` were installed from a global with fragment ``info``."""
        steps = info[0] if info is not None and len(info[0]) == self.plan.count else None
        if self.installed is None:
            self.installed = list(steps) if steps is not None else [0] * self.plan.count
        for j in fragments:
            self.generations[j] += 1
            if steps is not None:
                self.installed[j] = max(self.installed[j], steps[j])

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any] | None:
        """The node's installed versions for its checkpoint (None for a plan of one)."""
        if self.plan.whole:
            return None
        return {
            "count": self.plan.count,
            "layout": self.plan.fingerprint,
            "installed": None if self.installed is None else list(self.installed),
        }

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state_dict` when it was saved with this layout (else forget: the
        next global installs every fragment)."""
        if self.plan.whole:
            return
        plan = self.plan
        if not state or state.get("count") != plan.count or state.get("layout") != plan.fingerprint:
            self.installed = None
            return
        installed = state.get("installed")
        self.installed = None if installed is None else [int(s) for s in installed]
        self.generations = [g + 1 for g in self.generations]
