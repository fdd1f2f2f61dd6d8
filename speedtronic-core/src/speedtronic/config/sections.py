"""The sections of a run's config that core owns (``run``, ``data``, ``optimizer``, ...): each a
dataclass whose fields carry their default, bounds and the help text the config reference is
generated from. :class:`speedtronic.config.SpeedtronicConfig` puts them together."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from speedtronic.config.schema import (
    IMPORT_PATH,
    Section,
    option,
)
from speedtronic.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "CompileConfig",
    "DataConfig",
    "EvalConfig",
    "FSDPConfig",
    "LoggingConfig",
    "ModelConfig",
    "MuonConfig",
    "OOOBackpropConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "RunConfig",
    "SchedulerConfig",
]


@dataclass
class RunConfig(Section):
    """The ``run`` section: what the run is called, where it runs and for how long."""

    name: str = option("speedtronic", help="Run name, used in logs and metric sinks.")
    seed: int = option(0, help="Seed for Python, NumPy, torch and the synthetic data stream.")
    device: Literal["auto", "cpu", "cuda", "mps"] = option(
        "auto", help="Where to train; `auto` picks CUDA, then MPS, then CPU."
    )
    max_steps: int = option(
        100, ge=1, help="Global optimizer-step target; a resumed run continues up to it."
    )
    output_dir: str = option("runs/speedtronic", help="Directory for checkpoints and logs.")
    max_nan_steps: int | None = option(
        20,
        ge=1,
        help="Stop the run with an error once this many optimizer steps in a row had a NaN or "
        "infinite loss (counted on the device, read every half of that many steps); null: "
        "never stop for it.",
    )
    threads: int | Literal["auto"] | None = option(
        "auto",
        ge=1,
        le=4096,
        help="CPU threads for torch's intra-op work in this process (`torch.set_num_threads`). "
        "`auto`: $OMP_NUM_THREADS when set, else the cores this process may use divided by "
        "the processes of this run on the machine ($LOCAL_WORLD_SIZE under torchrun, or "
        "$SPEEDTRONIC_LOCAL_PROCESSES), at most the physical cores, less the cores other work "
        "keeps busy (runnable tasks on the machine, read at start and every 5 s of a CPU run, "
        "where the process may use every CPU; at least 1); `null` keeps torch's defaults (all "
        "cores). Every command (train, eval, export, generate, validate) honours it.",
    )
    peak_tflops: float | None = option(
        None,
        gt=0,
        help="Peak dense TFLOP/s of one device at the training precision, for `mfu` on each "
        "`step` record (= `tflops` / this); unset: the built-in table of common GPUs (bf16 "
        "dense, see metrics.md), else no `mfu`.",
    )
    stop_signals: list[str] = option(
        default_factory=lambda: ["SIGTERM", "SIGINT"],
        help="Signals that stop the run cleanly: the step in progress finishes, a checkpoint "
        "is saved at it, and the process exits with 128 + the signal number (a second signal "
        "aborts at once). Add `SIGUSR1` for SLURM's `--signal`; `[]` leaves signals alone.",
    )

    def validate(self) -> None:
        import signal

        for index, name in enumerate(self.stop_signals):
            if name in ("SIGKILL", "SIGSTOP") or not isinstance(
                getattr(signal, str(name), None), signal.Signals
            ):
                raise ConfigError(
                    f"{name!r} is not a signal a process can handle (SIGTERM, SIGINT, "
                    "SIGUSR1, ...)",
                    f"stop_signals[{index}]",
                )


@dataclass
class ModelConfig:
    """The ``model`` section: a registered ``name`` plus free parameters for its factory."""

    name: str = "reference_transformer"
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # The factory is called as build(name, **params): a parameter called ``name`` would
        # collide with the model's name; a mapping called ``params`` would be read back as
        # the nested form by from_mapping(to_dict()) (a scalar one survives and is allowed).
        for key, value in self.params.items():
            if not isinstance(key, str):
                raise ConfigError(f"parameter names must be strings, got {key!r}"[:200], "model")
            if key == "name" or (key == "params" and isinstance(value, Mapping)):
                raise ConfigError(
                    "is a reserved key (model.name names the model, model.params holds its "
                    "parameters); rename the parameter",
                    f"model.params.{key}",
                )

    @classmethod
    def from_mapping(cls, data: Any) -> ModelConfig:
        """``{name: ..., **params}``; parameters may also be nested under ``params:``."""
        if data is None:
            data = {}
        if isinstance(data, ModelConfig):
            return data
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a mapping, got {type(data).__name__}", "model")
        params = dict(data)
        name = params.pop("name", cls.name)
        if not isinstance(name, str) or not name:
            raise ConfigError("must be a non-empty string", "model.name")
        if isinstance(params.get("params"), Mapping):
            nested = params.pop("params")
            for key in nested:
                if key in params:
                    raise ConfigError("given both directly and under model.params", f"model.{key}")
            params = {**dict(nested), **params}
        return cls(name=name, params=params)

    def to_dict(self) -> dict[str, Any]:
        """``{name, **params}``, the flat form a config file uses."""
        return {"name": self.name, **self.params}


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


@dataclass
class MuonConfig(Section):
    """The ``optimizer.muon`` section: the Muon group, used when ``optimizer.name: muon``."""

    lr: float = option(0.02, gt=0, help="Learning rate of the Muon parameter group.")
    momentum: float = option(0.95, ge=0, lt=1, help="Muon momentum.")
    nesterov: bool = option(True, help="Nesterov momentum inside Muon.")
    ns_steps: int = option(5, ge=1, lt=100, help="Newton-Schulz iterations for orthogonalisation.")
    weight_decay: float = option(0.0, ge=0, help="Decoupled weight decay of the Muon group.")
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = option(
        None, help="How torch.optim.Muon scales the lr by matrix shape (torch's default if null)."
    )


@dataclass
class OptimizerConfig(Section):
    """The ``optimizer`` section: AdamW (or Muon + AdamW) and gradient clipping."""

    name: Literal["adamw", "muon"] = option(
        "adamw", help="`adamw`, or `muon` (Muon on hidden matrices, AdamW on the rest)."
    )
    lr: float = option(3e-4, gt=0, help="Peak learning rate (of the AdamW group).")
    betas: tuple[float, float] = option((0.9, 0.95), help="AdamW betas.")
    eps: float = option(1e-8, gt=0, help="AdamW epsilon.")
    weight_decay: float = option(0.1, ge=0, help="Decoupled weight decay.")
    decay_norms_and_biases: bool = option(
        False,
        help="Also decay 1-D parameters (norm weights, biases) and embeddings; by default only "
        "weight matrices decay.",
    )
    fused: bool | None = option(
        None, help="Fused AdamW: null = use it when it constructs on CUDA, false = never."
    )
    grad_clip: float | None = option(1.0, gt=0, help="Max global grad norm; null disables.")
    cautious: bool = option(
        False, help="Cautious masking around the base optimizer (Liang et al., 2024)."
    )
    muon: MuonConfig = option(default_factory=MuonConfig, help="Muon group settings.")

    def validate(self) -> None:
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ConfigError(f"each beta must be in [0, 1), got {beta}", f"betas[{i}]")


@dataclass
class SchedulerConfig(Section):
    """The ``scheduler`` section: the learning-rate schedule."""

    name: Literal["cosine", "constant"] = option("cosine", help="Learning-rate schedule.")
    warmup_steps: int = option(0, ge=0, help="Linear warmup steps from 0 to the peak lr.")
    min_lr_ratio: float = option(0.1, ge=0, le=1, help="Cosine floor as a fraction of peak lr.")
    total_steps: int | None = option(
        None, ge=1, help="Schedule horizon; defaults to `run.max_steps`."
    )


@dataclass
class PrecisionConfig(Section):
    """The ``precision`` section: the compute dtype and loss scaling."""

    mode: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto",
        help="`auto`: bf16 on capable CUDA, fp16 + GradScaler on other CUDA, fp32 on CPU/MPS.",
    )


@dataclass
class CompileConfig(Section):
    """The ``compile`` section: opt-in ``torch.compile``; a failure falls back to eager."""

    enabled: bool = option(False, help="Wrap the model with torch.compile.")
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        option("default", help="torch.compile mode.")
    )
    fullgraph: bool = option(False, help="Require a single graph (torch.compile fullgraph).")
    dynamic: bool | None = option(None, help="torch.compile dynamic shapes (null = auto).")
    backend: str = option(
        "inductor",
        help="torch.compile backend; `aot_eager` or `eager` compile fast, for debugging.",
    )


@dataclass
class OOOBackpropConfig(Section):
    """The ``ooo_backprop`` section: out-of-order backprop, opt-in, not with ``compile``."""

    enabled: bool = option(
        False,
        help="Return each `nn.Linear`'s input gradient at once and queue its weight and bias "
        "gradients, drained before anything reads `.grad` (see engine.md). Active on CUDA; "
        "elsewhere accepted with one warning. Not together with `compile.enabled`.",
    )
    modules: Literal["linear"] = option(
        "linear",
        help="Which layers: `linear` = every `nn.Linear` that keeps nn.Linear's forward "
        "(fused QKV and gate-up projections included).",
    )
    stream: Literal["side", "same"] = option(
        "side",
        help="`side`: run the queued products on a dedicated CUDA stream; `same`: in order on "
        "the current stream at each drain (always so off CUDA).",
    )


@dataclass
class ProfileConfig(Section):
    """The ``profile`` section: a torch.profiler window around a few optimizer steps."""

    start: int | None = option(
        None,
        ge=1,
        help="First optimizer step profiled (as the `step` field counts); unset: no profiling. "
        "`speedtronic train --profile START:END` sets `start` and `end`.",
    )
    end: int | None = option(
        None, ge=1, help="Last optimizer step profiled (inclusive); defaults to `start`."
    )
    record_shapes: bool = option(False, help="Record operator input shapes (torch.profiler).")
    memory: bool = option(False, help="Record tensor allocations (torch.profiler profile_memory).")
    all_ranks: bool = option(
        False, help="Under DDP, profile every rank (one trace each); by default rank 0 only."
    )

    def validate(self) -> None:
        if self.end is not None and self.start is None:
            raise ConfigError("is set but profile.start is not", "end")
        if self.start is not None:
            if self.end is None:
                self.end = self.start
            if self.end < self.start:
                raise ConfigError(f"must be >= start ({self.start}), got {self.end}", "end")


@dataclass
class CheckpointConfig(Section):
    """The ``checkpoint`` section: where, how often, how many, and resuming."""

    directory: str | None = option(
        None, help="Checkpoint directory; defaults to `<run.output_dir>/checkpoints`."
    )
    interval: int = option(0, ge=0, help="Save every N optimizer steps; 0 = only the final one.")
    keep_last: int = option(3, ge=1, help="How many complete checkpoints to keep.")
    resume: bool = option(
        False, help="Resume from the newest usable checkpoint; start fresh if there is none."
    )
    allow_fresh_start: bool = option(
        False,
        help="With resume: start from scratch even if checkpoints exist but none is usable "
        "(otherwise that is an error).",
    )
    every_seconds: float | None = option(
        None,
        gt=0,
        help="Also save when this many seconds passed since the last save (checked at step "
        "boundaries; the ranks of a data-parallel run agree); unset: steps only.",
    )
    async_save: bool = option(
        False,
        help="Copy the state to CPU memory at the save step and write it in a background "
        "thread while training goes on (one write in flight; a failure is raised at the next "
        "step). The run's end and a stop signal wait for it. With `parallel.strategy: fsdp` "
        "every rank copies its shards and writes them in the background.",
    )
    save_final: bool = option(True, help="Save at the end of a successful fit.")
    save_retry_pause: float = option(
        10.0,
        ge=0,
        le=3600,
        help="Seconds to wait before retrying a save that failed (disk full, I/O error) once; "
        "a second failure stops the run cleanly with the previous checkpoints intact.",
    )
    keep_best: bool = option(
        False,
        help="Keep the checkpoint with the lowest eval loss (`best.json` names it) besides "
        "the last `keep_last`; retention never deletes it. Needs the `eval` section.",
    )


@dataclass
class FSDPConfig(Section):
    """The ``parallel.fsdp`` section: how ``strategy: fsdp`` shards the model (FSDP2)."""

    reshard_after_forward: bool = option(
        True,
        help="Free each unit's gathered parameters after its forward and gather them again "
        "for backward (less memory); false keeps them until backward (less communication).",
    )
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = option(
        None,
        help="dtype the parameters are gathered and computed in (FSDP2 MixedPrecisionPolicy); "
        "null = from `precision` (bf16 -> bfloat16, fp16 -> float16, fp32 -> float32). The "
        "sharded master weights and the optimizer state stay float32.",
    )
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = option(
        None,
        help="dtype gradients are reduce-scattered in; null = from `precision`, like "
        "`param_dtype`. float32 reduces at full precision under bf16 compute.",
    )
    units: Literal["auto"] | list[str] = option(
        "auto",
        help="Which modules become FSDP units of their own (then the root takes the rest): "
        "`auto` = the model's transformer blocks (the classes its `_no_split_modules` names: "
        "the reference model's `TransformerBlock`, a Hugging Face model's decoder layer; else "
        "the class repeated in a ModuleList), or a list of class names.",
    )
    cpu_offload: bool = option(
        False,
        help="Keep the sharded parameters, gradients and optimizer state in host memory "
        "(FSDP2 CPUOffloadPolicy; the optimizer steps on the CPU). CUDA only.",
    )

    def validate(self) -> None:
        if isinstance(self.units, list):
            if not self.units:
                raise ConfigError("must be `auto` or a non-empty list of class names", "units")
            for index, name in enumerate(self.units):
                if not name.isidentifier():
                    raise ConfigError(f"{name!r:.60} is not a class name", f"units[{index}]")


@dataclass
class ParallelConfig(Section):
    """The ``parallel`` section: data parallel (DDP) or sharded (FSDP) inside one machine."""

    strategy: str = option(
        "auto",
        help="`auto`: DDP when launched with WORLD_SIZE > 1; `none`: never; `ddp`: required; "
        "`fsdp`: parameters, gradients and optimizer state sharded over the ranks (FSDP2; on "
        "one process: no sharding), checkpoints written as sharded DCP directories; or the "
        "name of a strategy a plugin provides (`parallel_strategies` hook).",
    )
    backend: Literal["auto", "nccl", "gloo"] = option(
        "auto", help="Process-group backend; `auto` is nccl on CUDA, gloo on CPU."
    )
    find_unused_parameters: bool = option(
        False, help="DDP's find_unused_parameters, for models whose forward skips parameters."
    )
    static_graph: bool = option(
        False, help="DDP's static_graph: the same parameters are used on every step."
    )
    timeout: float = option(
        600.0,
        gt=0,
        le=86400,
        help="Seconds a collective may wait for the other ranks before the run fails.",
    )
    fsdp: FSDPConfig = option(
        default_factory=FSDPConfig, help="FSDP settings, used when `strategy: fsdp`."
    )


@dataclass
class EvalConfig(Section):
    """The ``eval`` section: held-out evaluation during training and at its end."""

    every: int = option(0, ge=0, help="Evaluate every N optimizer steps; 0 = never during.")
    batches: int | Literal["all"] = option(
        8,
        ge=1,
        le=100_000,
        help="Micro-batches per evaluation, their windows spread evenly over the held-out "
        "split (the same ones every time); `all` scores every window once.",
    )
    at_end: bool | None = option(
        None, help="Evaluate once after the last step; default: true when eval is configured."
    )
    micro_batch_size: int | None = option(
        None, ge=1, help="Samples per eval micro-batch; defaults to `data.micro_batch_size`."
    )
    text_path: str | None = option(
        None, help="A separate UTF-8 text file to evaluate on (bytes, like `data.text_path`)."
    )
    shards: str | None = option(
        None,
        help="A token-shard directory whose `eval/` split is evaluated; defaults to the "
        "`eval/` split of `data.shards`.",
    )
    holdout_fraction: float = option(
        0.0,
        ge=0,
        lt=0.5,
        help="With `data.text_path` and no separate eval source: the last fraction of the "
        "file's blocks is held out (training never reads it) and evaluated.",
    )

    def validate(self) -> None:
        if self.text_path and self.shards:
            raise ConfigError("set eval.text_path or eval.shards, not both", "shards")

    @property
    def configured(self) -> bool:
        """True when the section asks for any evaluation."""
        return bool(
            self.every or self.text_path or self.shards or self.holdout_fraction or self.at_end
        )

    @property
    def runs_at_end(self) -> bool:
        """``at_end``, defaulting to whether eval is configured."""
        return self.configured if self.at_end is None else self.at_end


@dataclass
class LoggingConfig(Section):
    """The ``logging`` section: log level, metric files and extra metric hooks."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = option(
        "INFO", help="Log level of the `speedtronic` loggers."
    )
    file: str | None = option(None, help="Append human-readable metric lines to this file.")
    json_file: str | None = option(
        None,
        help="Append one JSON object per metric event here (what `speedtronic plot` reads); "
        'unset: `<run.output_dir>/metrics.jsonl`; `""`: no JSONL file.',
    )
    log_every: int = option(10, ge=1, help="Read the loss and emit a `step` event every N steps.")
    hooks: list[str] = option(
        default_factory=list,
        help="Extra metric hooks as `module:attribute` import paths: callables "
        "`(event, payload)` or objects with `on_event`.",
    )
    progress: bool = option(True, help="Show a rich progress bar when stdout is a terminal.")
