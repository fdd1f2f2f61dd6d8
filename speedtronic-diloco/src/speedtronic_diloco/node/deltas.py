"""A node's own deltas: the one on its way to the store (:class:`UploadJob`, which the
boundary cuts) and, with ``install_at: boundary`` and ``keep_own_progress``, those no global
has shown aggregated yet (:class:`OwnProgress`), so installing an older global does not undo
them. Both sit below the rooms and their decisions (:mod:`~speedtronic_diloco.node.decisions`),
which all name them."""

from __future__ import annotations

from dataclasses import dataclass

from speedtronic_diloco.tensors import TensorDict, combine

__all__ = ["UNMERGED_KEEP", "OwnProgress", "UploadJob"]

UNMERGED_KEEP = 4  # own deltas remembered until a global shows them aggregated


@dataclass(frozen=True)
class UploadJob:
    """One delta on its way to the store."""

    local_step: int
    generation: int  # of the baseline it was measured from
    target: TensorDict  # the weights it was measured to (the next baseline once it lands)
    delta: TensorDict
    base_outer_step: int
    upload_id: str = ""
    final: bool = False
    fragments: tuple[int, ...] = ()  # the fragments it covers
    fragment_generations: tuple[int, ...] = ()


class OwnProgress:
    """This node's deltas not yet seen in a global (``install_at: boundary`` with
    ``keep_own_progress``, whole-model installs): see :meth:`apply`."""

    def __init__(self, enabled: bool, scale: float = 1.0) -> None:
        self.enabled = enabled
        #: The fraction of each own delta kept on top of an installed global
        #: (``own_progress_scale``).
        self.scale = scale
        self._unmerged: dict[int, TensorDict] = {}
        self._eager: set[int] = set()  # of those, the ones the installed model already keeps

    def remember(self, job: UploadJob) -> None:
        """Keep ``job``'s delta until a global shows it aggregated (caller holds the lock)."""
        if not self.enabled or job.final:
            return
        self._unmerged[job.local_step] = job.delta
        for old in sorted(self._unmerged)[:-UNMERGED_KEEP]:
            del self._unmerged[old]

    def steps(self) -> list[int]:
        return list(self._unmerged)

    def apply(self, tensors: TensorDict, aggregated: set[int]) -> TensorDict:
        """The global ``tensors`` minus this node's own deltas that it does not contain yet
        (uploaded, or in flight, but not in ``aggregated``), so a node keeps its own last
        inner loop instead of learning it again from an older state (which would apply that
        progress twice). The baseline becomes the result: those deltas are not resent.
        Caller holds the lock."""
        if not self._unmerged:
            return tensors
        for step in [s for s in self._unmerged if s in aggregated]:
            del self._unmerged[step]
        own = [self._unmerged[s] for s in sorted(self._unmerged)]
        self._eager = set(self._unmerged)
        if not own:
            return tensors
        if self.scale != 1.0:
            # The whole delta still goes to the master; locally only the share the outer step
            # is expected to give it (the next boundary measures from the result).
            own = [{k: v * self.scale for k, v in delta.items()} for delta in own]
        return combine(tensors, *own, sign=-1)

    def unmerge_failed(self, job: UploadJob, baseline: TensorDict) -> TensorDict:
        """A failed upload whose delta the model already keeps: the baseline moved back by it,
        so the next boundary sends that progress again (cumulative), as after any failed
        upload (caller holds the lock)."""
        delta = self._unmerged.pop(job.local_step, None)
        if delta is None or job.local_step not in self._eager:
            return baseline
        self._eager.discard(job.local_step)
        return combine(baseline, delta, sign=1)
