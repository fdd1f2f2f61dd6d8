"""Hugging Face ``transformers`` causal LMs as Speedtronic models: the ``hf_causal_lm`` model.

```yaml
model:
  name: hf_causal_lm
  config: {model_type: llama, hidden_size: 64, num_hidden_layers: 2, ...}  # random init
  # or: pretrained: /local/folder   (weights written by save_pretrained; never downloaded)
```

What is built is the ``transformers`` model itself (``AutoModelForCausalLM``), not a wrapper:
its state dict keys are Hugging Face names (so checkpoints and DiLoCo deltas use them too),
``save_pretrained`` exports it, and core sees a ``PreTrainedModel`` and gives it batches whose
``labels`` equal ``input_ids`` (the model shifts them itself). The adapter only adds plain
attributes: ``max_seq_len``/``vocab_size`` (from ``max_position_embeddings``/``vocab_size``)
for core's data defaults, ``set_gradient_checkpointing`` (through
``gradient_checkpointing_enable``, ``activation_checkpointing_enable`` since transformers 5;
non-reentrant) and ``start_decoding`` (incremental
decoding with the model's own cache, for ``speedtronic generate``).

Nothing here reaches the network: ``pretrained`` must be a local folder, read with
``local_files_only=True``, and remote code is never run. ``transformers`` is imported only when
this model is built (install ``speedtronic-models[transformers]``).
"""

from __future__ import annotations

import difflib
import inspect
import os
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from speedtronic import ConfigError
from speedtronic.batch import shifts_internally
from speedtronic.schema import unknown_key_error

__all__ = [
    "EXTRA",
    "MODEL_NAME",
    "PARAMS",
    "adapt",
    "build_hf_causal_lm",
    "import_transformers",
    "is_checkpointing",
    "is_hf_model",
    "save_hf",
]

MODEL_NAME = "hf_causal_lm"
EXTRA = "pip install 'speedtronic-models[transformers]'"
PARAMS = ("config", "pretrained", "attn_implementation")
SECTION = "model"


def import_transformers() -> Any:
    """``transformers``, or one :class:`ConfigError` saying which extra to install."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            f"model {MODEL_NAME!r} needs the Hugging Face transformers library, which is not "
            f"installed ({exc}): {EXTRA}",
            "model.name",
        ) from None
    return transformers


def build_hf_causal_lm(params: Mapping[str, Any]) -> Any:
    """Build the ``AutoModelForCausalLM`` the ``model`` section describes (see the module)."""
    if not isinstance(params, Mapping):
        raise ConfigError(f"expected a mapping, got {type(params).__name__}", SECTION)
    for key in params:
        if key not in PARAMS:
            raise unknown_key_error(
                str(key), list(PARAMS), SECTION, f" ({MODEL_NAME} takes: {', '.join(PARAMS)})"
            )
    config_params = params.get("config")
    pretrained = params.get("pretrained")
    attn = params.get("attn_implementation", "sdpa")
    if config_params is not None and not isinstance(config_params, Mapping):
        raise ConfigError(
            f"must be a mapping of config fields, got {type(config_params).__name__}",
            "model.config",
        )
    if attn is not None and not isinstance(attn, str):
        raise ConfigError("must be a string such as 'sdpa' or 'eager'", "model.attn_implementation")
    if pretrained is None and config_params is None:
        raise ConfigError(
            f"{MODEL_NAME} needs `config: {{model_type: ..., ...}}` (a new, randomly "
            "initialised model) or `pretrained: /local/folder`",
            "model",
        )
    transformers = import_transformers()
    import torch

    on_meta = torch.empty(()).device.type == "meta"  # speedtronic validate: nothing allocated
    if pretrained is not None:
        folder = _local_folder(pretrained)
        _check_config_file(folder)
        try:
            config = transformers.AutoConfig.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:  # OSError, ValueError, huggingface_hub's validation errors
            raise ConfigError(
                f"{folder} is not a transformers model folder: {_first_line(exc)}",
                "model.pretrained",
            ) from None
        try:
            _apply_overrides(config, dict(config_params or {}))
        except ConfigError:
            raise
        except Exception as exc:  # a value the config class refuses
            raise ConfigError(_first_line(exc), "model.config") from None
        skeleton = _bounded_skeleton(
            transformers, torch, config, attn, "model.pretrained", folder, not on_meta
        )
        if on_meta:
            return adapt(skeleton)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder),
                config=config,
                local_files_only=True,
                trust_remote_code=False,
                attn_implementation=attn,
                **_fp32(transformers, torch),
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot load {folder}: {_first_line(exc)}", "model.pretrained"
            ) from None
    else:
        config = _new_config(transformers, dict(config_params or {}))
        skeleton = _bounded_skeleton(
            transformers, torch, config, attn, "model.config", None, not on_meta
        )
        if on_meta:
            return adapt(skeleton)
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=attn, **_fp32(transformers, torch)
            )
        except (ValueError, RuntimeError, MemoryError) as exc:
            raise ConfigError(_first_line(exc), "model.config") from None
    return adapt(model)


# A config.json is a few KiB; anything much larger is not one.
MAX_CONFIG_BYTES = 16 << 20


def _check_config_file(folder: Path) -> None:
    """The folder's ``config.json``, when there is one, is a regular file of sane size (a FIFO
    would hang the reader, a huge file fill the memory) before transformers reads it."""
    path = folder / "config.json"
    if not os.path.lexists(path):
        return  # transformers names what is missing
    from speedtronic.checkpoint.fileio import read_regular

    try:
        size = len(read_regular(path, MAX_CONFIG_BYTES))
    except OSError as exc:
        raise ConfigError(
            f"cannot read {path}: {exc.strerror or exc}", "model.pretrained"
        ) from None
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a model config",
            "model.pretrained",
        )


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _bounded_skeleton(
    transformers: Any,
    torch: Any,
    config: Any,
    attn: Any,
    where: str,
    folder: Path | None,
    check_memory: bool,
) -> Any:
    """The model ``config`` describes, built on the meta device (no memory): a config whose
    sizes are negative or absurd is one :class:`ConfigError` at ``where`` here and, with
    ``check_memory`` (the model is about to be allocated here, not just validated), one whose
    fp32 weights exceed this machine's memory is refused before anything is allocated."""
    source = f"{folder / 'config.json'}" if folder is not None else "the config"
    try:
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=attn, **_fp32(transformers, torch)
            )
    except Exception as exc:  # negative sizes, wrong types, inconsistent fields
        raise ConfigError(
            f"cannot build a model from {source}: {_first_line(exc)}", where
        ) from None
    count = sum(parameter.numel() for parameter in skeleton.parameters())
    need, memory = 4 * count, _physical_memory() if check_memory else None
    if memory is not None and need > memory:
        raise ConfigError(
            f"{source} describes a model of {count:,} parameters ({need / 2**30:,.1f} GiB of "
            f"fp32 weights), more than this machine's memory ({memory / 2**30:,.1f} GiB)",
            where,
        )
    return skeleton


def _fp32(transformers: Any, torch: Any) -> dict[str, Any]:
    """fp32 weights whatever the folder's dtype: ``dtype=`` since transformers 4.56,
    ``torch_dtype=`` before."""
    try:
        major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    except ValueError:
        major, minor = 5, 0
    keyword = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return {keyword: torch.float32}


def adapt(model: Any) -> Any:
    """Give a ``transformers`` causal LM what core and ``speedtronic generate`` look for."""
    config = model.config
    max_len = getattr(config, "max_position_embeddings", None)
    if isinstance(max_len, int):
        model.max_seq_len = max_len
    if isinstance(getattr(config, "vocab_size", None), int):
        model.vocab_size = config.vocab_size
    # A training forward should not build a KV cache it never reads (start_decoding asks for
    # one explicitly); save_hf writes the original setting back into the exported config.
    model.speedtronic_use_cache = getattr(config, "use_cache", None)
    if model.speedtronic_use_cache is not None:
        config.use_cache = False
    # Bound methods (not closures): copy.deepcopy(model) then binds them to the copy.
    model.set_gradient_checkpointing = types.MethodType(_set_gradient_checkpointing, model)
    model.start_decoding = types.MethodType(_start_decoding, model)
    return model


def is_hf_model(model: Any) -> bool:
    """True for a ``transformers.PreTrainedModel`` (by class name: no import needed)."""
    return shifts_internally(model)


def save_hf(model: Any, directory: str | os.PathLike[str]) -> None:
    """``save_pretrained`` into ``directory``: config, safetensors weights, generation config."""
    saved = getattr(model, "speedtronic_use_cache", None)
    if saved is None:
        model.save_pretrained(str(directory))
        return
    model.config.use_cache = saved
    try:
        model.save_pretrained(str(directory))
    finally:
        model.config.use_cache = False


def _set_gradient_checkpointing(model: Any, enabled: bool) -> None:
    # transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    if hasattr(model, "activation_checkpointing_enable"):
        if enabled:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            model.activation_checkpointing_disable()
    elif enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def is_checkpointing(model: Any) -> bool:
    """Whether the model recomputes activations in backward (either transformers name)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag)


def _start_decoding(model: Any) -> Callable[[Any], Any]:
    """Incremental decoding with the model's own cache: ``step(input_ids) -> logits``.

    The cache keyword is ``cache`` in transformers 5 and ``past_key_values`` before."""
    names = inspect.signature(model.forward).parameters
    keyword = "cache" if "cache" in names else "past_key_values"
    state: dict[str, Any] = {"cache": None}

    def step(input_ids: Any) -> Any:
        kwargs = {keyword: state["cache"]} if state["cache"] is not None else {}
        output = model(input_ids=input_ids, use_cache=True, **kwargs)
        cache = getattr(output, keyword, None)
        state["cache"] = cache if cache is not None else getattr(output, "past_key_values", None)
        return output.logits

    return step


def _local_folder(pretrained: Any) -> Path:
    if not isinstance(pretrained, (str, os.PathLike)) or not str(pretrained):
        raise ConfigError(
            f"must be the path of a local folder, got {pretrained!r}", "model.pretrained"
        )
    folder = Path(pretrained).expanduser()
    if folder.is_dir():
        return folder
    looks_like_hub_id = not folder.is_absolute() and str(pretrained).count("/") == 1
    what = (
        "a Hugging Face Hub id, not a local folder" if looks_like_hub_id else "not a local folder"
    )
    raise ConfigError(
        f"{pretrained!r} is {what}. Speedtronic never downloads models: fetch it first "
        f"(e.g. `hf download {pretrained} --local-dir models/NAME`) and set "
        "model.pretrained to that folder",
        "model.pretrained",
    )


def _new_config(transformers: Any, fields: dict[str, Any]) -> Any:
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(
            "required: the transformers architecture, e.g. llama, gpt2, mistral, qwen2",
            "model.config.model_type",
        )
    mapping = transformers.CONFIG_MAPPING
    if model_type not in mapping:
        close = difflib.get_close_matches(model_type, list(mapping.keys()), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ConfigError(
            f"unknown transformers model_type {model_type!r}{hint}", "model.config.model_type"
        )
    config_class = mapping[model_type]
    _check_fields(config_class, fields, model_type)
    try:
        return config_class(**fields)
    except Exception as exc:  # TypeError, ValueError, huggingface_hub's validation errors
        raise ConfigError(_first_line(exc), "model.config") from None


def _apply_overrides(config: Any, fields: dict[str, Any]) -> None:
    """``config:`` next to ``pretrained:`` changes fields of the loaded config (dropout...)."""
    model_type = fields.pop("model_type", config.model_type)
    if model_type != config.model_type:
        raise ConfigError(
            f"is {model_type!r} but the pretrained folder holds a {config.model_type!r} model",
            "model.config.model_type",
        )
    _check_fields(type(config), fields, config.model_type)
    for key, value in fields.items():
        setattr(config, key, value)


def _check_fields(config_class: Any, fields: Mapping[str, Any], model_type: str) -> None:
    """A typo in a config field is an error (transformers would keep it as a silent extra)."""
    try:
        known = set(config_class().to_dict())
    except Exception:  # a config that cannot be built without arguments: trust transformers
        return
    known |= set(getattr(config_class, "attribute_map", {}))
    try:
        known |= set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    except (TypeError, ValueError):
        pass
    for key in fields:
        if key not in known:
            raise unknown_key_error(
                str(key),
                sorted(known),
                "model.config",
                f" (not a field of the {model_type} config)",
            )


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    # "Validation error for field 'x':" says what is wrong on the next line.
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
