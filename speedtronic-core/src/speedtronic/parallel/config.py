"""The ``parallel`` section of a run's config (with its ``fsdp`` settings).

Gathered, with every other section, by :mod:`speedtronic.config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from speedtronic.errors import ConfigError
from speedtronic.schema import Section, option

__all__ = ["FSDPConfig", "ParallelConfig"]


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
