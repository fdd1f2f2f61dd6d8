"""The reference transformer in the Hugging Face Llama format, both ways.

:func:`write_llama` writes ``config.json`` (a ``LlamaConfig``), ``model.safetensors`` with
Hugging Face tensor names and ``generation_config.json``, so
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it with no custom code;
:func:`load_llama` reads such a folder (local only) back into a reference model.

The two layouts differ in three ways, all converted here:

- the fused ``attn.qkv`` projection is Llama's ``q_proj``, ``k_proj`` and ``v_proj`` stacked
  along the output rows (query heads, then key heads, then value heads), and ``mlp.gate_up``
  is ``gate_proj`` over ``up_proj``: split on export, concatenated on import;
- the output head *is* the embedding (``tie_word_embeddings: true``), so there is no
  ``lm_head.weight``;
- rotary pairs. Both rotate channel ``i`` of a head with channel ``i + head_dim / 2``
  (``rotary.apply_rotary`` chunks in halves exactly as Llama's ``rotate_half`` does), with the
  same frequencies ``theta ** (-2i / head_dim)``, so the query and key rows need no
  permutation. (Checkpoints in Meta's original layout pair ``(2i, 2i + 1)`` instead, which is
  why Hugging Face's own conversion script permutes them; a test compares logits with
  transformers' Llama to keep this true.)

The reference model has no biases and its dropouts have no Llama counterpart (Llama has
attention dropout only); both are irrelevant to inference and left out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from speedtronic import ConfigError
from speedtronic.checkpoint.fileio import read_regular, regular_file_problem
from speedtronic_models.config import TransformerConfig

__all__ = [
    "CONFIG_FILE",
    "GENERATION_CONFIG_FILE",
    "WEIGHTS_FILE",
    "LlamaLayout",
    "from_hf_state_dict",
    "llama_config",
    "load_llama",
    "to_hf_state_dict",
    "write_llama",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WHERE = "model.init_from"


class LlamaLayout(Protocol):
    """What export and import read of a reference model: its config, the token embedding,
    the final norm and the blocks (each with ``attn_norm``, ``attn.qkv``, ``attn.out``,
    ``mlp_norm``, ``mlp.gate_up``, ``mlp.down``).

    A structural type, so this module does not import ``model.py`` (which imports this one
    for ``init_from``); :class:`~speedtronic_models.model.ReferenceTransformer` is one.
    """

    config: TransformerConfig
    tok_emb: nn.Embedding
    norm: nn.Module
    blocks: nn.ModuleList

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any: ...


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def llama_config(
    config: TransformerConfig,
    dtype: torch.dtype = torch.float32,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` computing what ``config`` computes.

    Token ids are written even when ``None``: left out, ``LlamaConfig`` would default them to
    1 and 2 and Hugging Face ``generate`` would stop at token 2.
    """
    dtype_name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        # transformers < 5 reads rope_theta; 5 reads rope_parameters (and converts the former).
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "torch_dtype": dtype_name,  # transformers < 5
        "dtype": dtype_name,
    }


def to_hf_state_dict(model: LlamaLayout) -> dict[str, Tensor]:
    """The model's weights under Llama's names, fused projections split (contiguous copies)."""
    config = model.config
    q_rows = config.n_head * config.head_dim
    kv_rows = config.n_kv_head * config.head_dim
    tensors = {
        "model.embed_tokens.weight": model.tok_emb.weight,
        "model.norm.weight": model.norm.weight,
    }
    for index, block in enumerate(model.blocks):
        prefix = f"model.layers.{index}."
        q, k, v = block.attn.qkv.weight.split((q_rows, kv_rows, kv_rows), dim=0)
        gate, up = block.mlp.gate_up.weight.chunk(2, dim=0)
        tensors.update(
            {
                prefix + "input_layernorm.weight": block.attn_norm.weight,
                prefix + "self_attn.q_proj.weight": q,
                prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v,
                prefix + "self_attn.o_proj.weight": block.attn.out.weight,
                prefix + "post_attention_layernorm.weight": block.mlp_norm.weight,
                prefix + "mlp.gate_proj.weight": gate,
                prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": block.mlp.down.weight,
            }
        )
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}


def from_hf_state_dict(tensors: Mapping[str, Tensor], n_layer: int) -> dict[str, Tensor]:
    """A reference-model state dict from Llama-named tensors (the inverse of
    :func:`to_hf_state_dict`). Raises ``KeyError`` naming a missing tensor."""
    state = {
        "tok_emb.weight": tensors["model.embed_tokens.weight"],
        "norm.weight": tensors["model.norm.weight"],
    }
    for index in range(n_layer):
        hf = f"model.layers.{index}."
        ours = f"blocks.{index}."

        def take(name: str, prefix: str = hf) -> Tensor:
            return tensors[prefix + name]

        state[ours + "attn_norm.weight"] = take("input_layernorm.weight")
        state[ours + "attn.qkv.weight"] = torch.cat(
            [take(f"self_attn.{p}_proj.weight") for p in "qkv"], dim=0
        )
        state[ours + "attn.out.weight"] = take("self_attn.o_proj.weight")
        state[ours + "mlp_norm.weight"] = take("post_attention_layernorm.weight")
        state[ours + "mlp.gate_up.weight"] = torch.cat(
            [take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")], dim=0
        )
        state[ours + "mlp.down.weight"] = take("mlp.down_proj.weight")
    return state


def write_llama(
    model: LlamaLayout,
    directory: str | os.PathLike[str],
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> None:
    """Write ``model`` as a Llama folder into ``directory`` (which must exist), in the dtype
    of its weights."""
    directory = Path(directory)
    tensors = to_hf_state_dict(model)
    dtype = model.tok_emb.weight.dtype
    config = llama_config(model.config, dtype, eos_token_id, bos_token_id)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(directory / CONFIG_FILE, config)
    _write_json(
        directory / GENERATION_CONFIG_FILE,
        {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": None},
    )


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- import


def load_llama(model: LlamaLayout, directory: Any) -> None:
    """Load the Llama-format folder ``directory`` (``config.json`` + safetensors weights, local
    only) into ``model``.

    Every way the folder does not fit the model (head counts, widths, vocabulary, an untied
    head, a different rotary base...) is listed in one :class:`speedtronic.ConfigError` at
    ``model.init_from``. A model built on the meta device (``speedtronic validate``) is only
    checked, nothing is read into it.
    """
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise ConfigError(f"must be the path of a local folder, got {directory!r}", WHERE)
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"{folder} is not a local folder (init_from reads a Llama-format folder on this "
            "machine and never downloads: fetch a Hub model first, e.g. "
            "`hf download ORG/NAME --local-dir DIR`, and give DIR)",
            WHERE,
        )
    hf_config = _read_config(folder)
    problems = _mismatches(hf_config, model.config)
    if problems:
        raise ConfigError(
            f"{folder} does not fit this reference_transformer: {'; '.join(problems)}", WHERE
        )
    files = _weight_files(folder)
    shapes = _read_shapes(files)
    problems = _shape_problems(shapes, model)
    if problems:
        raise ConfigError(f"{folder}: {'; '.join(problems)}", WHERE)
    if any(p.is_meta for p in model.parameters()):
        return
    tensors = _read_tensors(files)
    _check_finite(tensors, model.tok_emb.weight.dtype, folder)
    head = tensors.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, tensors["model.embed_tokens.weight"]):
        raise ConfigError(
            f"{folder}: lm_head.weight differs from the embedding (an untied head: the "
            "reference model's output head is its embedding)",
            WHERE,
        )
    model.load_state_dict(from_hf_state_dict(tensors, model.config.n_layer), strict=True)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a value a model config holds")


def _read_json(path: Path, limit: int) -> Any:
    """A JSON file of the folder, bounded by ``limit`` bytes; ``NaN`` and ``Infinity`` (which
    Python's json accepts) are refused: no config value compared here may be one."""
    return json.loads(_read_small(path, limit).decode("utf-8"), parse_constant=_no_constant)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        data = _read_json(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ConfigError(
            f"{folder} has no {CONFIG_FILE}: not a Hugging Face model folder", WHERE
        ) from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: deep nesting
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"cannot read {path}: {reason}", WHERE) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object", WHERE)
    return data


def _mismatches(hf: dict[str, Any], ours: TransformerConfig) -> list[str]:
    """Everything in a Llama ``config.json`` that this model's parameters do not match."""
    found = []
    model_type = hf.get("model_type")
    if model_type != "llama":
        found.append(f"model_type is {model_type!r}, not 'llama'")
    heads = hf.get("num_attention_heads")
    pairs = [
        ("hidden_size", "d_model", ours.d_model),
        ("num_hidden_layers", "n_layer", ours.n_layer),
        ("num_attention_heads", "n_head", ours.n_head),
        ("num_key_value_heads", "n_kv_head", ours.n_kv_head),
        ("intermediate_size", "ffn_hidden", ours.ffn_hidden),
        ("vocab_size", "vocab_size", ours.vocab_size),
    ]
    values = dict(hf)
    values.setdefault("num_key_value_heads", heads)
    for theirs, name, mine in pairs:
        if values.get(theirs) != mine:
            found.append(f"{theirs} {values.get(theirs)!r} != model.{name} {mine}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != ours.head_dim:
        found.append(f"head_dim {head_dim!r} != d_model / n_head = {ours.head_dim}")
    if hf.get("tie_word_embeddings", False) is not True:
        found.append(
            "tie_word_embeddings is not true (an untied lm_head: the reference model's output "
            "head is its embedding)"
        )
    theta = _rope_theta(hf)
    # Written as "not close" so that a NaN (every comparison false) is a mismatch too.
    if theta is None or not abs(theta - ours.rope_theta) <= 1e-6 * ours.rope_theta:
        found.append(f"rope_theta {theta!r} != model.rope_theta {ours.rope_theta}")
    rope_type = _rope_type(hf)
    if rope_type not in (None, "default"):
        found.append(f"rope scaling {rope_type!r} (the reference model has plain rotary only)")
    eps = hf.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or not abs(eps - ours.norm_eps) <= 1e-12:
        found.append(f"rms_norm_eps {eps!r} != model.norm_eps {ours.norm_eps}")
    if hf.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act {hf.get('hidden_act')!r}, not 'silu'")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias):
            found.append(f"{bias} is true (the reference model has no biases)")
    return found


def _rope_theta(hf: dict[str, Any]) -> float | None:
    parameters = hf.get("rope_parameters")
    if isinstance(parameters, dict) and isinstance(parameters.get("rope_theta"), (int, float)):
        return float(parameters["rope_theta"])
    theta = hf.get("rope_theta", 10_000.0)
    return float(theta) if isinstance(theta, (int, float)) else None


def _rope_type(hf: dict[str, Any]) -> str | None:
    for key in ("rope_parameters", "rope_scaling"):
        value = hf.get(key)
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if kind not in (None, "default"):
                return str(kind)
    return None


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: ``model.safetensors`` or the shards its index names."""
    single = folder / WEIGHTS_FILE
    index = folder / WEIGHTS_INDEX_FILE
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = _read_json(index, MAX_INDEX_BYTES)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError(f"cannot read {index}: {reason}", WHERE) from None
        for shard in shards:
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise ConfigError(f"{index} names a shard outside the folder: {shard!r}", WHERE)
            try:
                problem = regular_file_problem(os.stat(folder / shard).st_mode)
            except OSError as exc:
                raise ConfigError(f"cannot read {folder / shard}: {exc.strerror}", WHERE) from None
            if problem is not None:  # a FIFO would hang safetensors' open()
                raise ConfigError(f"{folder / shard} is {problem}", WHERE)
        return [folder / shard for shard in shards]
    pickled = [name for name in ("pytorch_model.bin", "model.pt") if (folder / name).exists()]
    hint = (
        f" ({pickled[0]} is a pickle, which Speedtronic does not load: convert it to safetensors)"
        if pickled
        else ""
    )
    raise ConfigError(f"{folder} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}{hint}", WHERE)


# A Llama config.json is about 1 KiB (configs with large label maps reach a few hundred).
MAX_CONFIG_BYTES = 1 << 20
# A weights index is one line (~80 bytes) per tensor: 16 MiB lists 200,000 tensors.
MAX_INDEX_BYTES = 16 << 20


def _read_small(path: Path, limit: int) -> bytes:
    """A JSON file of the folder: a regular file (a FIFO there would hang us), bounded."""
    raw = read_regular(path, limit)
    if len(raw) > limit:
        raise ValueError(f"larger than {limit >> 20} MiB: not what a model folder holds")
    return raw


def _read_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from the safetensors headers alone (nothing is loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118  (a safe_open handle, not a dict)
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
    except Exception as exc:  # safetensors raises its own error types
        raise ConfigError(f"cannot read {file}: {type(exc).__name__}: {exc}", WHERE) from None
    return shapes


def _read_tensors(files: list[Path]) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    try:
        for file in files:
            tensors.update(load_file(str(file)))
    except Exception as exc:  # safetensors raises its own error types
        raise ConfigError(f"cannot read {file}: {type(exc).__name__}: {exc}", WHERE) from None
    return tensors


def _check_finite(tensors: Mapping[str, Tensor], dtype: torch.dtype, folder: Path) -> None:
    """Refuse weights that are NaN or infinite in the model's dtype (float64 1e300 is finite
    in the file and infinite in a float32 model)."""
    bad = [
        name
        for name, tensor in tensors.items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor.to(dtype)).all())
    ]
    if bad:
        raise ConfigError(
            f"{folder}: non-finite values (NaN or beyond the {str(dtype).removeprefix('torch.')} "
            f"range) in {_short(sorted(bad))}",
            WHERE,
        )


def _shape_problems(shapes: Mapping[str, tuple[int, ...]], model: LlamaLayout) -> list[str]:
    """Missing, unexpected and wrongly shaped tensors, by their Hugging Face names."""
    expected = _expected_shapes(model)
    problems = []
    missing = [name for name in expected if name not in shapes]
    if missing:
        problems.append(f"missing tensors {_short(missing)}")
    extra = [name for name in shapes if name not in expected and not _ignorable(name)]
    if extra:
        problems.append(f"unexpected tensors {_short(extra)}")
    for name, shape in expected.items():
        if name in shapes and tuple(shapes[name]) != shape:
            problems.append(f"{name} has shape {list(shapes[name])}, expected {list(shape)}")
    return problems


def _expected_shapes(model: LlamaLayout) -> dict[str, tuple[int, ...]]:
    config = model.config
    d, hd, hidden = config.d_model, config.head_dim, config.ffn_hidden
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, d),
        "model.norm.weight": (d,),
    }
    for index in range(config.n_layer):
        prefix = f"model.layers.{index}."
        shapes.update(
            {
                prefix + "input_layernorm.weight": (d,),
                prefix + "self_attn.q_proj.weight": (config.n_head * hd, d),
                prefix + "self_attn.k_proj.weight": (config.n_kv_head * hd, d),
                prefix + "self_attn.v_proj.weight": (config.n_kv_head * hd, d),
                prefix + "self_attn.o_proj.weight": (d, config.n_head * hd),
                prefix + "post_attention_layernorm.weight": (d,),
                prefix + "mlp.gate_proj.weight": (hidden, d),
                prefix + "mlp.up_proj.weight": (hidden, d),
                prefix + "mlp.down_proj.weight": (d, hidden),
            }
        )
    return shapes


def _ignorable(name: str) -> bool:
    # A tied head saved anyway (checked equal above) and rotary tables some exporters keep.
    return name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq")


def _short(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
