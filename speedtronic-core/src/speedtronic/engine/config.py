"""The config sections of the engine: ``run``, ``model``, ``precision``, ``compile``,
``ooo_backprop`` and ``eval``.

Gathered, with every other section, by :mod:`speedtronic.config`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from speedtronic.errors import ConfigError
from speedtronic.schema import Section, option

__all__ = [
    "CompileConfig",
    "EvalConfig",
    "ModelConfig",
    "OOOBackpropConfig",
    "PrecisionConfig",
    "RunConfig",
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
