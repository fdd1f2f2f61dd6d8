"""The ``distributed`` config section that speedtronic-diloco contributes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from speedtronic.errors import ConfigError
from speedtronic.schema import Section, build_section, option
from speedtronic_diloco.identity import validate_node_id
from speedtronic_diloco.signing import KEY_ENV

__all__ = [
    "DEFAULT_STATE_DIR",
    "MAX_OUTER_LR",
    "MAX_SECONDS",
    "DistributedConfig",
    "distributed_config",
    "resolve_state_dir",
]

#: The local state root when ``distributed.state_dir`` is unset: under ``run.output_dir`` for a
#: trainer run, under the working directory for a coordinator built by hand.
DEFAULT_STATE_DIR = "diloco"
#: Upper bound of every duration option (seconds): a day. A larger value is a typo, and a
#: huge one overflows the waits it feeds (``poll_interval: 1e300`` killed the outer thread).
MAX_SECONDS = 86_400.0
#: Upper bound of ``outer_lr``: DiLoCo uses about 0.7; ``1e300`` publishes a non-finite global.
MAX_OUTER_LR = 10.0


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
    num_nodes: int | None = option(
        None,
        ge=1,
        le=1_000_000,
        help="How many nodes the run has. With `node_rank`, every data source (text, shards, "
        "datasets) is split so nodes read disjoint samples; unset: each node only draws the "
        "synthetic stream from a seed of its own.",
    )
    node_rank: int | None = option(
        None, ge=0, help="This node's index in 0 .. num_nodes - 1 (with `num_nodes`)."
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
        le=MAX_SECONDS,
        help="Seconds between polls for new global weights (and between the "
        "master's outer rounds); boundaries always poll. At most one day.",
    )
    outer_lr: float = option(
        0.7, gt=0, le=MAX_OUTER_LR, help="Learning rate of the outer Nesterov SGD (at most 10)."
    )
    outer_momentum: float = option(
        0.7,
        ge=0,
        lt=1,
        help="Momentum of the outer Nesterov SGD. 0.7 measured best from scratch at small H "
        "(0.9, the DiLoCo paper's, overshot; docs/diloco.md).",
    )
    reset_inner_optimizer: bool = option(
        False,
        help="Clear the inner optimizer's state whenever a delta is pushed or a new global "
        "is installed. Off by default: keeping each node's AdamW state (as DiLoCo and torchft "
        "do) measured better (docs/diloco.md, What we measured).",
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
    request_timeout: float = option(
        60.0, gt=0, le=MAX_SECONDS, help="Seconds before one store request fails."
    )
    max_retries: int = option(4, ge=0, le=100, help="Retries of a transient store failure.")
    retry_backoff: float = option(
        1.0,
        ge=0,
        le=300,
        help="First retry delay in seconds; doubles per retry (capped at 30 s).",
    )
    keep_outer_steps: int = option(
        4,
        ge=1,
        le=1_000_000,
        help="The master deletes processed delta files from the store once they are this many "
        "outer steps old, keeping one per node and round (the Hub in one deletion commit per "
        "round).",
    )
    squash_history_every: int = option(
        0,
        ge=0,
        le=1_000_000,
        help="Hub only: squash the repository history into one commit every this many outer "
        "steps (`HfApi.super_squash_history`; the history is lost). 0: never.",
    )
    cache_keep: int = option(
        2,
        ge=1,
        le=1000,
        help="Entries each node keeps in its download caches (global versions; the master's "
        "downloaded deltas).",
    )
    lease_ttl: float = option(
        120.0,
        ge=1,
        le=MAX_SECONDS,
        help="Seconds the master's lease on the store (`global/lease.json`) lasts; it is "
        "renewed every third of that. A second master is refused while it is live. A node "
        "that sends no delta this long is no longer counted as live.",
    )
    take_over: bool = option(
        False,
        help="Master: take over the lease of another master once it has expired (waits for "
        "the expiry; the new lease has epoch + 1).",
    )
    failover: bool = option(
        False,
        help="Worker: be a standby master. It watches the master's lease at every poll and, "
        "when the lease lapses (not renewed for `lease_ttl`), takes it (epoch + 1; of racing "
        "standbys exactly one wins) and runs the outer loop from the outer state kept in the "
        "store while it keeps training. A master whose lease another node took continues as "
        "a worker instead of stopping.",
    )
    finished_run: Literal["stop", "train_alone"] = option(
        "stop",
        help="Worker: what to do on finding the run finished (its master released the lease "
        "after its last step): `stop` says so in one line and exits with status 3, before the "
        "first step when it joined a finished run; `train_alone` says so and trains on "
        "without uploading or polling.",
    )
    # --- rounds (issue 23, 29)
    rounds: Literal["async", "sync"] = option(
        "sync",
        help="`sync` (the default): every node waits at its boundary for the global of that "
        "round (as DiLoCo does); the master closes a round once every live node delivered, or "
        "after `round_timeout` without the missing ones, who rejoin at the next round. "
        "`async`: nodes never wait; a global arrives when it arrives and is installed at a "
        "later boundary (deltas about one outer step stale); streaming fragments need it.",
    )
    min_deltas: int | None = option(
        None,
        ge=1,
        le=1_000_000,
        help="Master: start an outer step once deltas of this many distinct nodes are pending "
        "(once this many were seen, at most the live ones: not left, heard from within "
        "lease_ttl and 2 x round_timeout, or with sync rounds waiting for the last round's "
        "global); default: `num_nodes` when set, else every live node (1 before any is known).",
    )
    round_timeout: float = option(
        120.0,
        gt=0,
        le=MAX_SECONDS,
        help="Master: start an outer step anyway once the first pending delta has waited "
        "this many seconds for the others.",
    )
    install_at: Literal["boundary", "any"] = option(
        "boundary",
        help="`boundary`: install a new global only at the next inner-loop boundary (right "
        "after the upload), so inner loops are never cut and the optimizer is reset only "
        "there; `any`: at the first step after it arrived.",
    )
    keep_own_progress: bool = option(
        True,
        help="With `install_at: boundary`: a node installing a global that does not contain "
        "its last delta yet keeps that progress (global minus its own pending deltas) instead "
        "of learning it again from an older state; false: install the global exactly.",
    )
    own_progress_scale: float | None = option(
        None,
        gt=0,
        le=1,
        help="With `keep_own_progress`: the fraction of its own not-yet-aggregated deltas a node "
        "keeps on top of a global it installs. Default `outer_lr` (at most 1): about where the "
        "outer step will put the global once it holds them (an eager update); 1: all of it.",
    )
    eval_globals: bool | None = option(
        None,
        help="Master: score every new global on the held-out eval data before publishing it "
        "(event `outer_eval`, `eval_loss` in the metadata); default: when eval is configured.",
    )
    # --- what protects the global (issue 18)
    max_delta_bytes: int | None = option(
        None,
        ge=1,
        help="Master: reject delta files larger than this; default 4 x the model's floating "
        "tensors plus 1 MiB.",
    )
    max_norm_ratio: float = option(
        4.0,
        ge=1,
        le=1e6,
        help="Master: a delta whose L2 norm exceeds this times the median norm of recently "
        "accepted ones (first rounds: this round's lower median) is an outlier.",
    )
    outlier_policy: Literal["reject", "clip", "off"] = option(
        "reject", help="Master: what happens to a norm outlier (`clip`: scaled to the threshold)."
    )
    aggregation: Literal["mean", "trimmed_mean", "median"] = option(
        "mean", help="Master: how a round's contributions combine (coordinate-wise for the others)."
    )
    trimmed_fraction: float = option(
        0.1,
        ge=0,
        lt=0.5,
        help="Master, `trimmed_mean`: the fraction dropped at each end per coordinate.",
    )
    max_staleness: int = option(
        16,
        ge=0,
        le=1_000_000,
        help="Master: reject deltas computed from a global more than this many outer steps "
        "behind the current one.",
    )
    momentum_min_nodes: int = option(
        2,
        ge=1,
        le=1_000_000,
        help="Master: a round averaging fewer distinct nodes than this steps without outer "
        "momentum (plain SGD at outer_lr; the momentum buffer keeps its value), so a thin "
        "round is not amplified by the momentum of the full ones. Default 2: a round of one "
        "node (a round that timed out, a straggler's last delta) gets no momentum.",
    )
    outer_warmup: int = option(
        8,
        ge=0,
        le=1_000_000,
        help="Master: outer steps over which the outer step ramps from plain averaging (outer "
        "lr 1, no momentum) to outer_lr and outer_momentum, linearly: round k of the first "
        "outer_warmup uses lr 1 + t (outer_lr - 1) and momentum t outer_momentum with t = "
        "(k - 1) / outer_warmup. From scratch, early pseudo-gradients are large and disagree; "
        "momentum and a step other than 1 on them slowed the plateau exit (docs/diloco.md). "
        "0: no warm-up.",
    )
    momentum_staleness: Literal["none", "inverse"] = option(
        "none",
        help="Master: `inverse`: a round's outer momentum is outer_momentum / (1 + the mean "
        "staleness of its contributions), so stale (asynchronous) rounds get less momentum "
        "and fresh (sync) rounds all of it; `none`: outer_momentum always.",
    )
    staleness_weighting: Literal["none", "inverse"] = option(
        "none",
        help="Master, `mean`: weight each contribution by 1 / (1 + staleness), renormalised.",
    )
    max_update_ratio: float = option(
        10.0,
        gt=0,
        le=1e6,
        help="Master: refuse (and halt on) an outer step whose update norm exceeds this times "
        "the global's norm.",
    )
    keep_history: int = option(
        5,
        ge=0,
        le=10_000,
        help="Master: outer steps (global and momentum) kept in `<state_dir>/<node_id>/history` "
        "for `speedtronic diloco rollback`.",
    )
    signing_key: str | None = option(
        None,
        secret=True,
        help="Shared secret: deltas and globals carry an HMAC-SHA256; the master rejects "
        "unsigned or wrongly signed deltas and workers refuse unsigned globals. Prefer "
        "$SPEEDTRONIC_DILOCO_KEY.",
    )
    # --- fewer bytes per round (issue 17)
    compression: Literal["none", "bf16", "int8", "int4"] = option(
        "none",
        help="How a node encodes its deltas: `none` (as they are), `bf16`, or blockwise absmax "
        "`int8` / `int4` with error feedback. The master reads any mix.",
    )
    compression_block: int = option(
        256,
        ge=1,
        le=1_048_576,
        help="`int8`/`int4`: elements per quantisation block (one scale each).",
    )
    compression_scales: Literal["fp32", "bf16"] = option(
        "fp32", help="`int8`/`int4`: the dtype of the block scales."
    )
    error_feedback: bool = option(
        True,
        help="Add each upload's quantisation residual to the next delta (kept in checkpoints). "
        "Off: every delta is quantised on its own.",
    )
    global_compression: Literal["none", "bf16"] = option(
        "none",
        help="Master: publish globals as `bf16` (half the download); its own state and the "
        "nodes' models keep their dtype.",
    )
    fragments: int = option(
        1,
        ge=1,
        le=4096,
        help="Streaming DiLoCo: sync the model in this many contiguous fragments, fragment j "
        "every inner_steps steps at offset j * inner_steps / fragments (at most inner_steps).",
    )

    def validate(self) -> None:
        # The node id names the node's files in the store and the repo id is in every log
        # line about the store: a secret put there by mistake would be published.
        for name in ("node_id", "repo_id", "endpoint"):
            value = getattr(self, name)
            secret = self._secret_equal_to(value) if value is not None else None
            if secret is not None:
                raise ConfigError(
                    f"is the same value as {secret}; a secret must not be used here (the value "
                    "is not shown)",
                    name,
                )
        if self.node_id is not None:
            validate_node_id(self.node_id, "node_id")
        if self.enabled and not self.repo_id:
            raise ConfigError("is required when distributed.enabled is true", "repo_id")
        if (self.node_rank is None) != (self.num_nodes is None) and self.num_nodes != 1:
            raise ConfigError("set node_rank and num_nodes together", "node_rank")
        if self.num_nodes is not None and (self.node_rank or 0) >= self.num_nodes:
            raise ConfigError(
                f"must be below num_nodes ({self.num_nodes}), got {self.node_rank}", "node_rank"
            )
        if self.rounds == "sync" and self.fragments > 1:
            raise ConfigError(
                "is sync (the default when unset), but streaming fragments (fragments > 1) "
                "work with async rounds only; set rounds: async or fragments: 1",
                "rounds",
            )
        if self.fragments > self.inner_steps:
            raise ConfigError(
                f"must be at most inner_steps ({self.inner_steps}), got {self.fragments}",
                "fragments",
            )

    def _secret_equal_to(self, value: str) -> str | None:
        """Where a secret equal to ``value`` is configured (a field or its environment
        variable), or None."""
        candidates = {
            "distributed.signing_key": self.signing_key,
            f"${KEY_ENV}": os.environ.get(KEY_ENV),
            "distributed.token": self.token,
            "$HF_TOKEN": os.environ.get("HF_TOKEN"),
        }
        for where, secret in candidates.items():
            if secret and secret.strip() == value.strip():
                return where
        return None


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
