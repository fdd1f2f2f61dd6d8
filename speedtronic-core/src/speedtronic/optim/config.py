"""The ``optimizer`` (with its ``muon`` group) and ``scheduler`` sections of a run's config.

Gathered, with every other section, by :mod:`speedtronic.config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from speedtronic.errors import ConfigError
from speedtronic.schema import Section, option

__all__ = ["MuonConfig", "OptimizerConfig", "SchedulerConfig"]


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
