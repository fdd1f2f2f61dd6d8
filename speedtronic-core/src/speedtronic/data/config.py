"""The ``data`` section of a run's config.

Gathered, with every other section, by :mod:`speedtronic.config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from speedtronic.errors import ConfigError
from speedtronic.schema import IMPORT_PATH, Section, option

__all__ = ["DataConfig"]


@dataclass
class DataConfig(Section):
    """The ``data`` section: batch sizes (accumulation is derived) and the data source."""

    micro_batch_size: int = option(8, ge=1, help="Samples per forward/backward pass.")
    target_batch_size: int | None = option(
        None,
        ge=1,
        help="Samples per optimizer step; a multiple of micro_batch_size. Accumulation steps "
        "are target / micro. Defaults to micro_batch_size (no accumulation).",
    )
    text_path: str | None = option(
        None, help="UTF-8 text file streamed in fixed-size token blocks; unset = synthetic data."
    )
    shards: str | None = option(
        None,
        help="Directory of token shards written by `speedtronic data prepare` (its `train/` "
        "split is memory-mapped and shuffled by window); unset = synthetic data.",
    )
    verify_shards: bool = option(
        False, help="Check every shard's sha256 (and token range) against `index.json` at start."
    )
    seq_len: int | None = option(
        None, ge=1, help="Tokens per sample; defaults to the model's `max_seq_len`."
    )
    vocab_size: int | None = option(
        None, ge=2, help="Token id range of the synthetic stream; defaults to the model's."
    )
    seed: int | None = option(
        None, help="Data-stream seed; defaults to `run.seed`. Plugins may key it per node."
    )
    node_split: Literal["auto", "none"] = option(
        "auto",
        help="How the nodes of a multi-node run (DiLoCo) share the data. `auto`: ranked nodes "
        "(`num_nodes`/`node_rank`) read disjoint slices, and nodes without a rank each read "
        "their own order, keyed by the node id, from every built-in source; `none`: every node "
        "reads the same stream (for experiments).",
    )
    num_workers: int = option(0, ge=0, help="DataLoader worker processes.")
    prefetch_factor: int | None = option(
        None, ge=1, help="Batches prefetched per worker (only with num_workers > 0)."
    )
    pin_memory: bool = option(False, help="Pin host memory for faster CUDA copies.")
    shuffle: bool = option(False, help="Shuffle a map-style dataset (streams ignore it).")
    dataset: str | None = option(
        None,
        help="Your own Dataset/IterableDataset from YAML: an import path `package.module:factory` "
        "called with `dataset_args` (and `rank`/`num_ranks` when it takes them). No pickle.",
    )
    dataset_args: dict[str, Any] = option(
        default_factory=dict, help="Keyword arguments for the `dataset` factory."
    )
    labels: Literal["shifted", "inputs"] | None = option(
        None,
        help="What `labels` holds in a batch: `shifted` (labels[i] is the token after input i, "
        "for models that do not shift) or `inputs` (labels = input_ids, for models that shift "
        "internally, like Hugging Face causal LMs). Unset: `inputs` for a Hugging Face "
        "`PreTrainedModel`, else `shifted`.",
    )

    def validate(self) -> None:
        target = self.target_batch_size
        if target is not None and target % self.micro_batch_size:
            raise ConfigError(
                f"must be a multiple of micro_batch_size ({self.micro_batch_size}), got {target}",
                "target_batch_size",
            )
        if self.shards and self.text_path:
            raise ConfigError("set data.shards or data.text_path, not both", "shards")
        if self.dataset and (self.shards or self.text_path):
            raise ConfigError("set one data source: dataset, shards or text_path", "dataset")
        if self.dataset is not None and not IMPORT_PATH.match(self.dataset):
            raise ConfigError(
                f"must be an import path like package.module:factory, got {self.dataset!r:.80}",
                "dataset",
            )
