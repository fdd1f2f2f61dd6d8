"""``SpeedtronicConfig``: one strict config per run, from YAML, JSON, a string or a dict.

Core owns the sections below; plugins contribute more through the ``config_sections`` hook
(``distributed`` comes from speedtronic-diloco). Unknown keys fail with their dotted path, and a
section that an uninstalled first-party distribution would provide says what to install.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from speedtronic.config import sections
from speedtronic.config.files import (
    RUN_ALIASES,
    check_plain_data,
    is_file,
    parse_config_text,
    read_mapping,
    set_dotted,
    split_overrides,
)
from speedtronic.config.sections import *  # noqa: F403 (the sections, re-exported)
from speedtronic.config.sections import (
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OOOBackpropConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    ProfileConfig,
    RunConfig,
    SchedulerConfig,
)
from speedtronic.errors import ConfigError, PluginError
from speedtronic.schema import (
    REDACTED,
    build_section,
    coerce,
    section_to_dict,
    suggest_key,
    unknown_key_error,
)

# The sections are public here too: a config is read as speedtronic.config.<Section>.
__all__ = ["REDACTED", *sections.__all__, "SpeedtronicConfig", "check_plain_data"]


CORE_SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "precision": PrecisionConfig,
    "compile": CompileConfig,
    "ooo_backprop": OOOBackpropConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "parallel": ParallelConfig,
    "logging": LoggingConfig,
    "profile": ProfileConfig,
}
TOP_LEVEL_KEYS = ("model", "gradient_checkpointing")


def plugin_sections() -> dict[str, type]:
    """Config sections contributed by the loaded plugins (name -> dataclass)."""
    from speedtronic.plugins import call_each, get_plugin_manager

    sections: dict[str, type] = {}
    owners: dict[str, str] = {}
    # Each implementation is called on its own so that an error can name the plugin.
    for plugin_name, contributed in call_each(get_plugin_manager().hook.config_sections, {}):
        if contributed is None:
            continue
        if not isinstance(contributed, Mapping):
            raise PluginError(
                f"plugin {plugin_name!r}: config_sections must return a mapping, "
                f"got {type(contributed).__name__}"
            )
        for name, cls in contributed.items():
            where = f"plugin {plugin_name!r}: config section {name!r}"
            if name in CORE_SECTIONS or name in TOP_LEVEL_KEYS or name in RUN_ALIASES:
                raise PluginError(f"{where} would redefine a core key")
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                raise PluginError(f"{where} must be a dataclass type, got {cls!r}")
            if name in sections and sections[name] is not cls:
                raise PluginError(f"{where} is also contributed by plugin {owners[name]!r}")
            sections[name] = cls
            owners[name] = plugin_name
    return sections


@dataclass
class SpeedtronicConfig:
    """The validated configuration of one run."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    ooo_backprop: OOOBackpropConfig = dataclasses.field(default_factory=OOOBackpropConfig)
    gradient_checkpointing: bool = False
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    plugins: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Sections contributed by plugins, by name; also reachable as attributes."""

    def __getattr__(self, name: str) -> Any:
        """Plugin sections as attributes: ``config.distributed``."""
        plugins = self.__dict__.get("plugins", {})
        if name in plugins:
            return plugins[name]
        if name.startswith("_"):  # copy/pickle probing for __deepcopy__ and friends
            raise AttributeError(name)
        raise AttributeError(f"SpeedtronicConfig has no section {name!r}" + _provider_hint(name))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Rules across sections (each section checks its own fields); raises ConfigError.
        Runs on construction; call it again after changing sections in place."""
        if self.compile.enabled and self.ooo_backprop.enabled:
            raise ConfigError(
                "compile.enabled and ooo_backprop.enabled cannot both be true: out-of-order "
                "backprop's backward hands work to a queue that is drained outside autograd, "
                "which a compiled graph would not honour; turn one of them off",
                "ooo_backprop.enabled",
            )
        rule = _STRATEGY_RULES.get(self.parallel.strategy)
        if rule is not None:
            rule(self)
        if self.checkpoint.keep_best and not self.eval.configured:
            raise ConfigError(
                "needs an eval loss to compare: set eval.every (and an eval source if the "
                "training data has none held out)",
                "checkpoint.keep_best",
            )
        if self.eval.holdout_fraction and not self.data.text_path:
            raise ConfigError(
                "holds out part of data.text_path, which is not set", "eval.holdout_fraction"
            )

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeedtronicConfig:
        """Validate a root mapping (aliases, core sections, plugin sections)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"the config root must be a mapping, got {type(data).__name__}")
        check_plain_data(data)
        data = dict(data)
        run = data.pop("run", None)
        if run is None:
            run = {}
        if not isinstance(run, Mapping):
            raise ConfigError(f"expected a mapping, got {type(run).__name__}", "run")
        run = dict(run)
        for alias in RUN_ALIASES:
            if alias in data:
                if alias in run:
                    raise ConfigError(f"given both as `{alias}` and `run.{alias}`", alias)
                run[alias] = data.pop(alias)
        extra = plugin_sections()
        known = [*CORE_SECTIONS, *TOP_LEVEL_KEYS, *RUN_ALIASES, *extra]
        for key in data:
            if key not in known:
                hint = _provider_hint(str(key))
                if not hint and not suggest_key(str(key), known):
                    sections = ["model", *CORE_SECTIONS, *extra, "gradient_checkpointing"]
                    hint = f"; the top-level keys are {', '.join(sections)}"
                    absent = [f"{s} ({d})" for s, d in _provided_sections() if s not in extra]
                    if absent:
                        hint += f"; installable: {', '.join(absent)}"
                raise unknown_key_error(str(key), known, "", hint)
        kwargs: dict[str, Any] = {"run": build_section(RunConfig, run, "run")}
        for name, section_cls in CORE_SECTIONS.items():
            if name != "run":
                kwargs[name] = build_section(section_cls, data.get(name), name)
        kwargs["model"] = ModelConfig.from_mapping(data.get("model"))
        try:
            kwargs["gradient_checkpointing"] = coerce(
                data.get("gradient_checkpointing", False), bool
            )
        except ConfigError as exc:
            raise exc.under("gradient_checkpointing") from None
        kwargs["plugins"] = {
            name: build_section(section_cls, data.get(name), name)
            for name, section_cls in extra.items()
        }
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SpeedtronicConfig:
        """Load a YAML file."""
        return cls.from_dict(read_mapping(Path(path), yaml_ok=True))

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> SpeedtronicConfig:
        """Load a JSON file."""
        return cls.from_dict(read_mapping(Path(path), yaml_ok=False))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SpeedtronicConfig:
        """Load a ``.json`` file as JSON and anything else as YAML."""
        path = Path(path)
        return cls.from_dict(read_mapping(path, yaml_ok=path.suffix.lower() != ".json"))

    @classmethod
    def from_string(cls, text: str) -> SpeedtronicConfig:
        """Load a YAML or JSON document given as a string."""
        return cls.from_dict(parse_config_text(text, "<string>", yaml_ok=True))

    @classmethod
    def load(cls, source: Any) -> SpeedtronicConfig:
        """Accept a config, a mapping, a path, or a YAML/JSON string."""
        if isinstance(source, SpeedtronicConfig):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, os.PathLike):
            return cls.from_file(source)
        if isinstance(source, str):
            stripped = source.strip()
            if "\n" in stripped or stripped.startswith(("{", "[")):
                return cls.from_string(source)
            if ":" in stripped and not is_file(stripped):  # `name: x` rather than a path
                return cls.from_string(source)
            return cls.from_file(stripped)
        raise ConfigError(f"cannot load a config from {type(source).__name__}")

    def with_overrides(self, overrides: list[str] | Mapping[str, Any]) -> SpeedtronicConfig:
        """A new config with dotted ``key=value`` overrides applied (values parsed as YAML)."""
        data = self.to_dict()
        items = overrides.items() if isinstance(overrides, Mapping) else split_overrides(overrides)
        for dotted, value in items:
            set_dotted(data, dotted, value)
        return SpeedtronicConfig.from_dict(data)

    # ----------------------------------------------------------------- output
    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        """The config as plain data. ``redact=True`` replaces secrets with ``<redacted>``."""
        out: dict[str, Any] = {"run": section_to_dict(self.run, redact)}
        out["model"] = self.model.to_dict()
        for name in CORE_SECTIONS:
            if name != "run":
                out[name] = section_to_dict(getattr(self, name), redact)
        out["gradient_checkpointing"] = self.gradient_checkpointing
        for name, section in self.plugins.items():
            out[name] = section_to_dict(section, redact)
        return out

    def to_yaml(self, redact: bool = False) -> str:
        """The config as a YAML document (loadable again with :meth:`from_string`)."""
        return yaml.safe_dump(self.to_dict(redact), sort_keys=False)

    def to_json(self, redact: bool = False) -> str:
        """The config as a JSON document (loadable again with :meth:`from_string`)."""
        return json.dumps(self.to_dict(redact), indent=2)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the redacted config (YAML, or JSON for a ``.json`` path) atomically."""
        from speedtronic.checkpoint.fileio import atomic_write_text

        path = Path(path)
        text = self.to_json(redact=True) if path.suffix == ".json" else self.to_yaml(redact=True)
        atomic_write_text(path, text)
        return path

    # ----------------------------------------------------------------- derived
    @property
    def output_dir(self) -> Path:
        """``run.output_dir`` as a path."""
        return Path(self.run.output_dir)

    @property
    def data_seed(self) -> int:
        """The data stream's seed: ``data.seed``, or ``run.seed`` when that is unset."""
        return self.data.seed if self.data.seed is not None else self.run.seed

    @property
    def metrics_file(self) -> Path | None:
        """Where the JSONL metrics go: ``logging.json_file``, ``<output_dir>/metrics.jsonl``
        when that is unset, None when it is ``""``."""
        if self.logging.json_file is None:
            return self.output_dir / "metrics.jsonl"
        return Path(self.logging.json_file) if self.logging.json_file else None

    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints go: ``checkpoint.directory`` or ``<output_dir>/checkpoints``."""
        if self.checkpoint.directory:
            return Path(self.checkpoint.directory)
        return self.output_dir / "checkpoints"


def _check_fsdp_combination(config: SpeedtronicConfig) -> None:
    """What ``parallel.strategy: fsdp`` cannot train with, refused before anything is built."""
    if config.ooo_backprop.enabled:
        raise ConfigError(
            "cannot be combined with parallel.strategy fsdp: FSDP reduce-scatters gradients "
            "in autograd hooks that deferred weight-gradient products bypass; turn one off",
            "ooo_backprop.enabled",
        )
    if config.optimizer.name == "muon":
        raise ConfigError(
            "muon cannot be used with parallel.strategy fsdp: Muon orthogonalises whole "
            "matrices, and each rank holds only a shard of them; use adamw or ddp",
            "optimizer.name",
        )


# What each built-in parallel strategy cannot train with, checked before anything is built.
_STRATEGY_RULES = {"fsdp": _check_fsdp_combination}


def _provided_sections() -> list[tuple[str, str]]:
    from speedtronic.plugins import PROVIDED_SECTIONS

    return sorted(PROVIDED_SECTIONS.items())


def _provider_hint(key: str) -> str:
    from speedtronic.plugins import missing_provider_hint

    return missing_provider_hint(key)


def __getattr__(name: str) -> Any:
    # Seed-era import path: speedtronic.config.DistributedConfig lives in speedtronic-diloco.
    if name == "DistributedConfig":
        from speedtronic._lazy import import_plugin_attr

        return import_plugin_attr("speedtronic_diloco", "DistributedConfig", "speedtronic-diloco")
    raise AttributeError(f"module 'speedtronic.config' has no attribute {name!r}")
