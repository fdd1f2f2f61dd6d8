"""Held-out evaluation: the same samples every time, without disturbing training.

An :class:`Evaluator` reads its micro-batches once (the first time it runs) and keeps them, so
every evaluation of a run scores exactly the same held-out samples and curves are comparable.
It runs the model in ``eval()`` mode under ``torch.no_grad()`` and the run's autocast, restores
train mode afterwards, and saves and restores every random generator around its work: the
training run's RNG, data position and loss curve are bitwise the same with and without eval.

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
from typing import Any

import torch
from torch import nn

from speedtronic.batch import batch_size_and_tokens, call_model, labels_as_inputs, loss_of, move_to
from speedtronic.checkpoint import rng_state, set_rng_state
from speedtronic.config import SpeedtronicConfig
from speedtronic.errors import ConfigError, DataError
from speedtronic.parallel import SINGLE_PROCESS, ParallelContext
from speedtronic.precision import Precision

__all__ = ["EVAL_SEED_SALT", "EvalResult", "Evaluator", "build_eval_source", "eval_seed"]

log = logging.getLogger("speedtronic.eval")

# Mixed into the training seed for the synthetic stream's held-out samples.
EVAL_SEED_SALT = 0x5EED_0E7A_1A11_D0A7


def eval_seed(seed: int) -> int:
    """The synthetic stream's held-out seed for a training seed (never equal to it)."""
    return (seed ^ EVAL_SEED_SALT) & (2**63 - 1) or 1


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: mean loss over the held-out micro-batches and its perplexity."""

    step: int
    loss: float
    ppl: float
    tokens: int
    batches: int
    elapsed_s: float

    def payload(self) -> dict[str, Any]:
        """The ``eval`` metric event's payload."""
        return asdict(self)


class Evaluator:
    """Scores a model on ``batches`` fixed micro-batches of ``source`` (a DataSource or any
    iterable of micro-batches)."""

    def __init__(
        self,
        source: Any,
        batches: int,
        *,
        device: torch.device,
        precision: Precision,
        label_mode: str = "shifted",
        description: str = "",
        parallel: ParallelContext = SINGLE_PROCESS,
        lockstep: bool = False,
    ) -> None:
        self.parallel = parallel
        # A sharded (FSDP) forward is a collective: every rank must score as many batches.
        self.lockstep = lockstep
        self.source = source
        self.batches = batches
        self.device = device
        self.precision = precision
        self.label_mode = label_mode
        self.description = description or getattr(source, "description", type(source).__name__)
        self._cached: list[Any] | None = None

    def _held_out(self) -> list[Any]:
        if self._cached is None:
            iterator: Iterator[Any] = (
                self.source.iterate(0) if hasattr(self.source, "iterate") else iter(self.source)
            )
            cached = []
            # Finite data is read once: a sample that came round again would count twice.
            epoch = getattr(self.source, "epoch_batches", None)
            wanted = min(self.batches, epoch) if epoch else self.batches
            for _ in range(wanted):
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                cached.append(labels_as_inputs(batch) if self.label_mode == "inputs" else batch)
            if not cached:
                raise DataError(f"the eval data ({self.description}) yields no batch")
            if len(cached) < self.batches:
                log.warning(
                    "the eval data (%s) has only %d of eval.batches=%d distinct micro-batches",
                    self.description,
                    len(cached),
                    self.batches,
                )
            self._cached = cached
        return self._cached

    def evaluate(self, model: nn.Module, step: int) -> EvalResult:
        """The held-out loss of ``model`` at training step ``step``; leaves the model's mode,
        its gradients and every random generator as they were."""
        started = time.perf_counter()
        saved_rng = rng_state()
        was_training = model.training
        model.eval()
        try:
            batches = self._held_out()
            if self.lockstep:
                batches = batches[: min(self.parallel.gather(len(batches)))]
            total = torch.zeros((), device=self.device, dtype=torch.float64)
            tokens = 0
            with torch.no_grad():
                for batch in batches:
                    on_device = move_to(batch, self.device)
                    with self.precision.autocast(self.device):
                        loss = loss_of(call_model(model, on_device))
                    total += loss.detach().double()
                    tokens += batch_size_and_tokens(batch)[1]
            # Under DDP each rank scored its own share: average over ranks (one collective).
            counts = torch.tensor(
                [float(len(batches)), float(tokens)], device=self.device, dtype=torch.float64
            )
            total = self.parallel.sum(total)
            counts = self.parallel.sum(counts)
            mean = float(total.item() / counts[0].item())  # the host sync of an evaluation
            tokens = int(counts[1].item())
        finally:
            model.train(was_training)
            set_rng_state(saved_rng)
        ppl = math.exp(mean) if mean < 700 else math.inf
        return EvalResult(
            step=step,
            loss=mean,
            ppl=ppl,
            tokens=tokens,
            batches=int(counts[0].item()),
            elapsed_s=time.perf_counter() - started,
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
