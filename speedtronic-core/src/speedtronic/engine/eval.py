"""Held-out evaluation: the same samples every time, spread over the whole held-out split,
without disturbing training.

Which samples (windows) an :class:`Evaluator` scores:

- held-out data of a known size (token shards' ``eval/`` split, a text holdout or
  ``eval.text_path``, a map-style dataset): ``eval.batches: N`` takes ``N`` micro-batches of
  windows spread evenly over the whole split, at a fixed stride from a seeded offset
  (:func:`spread_windows`), so the score represents the split rather than its first pages;
  ``eval.batches: all`` scores every window once. The choice depends only on the split's size
  and ``N``: every evaluation of a run, and every run on the same split, scores the same windows;
- an endless stream (the synthetic data): its first ``N`` micro-batches, as before (the stream is
  stationary, so a prefix is as good as any sample); ``all`` is an error there;
- any other iterable: its first ``N`` micro-batches, read once and kept.

Under DDP the ranks split the chosen windows between them, so an evaluation scores the same
windows and tokens whatever the world size. It runs the model in ``eval()`` mode under
``torch.no_grad()`` and the run's autocast, restores train mode afterwards, and saves and
restores every random generator around its work: the training run's RNG, data position and loss
curve are bitwise the same with and without eval.

Where the held-out samples come from (:func:`build_eval_source`):

- ``eval.text_path`` / ``eval.shards``: a separate source;
- token shards (``data.shards``): the ``eval/`` split that ``speedtronic data prepare`` wrote;
- ``data.text_path`` with ``eval.holdout_fraction``: the last blocks of the file, which the
  training stream then never reads;
- the synthetic stream: the same rule under a seed of its own, disjoint from training's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from speedtronic.checkpoint import rng_state, set_rng_state
from speedtronic.config import SpeedtronicConfig
from speedtronic.engine.batch import (
    batch_size_and_tokens,
    call_model,
    labels_as_inputs,
    loss_of,
    move_to,
)
from speedtronic.engine.precision import Precision
from speedtronic.errors import ConfigError, DataError
from speedtronic.parallel.context import SINGLE_PROCESS, ParallelContext

__all__ = [
    "EVAL_SEED_SALT",
    "EvalResult",
    "Evaluator",
    "build_eval_source",
    "eval_seed",
    "spread_windows",
]

log = logging.getLogger("speedtronic.eval")

# Mixed into the training seed for the synthetic stream's held-out samples.
EVAL_SEED_SALT = 0x5EED_0E7A_1A11_D0A7


def eval_seed(seed: int) -> int:
    """The synthetic stream's held-out seed for a training seed (never equal to it)."""
    return (seed ^ EVAL_SEED_SALT) & (2**63 - 1) or 1


def spread_windows(total: int, wanted: int, seed: int = 0) -> np.ndarray:
    """``wanted`` distinct window numbers of ``[0, total)`` spread evenly over it: window
    ``floor((i * total + offset) / wanted)`` for ``i < wanted``, with ``offset`` in
    ``[0, total)`` drawn from ``(seed, total, wanted)``. All of them when ``wanted >= total``."""
    if wanted >= total:
        return np.arange(total, dtype=np.int64)
    # Python integers: i * total may not fit 64 bits for a huge split.
    offset = int(np.random.default_rng([seed & (2**63 - 1), total, wanted]).integers(total))
    return np.array([(i * total + offset) // wanted for i in range(wanted)], dtype=np.int64)


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: mean loss per token over the held-out windows and its perplexity.

    ``windows`` is how many windows (samples) were scored, all ranks together, and
    ``of_windows`` how many the held-out split holds (None for an endless stream)."""

    step: int
    loss: float
    ppl: float
    tokens: int
    batches: int
    elapsed_s: float
    windows: int = 0
    of_windows: int | None = None

    def payload(self) -> dict[str, Any]:
        """The ``eval`` metric event's payload."""
        return asdict(self)


class Evaluator:
    """Scores a model on ``batches`` micro-batches of ``source`` (a DataSource or any iterable
    of micro-batches), or on every window of it (``batches="all"``); see the module notes for
    which windows.

    ``seed`` draws the offset of the spread windows; the default keeps the same windows for
    the same split and ``batches`` across runs, whatever their training seed."""

    def __init__(
        self,
        source: Any,
        batches: int | Literal["all"],
        *,
        device: torch.device,
        precision: Precision,
        label_mode: str = "shifted",
        description: str = "",
        parallel: ParallelContext = SINGLE_PROCESS,
        seed: int = EVAL_SEED_SALT,
        lockstep: bool = False,
    ) -> None:
        if batches != "all" and (isinstance(batches, bool) or not isinstance(batches, int)):
            raise ConfigError(
                f"must be a number of micro-batches or 'all', got {batches!r}", "eval.batches"
            )
        if batches != "all" and batches < 1:
            raise ConfigError(f"must be >= 1 (got {batches})", "eval.batches")
        self.parallel = parallel
        # A sharded (FSDP) forward is a collective: every rank must score as many batches.
        self.lockstep = lockstep
        self.source = source
        self.batches = batches
        self.device = device
        self.precision = precision
        self.label_mode = label_mode
        self.seed = seed
        self.description = description or getattr(source, "description", type(source).__name__)
        self._chosen: np.ndarray | None = None
        self._cached: list[Any] | None = None
        windows = getattr(source, "windows", None)
        self._windows = windows if windows is not None and hasattr(windows, "read") else None
        if batches == "all" and not self._finite():
            raise ConfigError(
                f"'all' needs held-out data of a known size, but {self.description} has no end: "
                "give a number of micro-batches",
                "eval.batches",
            )

    def _finite(self) -> bool:
        if self._windows is not None:
            return self._windows.count is not None
        return bool(getattr(self.source, "epoch_batches", None))

    @property
    def of_windows(self) -> int | None:
        """The windows of the whole held-out split (None when unknown or endless)."""
        return self._windows.count if self._windows is not None else None

    def chosen_windows(self) -> np.ndarray | None:
        """The window numbers an evaluation scores, all ranks together, in order (None for a
        source without random access, which is read from its start)."""
        if self._windows is None:
            return None
        if self._chosen is None:
            micro = self._windows.micro_batch_size
            total = self._windows.count
            if total is None:  # endless: the first micro-batches, as a single process reads
                self._chosen = np.arange(int(self.batches) * micro, dtype=np.int64)
            elif self.batches == "all":
                self._chosen = np.arange(total, dtype=np.int64)
            else:
                if self.batches * micro > total:
                    log.warning(
                        "the eval data (%s) has only %d windows, fewer than eval.batches=%d "
                        "micro-batches of %d: scoring each once",
                        self.description,
                        total,
                        self.batches,
                        micro,
                    )
                self._chosen = spread_windows(total, self.batches * micro, self.seed)
        return self._chosen

    def _rank_batches(self, every_rank: bool = False) -> Iterator[Any]:
        """This rank's share of the chosen windows, as micro-batches (read now)."""
        assert self._windows is not None
        chosen = self.chosen_windows()
        assert chosen is not None
        if not every_rank and self.parallel.world_size > 1:
            chosen = chosen[self.parallel.rank :: self.parallel.world_size]
        micro = self._windows.micro_batch_size
        for first in range(0, len(chosen), micro):
            batch = self._windows.read(chosen[first : first + micro])
            yield labels_as_inputs(batch) if self.label_mode == "inputs" else batch

    def _read_prefix(self) -> list[Any]:
        """A source without random access: its first micro-batches, read once and kept."""
        if self._cached is None:
            iterator: Iterator[Any] = (
                self.source.iterate(0) if hasattr(self.source, "iterate") else iter(self.source)
            )
            cached = []
            # Finite data is read once: a sample that came round again would count twice.
            epoch = getattr(self.source, "epoch_batches", None)
            if self.batches == "all":
                wanted = int(epoch)
            else:
                wanted = min(self.batches, epoch) if epoch else self.batches
            for _ in range(wanted):
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                cached.append(labels_as_inputs(batch) if self.label_mode == "inputs" else batch)
            if not cached:
                raise DataError(f"the eval data ({self.description}) yields no batch")
            if self.batches != "all" and len(cached) < self.batches:
                log.warning(
                    "the eval data (%s) has only %d of eval.batches=%d distinct micro-batches",
                    self.description,
                    len(cached),
                    self.batches,
                )
            self._cached = cached
        return self._cached

    def held_out_batches(self, *, every_rank: bool = False) -> list[Any]:
        """The micro-batches an evaluation scores on this rank (``every_rank``: on all ranks
        together, what one process scores), on the CPU."""
        if self._windows is None:
            return list(self._read_prefix())
        return list(self._rank_batches(every_rank))

    def _batches(self) -> Iterator[Any]:
        # Windows are read at each evaluation rather than kept: "all" of a large split would
        # not fit in memory, and a read costs far less than the forward pass over it.
        if self._windows is None:
            return iter(self._read_prefix())
        return self._rank_batches()

    def _batch_count(self) -> int:
        """How many micro-batches this rank scores, without reading the windows."""
        if self._windows is None:
            return len(self._read_prefix())
        chosen = self.chosen_windows()
        assert chosen is not None
        if self.parallel.world_size > 1:
            chosen = chosen[self.parallel.rank :: self.parallel.world_size]
        return math.ceil(len(chosen) / self._windows.micro_batch_size)

    def _lockstep_extra(self) -> int:
        """The forwards this rank runs beyond its own micro-batches so that every rank runs
        as many (``lockstep``; one small collective), else 0."""
        if not (self.lockstep and self.parallel.enabled):
            return 0
        mine = self._batch_count()
        return int(self.parallel.max_each([mine])[0]) - mine

    def _any_batch(self) -> Any:
        """A micro-batch for a rank left without windows of its own (more ranks than
        micro-batches): the split's first, scored by another rank."""
        if self._windows is None:
            return self._read_prefix()[0]
        return next(self._rank_batches(every_rank=True))

    def describe(self) -> str:
        """``"240 of 1742 windows (8 micro-batches of 30) of <source>"`` for the log."""
        chosen = self.chosen_windows()
        if chosen is None:
            count = f"{self.batches} micro-batches"
            return f"{count} of {self.description}"
        of = self.of_windows
        micro = self._windows.micro_batch_size if self._windows is not None else 0
        count = f"{len(chosen)} of {of} windows" if of is not None else f"{len(chosen)} windows"
        spread = "" if of is None or len(chosen) == of else ", spread over the split"
        batches = math.ceil(len(chosen) / micro)
        return f"{count} ({batches} micro-batches of {micro}{spread}) of {self.description}"

    def evaluate(self, model: nn.Module, step: int) -> EvalResult:
        """The held-out loss of ``model`` at training step ``step``; leaves the model's mode,
        its gradients and every random generator as they were."""
        started = time.perf_counter()
        saved_rng = rng_state()
        was_training = model.training
        model.eval()
        try:
            # A sharded (FSDP) forward is a collective: a rank with fewer micro-batches than
            # another runs that many more forwards, uncounted, so the ranks stay in step and
            # score exactly the windows one process would.
            extra = self._lockstep_extra()
            total = torch.zeros((), device=self.device, dtype=torch.float64)
            batches = samples = tokens = 0
            last = None
            with torch.no_grad():
                for batch in self._batches():
                    on_device = move_to(batch, self.device)
                    with self.precision.autocast(self.device):
                        loss = loss_of(call_model(model, on_device))
                    rows, count = batch_size_and_tokens(batch)
                    # Weighted by tokens: a rank's last micro-batch may be short.
                    total += loss.detach().double() * count
                    batches, samples, tokens = batches + 1, samples + rows, tokens + count
                    last = batch
                for _ in range(extra):
                    filler = last if last is not None else self._any_batch()
                    with self.precision.autocast(self.device):
                        call_model(model, move_to(filler, self.device))
            # Under DDP each rank scored its own share: add up over ranks (one collective).
            counts = torch.tensor(
                [float(batches), float(samples), float(tokens)],
                device=self.device,
                dtype=torch.float64,
            )
            total = self.parallel.sum(total)
            counts = self.parallel.sum(counts)
            batches, samples, tokens = (int(c) for c in counts.tolist())  # the host sync
            if tokens == 0:
                raise DataError(f"the eval data ({self.description}) yields no batch")
            mean = float(total.item()) / tokens
        finally:
            model.train(was_training)
            set_rng_state(saved_rng)
        ppl = math.exp(mean) if mean < 700 else math.inf
        of = self.of_windows
        if self._windows is None and of is None:
            epoch = getattr(self.source, "epoch_batches", None)
            of = samples if epoch and len(self._cached or ()) >= epoch else None
        return EvalResult(
            step=step,
            loss=mean,
            ppl=ppl,
            tokens=tokens,
            batches=batches,
            elapsed_s=time.perf_counter() - started,
            windows=samples,
            of_windows=of,
        )


def build_eval_source(
    config: SpeedtronicConfig,
    *,
    seq_len: int | None,
    vocab_size: int | None,
    dataset: Any = None,
    rank: int = 0,
    num_ranks: int = 1,
) -> Any:
    """The held-out micro-batches the ``eval`` section asks for (see the module docstring).

    ``dataset`` is a held-out dataset a Python caller brings (it wins). With a user training
    dataset and no eval source in the config, there is nothing to hold out: a ConfigError."""
    from speedtronic.data import build_dataloader
    from speedtronic.data import build_eval_source as shard_eval_source

    section = config.eval
    micro = section.micro_batch_size or config.data.micro_batch_size
    # The eval source's own micro-batch; the training batch size (a multiple of the training
    # micro-batch, not necessarily of this one) does not apply to it.
    plain = {
        "data.num_workers": 0,
        "data.micro_batch_size": micro,
        "data.target_batch_size": None,
        "data.shuffle": False,
    }
    if dataset is not None:
        return build_dataloader(
            config.with_overrides(plain), dataset, seq_len=seq_len, vocab_size=vocab_size
        )
    if section.shards or (config.data.shards and not section.text_path):
        return shard_eval_source(
            config,
            directory=section.shards or config.data.shards,
            seq_len=seq_len,
            vocab_size=vocab_size,
            micro_batch_size=micro,
            rank=rank,
            num_ranks=num_ranks,
        )
    if section.text_path:
        eval_config = config.with_overrides(
            {**plain, "data.text_path": section.text_path, "data.shards": None}
        )
        try:
            return build_dataloader(
                eval_config, seq_len=seq_len, vocab_size=vocab_size, rank=rank, num_ranks=num_ranks
            )
        except DataError as exc:  # the text stream names data.text_path: here it is eval's
            text = str(exc)
            if not text.startswith("data.text_path: "):
                raise
            raise DataError("eval.text_path: " + text.removeprefix("data.text_path: ")) from None
    if config.data.text_path:
        if not section.holdout_fraction:
            raise ConfigError(
                "evaluating with data.text_path needs held-out text: set eval.holdout_fraction "
                "(the file's last blocks, never trained on) or eval.text_path",
                "eval",
            )
        from speedtronic.data import build_holdout_source

        return build_holdout_source(
            config.with_overrides(plain),
            seq_len=seq_len,
            vocab_size=vocab_size,
            rank=rank,
            num_ranks=num_ranks,
        )
    return build_dataloader(
        config.with_overrides(plain),
        seq_len=seq_len,
        vocab_size=vocab_size,
        seed=eval_seed(config.data_seed),
        rank=rank,
        num_ranks=num_ranks,
    )
