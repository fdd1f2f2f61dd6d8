"""The ``distributed`` config section that speedtronic-diloco contributes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from speedtronic.errors import ConfigError
from speedtronic.schema import Section, build_section, option
from speedtronic_diloco.identity import validate_node_id

__all__ = ["DEFAULT_STATE_DIR", "DistributedConfig", "distributed_config", "resolve_state_dir"]

#: The local state root when ``distributed.state_dir`` is unset: under ``run.output_dir`` for a
#: trainer run, under the working directory for a coordinator built by hand.
DEFAULT_STATE_DIR = "diloco"


@dataclass
class DistributedConfig(Section):
    """DumbDiLoCo: local inner steps, pseudo-gradients through a shared store, an outer loop."""

    enabled: bool = option(False, help="Train as one node of a DumbDiLoCo run.")
    mode: Literal["dumb_diloco"] = option("dumb_diloco", help="Distributed algorithm.")
    role: Literal["master", "worker"] = option(
        "worker", help="`master` also runs the outer loop and publishes global weights."
    )
    node_id: str | None = option(
        None,
        help="Unique, path-safe id of this node; defaults to $HF_USERNAME, then $USER, "
        "then `local`.",
    )
    repo_id: str | None = option(
        None,
        help="The shared store: a `file://` URL or an absolute path selects a shared directory; "
        "anything else is a Hugging Face Hub repository id (`org/run`).",
    )
    token: str | None = option(
        None, secret=True, help="Hub token; prefer the HF_TOKEN environment variable."
    )
    endpoint: str | None = option(
        None,
        help="Hub base URL; default $HF_ENDPOINT (read when the run starts), else "
        "https://huggingface.co.",
    )
    inner_steps: int = option(500, ge=1, help="Optimizer steps between delta uploads.")
    poll_interval: float = option(
        60.0,
        ge=0,
        help="Seconds between polls for new global weights (and between the "
        "master's outer rounds); boundaries always poll.",
    )
    outer_lr: float = option(0.7, gt=0, help="Learning rate of the outer Nesterov SGD.")
    outer_momentum: float = option(0.9, ge=0, lt=1, help="Momentum of the outer Nesterov SGD.")
    reset_inner_optimizer: bool = option(
        True,
        help="Clear the inner optimizer's state whenever a delta is pushed or a new global "
        "is installed.",
    )
    async_delta_upload: bool = option(
        True,
        help="Upload deltas from a background lane (one job in flight; a boundary that "
        "finds it busy is skipped) instead of blocking the training step.",
    )
    async_global_poll: bool = option(
        True,
        help="Fetch new global weights in a background lane; they are installed at the "
        "next training step.",
    )
    state_dir: str | None = option(
        None,
        help="Local state root (outer state, caches); relative paths are under "
        f"`run.output_dir`. Default `<run.output_dir>/{DEFAULT_STATE_DIR}`.",
    )
    cache_dir: str | None = option(
        None,
        help="Download cache; default `<state_dir>/<node_id>/cache`. Relative paths are "
        "relative to the working directory.",
    )
    private: bool = option(True, help="Create the Hub repository as private (master).")
    collaborators: list[str] = option(
        default_factory=list,
        help="Users the master grants write access where the store supports it.",
    )
    request_timeout: float = option(60.0, gt=0, help="Seconds before one store request fails.")
    max_retries: int = option(4, ge=0, help="Retries of a transient store failure.")
    retry_backoff: float = option(
        1.0, ge=0, help="First retry delay in seconds; doubles per retry (capped at 30 s)."
    )

    def validate(self) -> None:
        if self.node_id is not None:
            validate_node_id(self.node_id, "node_id")
        if self.enabled and not self.repo_id:
            raise ConfigError("is required when distributed.enabled is true", "repo_id")


def distributed_config(config: Any) -> DistributedConfig:
    """The DistributedConfig inside ``config``: itself, ``config.distributed`` of a
    SpeedtronicConfig, or the ``distributed`` entry of a root mapping."""
    if isinstance(config, DistributedConfig):
        return config
    if isinstance(config, Mapping):
        section = config.get("distributed", config)
        return build_section(DistributedConfig, section, "distributed")
    section = getattr(config, "distributed", None)
    if section is None:
        raise ConfigError(
            f"expected a DistributedConfig, a SpeedtronicConfig with a distributed section or a "
            f"mapping, got {type(config).__name__}"
        )
    if isinstance(section, DistributedConfig):
        return section
    return build_section(DistributedConfig, section, "distributed")


def resolve_state_dir(section: DistributedConfig, base: str | Path | None = None) -> Path:
    """``section.state_dir`` (default :data:`DEFAULT_STATE_DIR`); a relative path is taken under
    ``base`` (a run's ``run.output_dir``) when given, else under the working directory."""
    configured = Path(section.state_dir or DEFAULT_STATE_DIR)
    if base is None or configured.is_absolute():
        return configured
    return Path(base) / configured
