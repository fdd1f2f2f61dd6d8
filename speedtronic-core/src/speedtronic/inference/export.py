"""``speedtronic export``: a trained model as a folder other tools load.

:func:`export_run` loads the trained weights (:func:`speedtronic.inference.load_trained_model`),
casts them to the requested dtype, and asks the ``export_model`` hook to write the model in the
requested format into a staging folder next to the destination. For the ``hf`` format core
then adds the tokenizer files (the run's ``tokenizer.json``, or a byte-level one when the run
read UTF-8 bytes) and a ``README.md`` saying where the weights came from. Only when all of it
is written and flushed is the staging folder renamed into place, so a failed export leaves
nothing half-written, and a non-empty destination is replaced only with ``force``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedtronic.checkpoint.fileio import fsync_dir, fsync_file
from speedtronic.config import SpeedtronicConfig
from speedtronic.errors import DataError, PluginError, SpeedtronicError
from speedtronic.inference import BYTES, RunTokenizer, load_trained_model, run_tokenizer

__all__ = [
    "BYTE_EOS_TOKEN",
    "DTYPES",
    "FORMATS",
    "ExportError",
    "ExportResult",
    "byte_level_tokenizer_json",
    "export_run",
]

log = logging.getLogger("speedtronic.export")

FORMATS = ("hf",)
# --dtype names -> torch dtype names (torch imported late: the CLI parser stays light).
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
BYTE_EOS_TOKEN = "<|endoftext|>"


class ExportError(SpeedtronicError):
    """The export destination cannot be written (or would overwrite something)."""


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_run` wrote."""

    directory: Path
    description: str
    source: str
    dtype: str
    tokenizer: str


def export_run(
    config: SpeedtronicConfig,
    out: str | os.PathLike[str],
    *,
    format: str = "hf",
    checkpoint: str = "latest",
    use_global: bool = False,
    dtype: str | None = None,
    force: bool = False,
    tokenizer: str | None = None,
) -> ExportResult:
    """Export the trained model of ``config`` to ``out`` (see the module).

    ``dtype`` is ``bf16``, ``fp16``, ``fp32`` or ``None`` (the weights' own dtype);
    ``tokenizer`` overrides the tokenizer the data section implies (``bytes`` or a path).
    """
    if format not in FORMATS:
        raise ExportError(f"--format {format!r} is not supported (formats: {', '.join(FORMATS)})")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    destination = Path(out).expanduser()
    _check_destination(destination, force)
    import torch

    from speedtronic.plugins import get_plugin_manager

    trained = load_trained_model(config, checkpoint, use_global=use_global)
    model = trained.model
    if dtype is not None:
        model = model.to(getattr(torch, DTYPES[dtype]))
    weights_dtype = _weights_dtype(model)
    run_tok = _tokenizer_for_export(config, tokenizer)
    info = {
        "dtype": weights_dtype,
        "eos_token_id": run_tok.eos_id,
        "bos_token_id": None,
        "tokenizer": run_tok.kind,
    }
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent)
    )
    try:
        description = get_plugin_manager().hook.export_model(
            model=model, config=config, format=format, directory=staging, info=info
        )
        if description is None:
            raise PluginError(
                f"no plugin exports model {config.model.name!r} ({type(model).__name__}) to "
                f"format {format!r}; a model plugin adds one with the export_model hook "
                "(docs/hooks.md)"
            )
        vocab_size = getattr(model, "vocab_size", None)
        tokenizer_note = _write_tokenizer(staging, run_tok, vocab_size, _max_len(model))
        _write_readme(staging, config, trained.source, trained.step, weights_dtype, tokenizer_note)
        _publishable(staging)
        for path in staging.rglob("*"):
            if path.is_file():
                fsync_file(path)
        fsync_dir(staging)
        _move_into_place(staging, destination, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("exported %s from %s to %s", description, trained.source, destination)
    return ExportResult(
        destination, str(description), trained.source, weights_dtype, tokenizer_note
    )


def _check_destination(destination: Path, force: bool) -> None:
    if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
        raise ExportError(f"--out {destination} exists and is not a folder")
    ancestor = destination.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():  # found now, not after the weights are loaded
        raise ExportError(f"--out {destination}: {ancestor} is not a folder")
    if destination.is_dir() and any(destination.iterdir()) and not force:
        raise ExportError(
            f"--out {destination} is not empty; pass --force to replace it (or pick a new folder)"
        )


def _move_into_place(staging: Path, destination: Path, force: bool) -> None:
    if destination.is_dir() and any(destination.iterdir()):
        if not force:  # appeared while we were exporting
            raise ExportError(f"--out {destination} is not empty; pass --force to replace it")
        parked = Path(
            tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".old", dir=destination.parent)
        )
        os.replace(destination, parked / "previous")
        os.replace(staging, destination)
        fsync_dir(destination.parent)
        shutil.rmtree(parked, ignore_errors=True)
        return
    # rename(2) replaces an empty folder atomically.
    os.replace(staging, destination)
    fsync_dir(destination.parent)


def _publishable(folder: Path) -> None:
    """Readable by everyone (755/644), not owner-only like the temp directory it starts as."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _weights_dtype(model: Any) -> str:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return str(parameter.dtype).removeprefix("torch.")
    return "float32"


def _max_len(model: Any) -> int | None:
    value = getattr(model, "max_seq_len", None)
    return value if isinstance(value, int) else None


def _tokenizer_for_export(config: SpeedtronicConfig, override: str | None) -> RunTokenizer:
    try:
        return run_tokenizer(config, override)
    except DataError as exc:
        if override is not None:
            raise
        log.warning("cannot tell which tokenizer the run used (%s); exporting without one", exc)
        return RunTokenizer("unknown", note=f"the run's tokenizer is unknown ({exc})")


# ---------------------------------------------------------------- tokenizer files


def _write_tokenizer(
    folder: Path, tokenizer: RunTokenizer, vocab_size: int | None, max_len: int | None
) -> str:
    """Write the Hugging Face tokenizer files for the run's tokenizer; returns a one-line note
    for the README (and the CLI)."""
    if tokenizer.kind == "tokenizers":
        if tokenizer.path is None:
            log.warning("%s: exporting without tokenizer files", tokenizer.note)
            return f"{tokenizer.note}: copy it here as tokenizer.json"
        shutil.copyfile(tokenizer.path, folder / "tokenizer.json")
        eos = _token_text(tokenizer.path, tokenizer.eos_id)
        _tokenizer_config(folder, eos, max_len)
        return f"tokenizer.json of the run ({tokenizer.name})"
    if tokenizer.kind in (BYTES, "synthetic") and vocab_size is not None and vocab_size >= 256:
        eos_id = tokenizer.eos_id
        if eos_id is not None and eos_id < 256:
            eos_id = None  # a byte cannot double as the end of text
        text = json.dumps(byte_level_tokenizer_json(eos_id), ensure_ascii=False, indent=1)
        (folder / "tokenizer.json").write_text(text + "\n", encoding="utf-8")
        _tokenizer_config(folder, BYTE_EOS_TOKEN if eos_id is not None else None, max_len)
        what = "byte-level: ids 0-255 are UTF-8 bytes" + (
            f", {eos_id} is {BYTE_EOS_TOKEN}" if eos_id is not None else ""
        )
        if tokenizer.kind == "synthetic":
            what += " (the run trained on the synthetic stream, not on text)"
        return what
    if tokenizer.kind == "synthetic":
        return (
            f"no tokenizer: the run trained on the synthetic stream (vocabulary {vocab_size}, "
            "too small for bytes)"
        )
    return tokenizer.note or "no tokenizer"


def _tokenizer_config(folder: Path, eos_token: str | None, max_len: int | None) -> None:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len or 1_000_000_000,
    }
    special = {}
    if eos_token is not None:
        config["eos_token"] = special["eos_token"] = eos_token
    _write_json(folder / "tokenizer_config.json", config)
    _write_json(folder / "special_tokens_map.json", special)


def _token_text(path: Path, token_id: int | None) -> str | None:
    """The text of ``token_id`` in a ``tokenizer.json`` (added tokens first, then the vocab)."""
    if token_id is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for token in data.get("added_tokens") or []:
        if isinstance(token, dict) and token.get("id") == token_id:
            return token.get("content")
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        return next((text for text, i in vocab.items() if i == token_id), None)
    return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what byte-level BPE vocabularies
    and the ``ByteLevel`` pre-tokenizer use)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def byte_level_tokenizer_json(eos_id: int | None = None) -> dict[str, Any]:
    """A ``tokenizer.json`` whose ids are UTF-8 bytes (byte ``b`` is id ``b``), so
    ``AutoTokenizer.from_pretrained`` reads text the way Speedtronic's byte tokenizer does;
    ``eos_id`` adds :data:`BYTE_EOS_TOKEN` as a special token."""
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    added = []
    if eos_id is not None:
        added.append(
            {
                "id": eos_id,
                "content": BYTE_EOS_TOKEN,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {char: byte for byte, char in sorted(_bytes_to_unicode().items())},
            "merges": [],
        },
    }


def _write_readme(
    folder: Path,
    config: SpeedtronicConfig,
    source: str,
    step: int | None,
    dtype: str,
    tokenizer_note: str,
) -> None:
    if (folder / "README.md").exists():
        return
    at_step = f" at step {step}" if step is not None else ""
    lines = [
        f"# {config.run.name or 'speedtronic model'}",
        "",
        f"Exported by `speedtronic export` from {source}{at_step}.",
        "",
        f"- model: `{config.model.name}`",
        f"- weights: {dtype}",
        f"- tokenizer: {tokenizer_note}",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")',
        "```",
        "",
    ]
    (folder / "README.md").write_text("\n".join(lines), encoding="utf-8")


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
