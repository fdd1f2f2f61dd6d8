"""The master's side of streaming fragments: :class:`MasterFragments` keeps, beside the run's
:class:`~speedtronic_diloco.fragments.FragmentPlan`, the per-fragment outer step counters,
versions and published files (saved in the master's state) and each fragment's recent
contribution norms (not saved: the outlier rule's history per fragment)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from speedtronic_diloco.fragments import (
    FRAGMENTS_META,
    FragmentLayout,
    FragmentPlan,
    delta_fragments,
    fragment_view,
)

__all__ = ["MasterFragments"]

PUBLISHED_KEEP = 16  # fragment info of the last this many published globals


class MasterFragments:
    """Per fragment: its outer step count (``steps``), version (the outer step of its last
    update) and published file (``files``: None where a fragment has no file in this lineage
    yet). A plan of one keeps nothing here: the whole global is one file and the outlier
    rule's history is the master state's own."""

    def __init__(
        self,
        plan: FragmentPlan,
        *,
        steps: Sequence[int] = (),
        versions: Sequence[int] = (),
        files: Sequence[Any] = (),
    ) -> None:
        self.plan = plan
        self.steps = list(steps)
        self.versions = list(versions)
        self.files: list[Any] = list(files)
        self.norms: dict[int, deque[float]] = {}
        self._published: dict[int, dict[str, Any]] = {}  # outer step -> its fragment info

    @classmethod
    def unfragmented(cls, **counters: Any) -> MasterFragments:
        """A master's book of one fragment (no layout), with saved ``counters``."""
        return cls(FragmentPlan(None), **counters)

    def start(self, outer_step: int, norm_history: int) -> None:
        """Fit the saved counters to this layout (another count: steps restart at zero,
        every version at ``outer_step``) and start the per-fragment norm histories."""
        plan = self.plan
        if plan.whole:
            return
        if len(self.steps) != plan.count:
            self.steps = [0] * plan.count
        if len(self.versions) != plan.count:
            self.versions = [outer_step] * plan.count
        if len(self.files) != plan.count:
            self.files = [None] * plan.count
        self.norms = {j: deque(maxlen=norm_history) for j in plan.everything()}
        self._published[outer_step] = self.info()

    def restart_versions(self, outer_step: int) -> None:
        """Every fragment's version becomes ``outer_step`` and no file is kept: every node
        installs all of it and every fragment file is published again."""
        self.versions = [outer_step] * len(self.versions)
        self.files = [None] * len(self.versions)

    def adopt_published(
        self, check: Callable[[FragmentLayout], Sequence[int]], files: Sequence[Any]
    ) -> None:
        """Continue from a published global's fragment ``files`` when ``check(layout)`` (its
        versions; raises when they are not this layout's) accepts them; a plan of one
        publishes no fragment files."""
        if self.plan.layout is None:
            return
        self.versions = list(check(self.plan.layout))
        self.files = list(files)

    def covers(self, metadata: Mapping[str, str]) -> tuple[int, ...]:
        """The fragments a delta covers (FragmentError when it does not fit the layout)."""
        if self.plan.layout is None:
            return (0,)
        return delta_fragments(metadata, self.plan.layout)

    def view(self, delta: Any, j: int) -> Any:
        """A checked delta restricted to fragment ``j`` (a plan of one: the delta itself)."""
        if self.plan.layout is None:
            return delta
        return fragment_view(delta, self.plan.layout.fragments[j])

    def norm_history(self, j: int, whole: Sequence[float]) -> list[float]:
        """The outlier rule's history for fragment ``j`` (a plan of one: ``whole``, the
        persisted one)."""
        return list(whole) if self.plan.whole else list(self.norms.get(j, ()))

    def after_round(self, groups: Mapping[int, Sequence[Any]], outer_step: int) -> None:
        """A round stepped ``groups`` (fragment -> contributions) into ``outer_step``: count
        the fragments' steps, version them, remember their norms."""
        if self.plan.whole:
            return
        for j, group in groups.items():
            self.steps[j] += 1
            self.versions[j] = outer_step
            for contribution in group:
                typical = getattr(contribution, "typical", 0.0)
                self.norms[j].append(typical or contribution.norm * contribution.scale)
        self._published[outer_step] = self.info()
        for old in sorted(self._published)[:-PUBLISHED_KEEP]:
            del self._published[old]

    def info(self) -> dict[str, Any]:
        return {
            "count": self.plan.count,
            "layout": self.plan.fingerprint,
            "steps": list(self.steps),
            "versions": list(self.versions),
        }

    def extra(self) -> dict[str, Any]:
        """The ``fragments`` entry of a published global's ``extra`` (a plan of one: none)."""
        return {} if self.plan.whole else {FRAGMENTS_META: self.info()}

    def info_at(self, outer_step: int) -> tuple[tuple[int, ...], str] | None:
        """``(versions, layout)`` of the global of ``outer_step`` (None: unknown)."""
        info = self._published.get(outer_step)
        return None if info is None else (tuple(info["versions"]), str(info["layout"]))

    def publishes_files(self, store_supports: bool) -> FragmentLayout | None:
        """The layout to publish one file per fragment with, or None for one whole file."""
        return self.plan.layout if store_supports else None
