"""A trained model back from a run, and the tokenizer its text went through.

``speedtronic export`` and ``speedtronic generate`` both start here: :func:`load_trained_model`
builds the configured model (through the ``build_model`` hook) and loads weights into it from a
checkpoint (``latest``, ``best`` or a path) or, with ``use_global``, from a plugin that owns a
multi-node run's shared store (the ``load_global_state`` hook). :func:`run_tokenizer` works out
how the run turned text into ids, from the ``data`` section alone:

- ``data.shards``: the tokenizer named in the shards' ``index.json`` (``bytes``, or a
  ``tokenizer.json`` found next to ``index.json`` or given explicitly, checked against the
  sha256 the index records);
- ``data.text_path``: UTF-8 bytes (core's default text tokenizer);
- neither: the synthetic stream, whose ids are read as bytes when the vocabulary holds them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedtronic.checkpoint import CheckpointManager, LoadedCheckpoint, step_of
from speedtronic.config import SpeedtronicConfig
from speedtronic.errors import CheckpointError, DataError, PluginError

__all__ = [
    "BYTES",
    "RunTokenizer",
    "TrainedModel",
    "load_trained_model",
    "non_finite_tensors",
    "read_checkpoint",
    "run_tokenizer",
]

log = logging.getLogger("speedtronic.inference")

BYTES = "bytes"
_TOKENIZER_FILE = "tokenizer.json"


@dataclass
class TrainedModel:
    """A model with trained weights loaded, in eval mode, and where they came from."""

    model: Any
    source: str
    step: int | None = None


def read_checkpoint(config: SpeedtronicConfig, which: str = "latest") -> LoadedCheckpoint:
    """The checkpoint ``which`` names: ``latest`` (the run's newest usable one), ``best`` (the
    one ``best.json`` names, kept by runs that evaluate), the path of one ``step_NNNNNNNN``
    directory, or of a checkpoint directory (its newest checkpoint). Verified against its
    manifest; raises :class:`CheckpointError` naming what is missing."""
    from speedtronic.engine.state_checks import check_trainer_state

    manager = CheckpointManager(config.checkpoint_dir)
    if which not in ("latest", "best"):
        path = Path(which).expanduser()
        if not path.exists():
            raise CheckpointError(
                f"--checkpoint {which}: no such checkpoint (give latest, best, a "
                "step_NNNNNNNN directory or a directory holding them)"
            )
        if path.is_dir() and step_of(path.name) is None:
            manager, which = CheckpointManager(path), "latest"
        else:
            which = str(path)
    try:
        return manager.load(which, check_trainer_state)
    except CheckpointError as exc:
        if which == "latest" and not manager.candidates():
            raise CheckpointError(
                f"{exc}: train first (speedtronic train --config ...), or give --checkpoint PATH"
            ) from None
        raise


def load_trained_model(
    config: SpeedtronicConfig,
    checkpoint: str = "latest",
    *,
    use_global: bool = False,
    device: Any = None,
) -> TrainedModel:
    """Build ``config``'s model and load trained weights into it (see :func:`read_checkpoint`;
    ``use_global`` asks the ``load_global_state`` hook instead). The model is returned in eval
    mode, on ``device`` (default: the CPU)."""
    from speedtronic.plugins import get_plugin_manager
    from speedtronic.registry import build_model_from_hook

    step: int | None = None
    if use_global:
        model = build_model_from_hook(config.model.name, **config.model.params)
        state = get_plugin_manager().hook.load_global_state(config=config, model=model)
        if state is None:
            raise PluginError(
                "--global: no plugin provides the global weights of this run (the DumbDiLoCo "
                "plugin of speedtronic-diloco answers for a config with a `distributed` "
                "section); use --checkpoint instead"
            )
        source = "the global weights"
    else:
        loaded = read_checkpoint(config, checkpoint)  # a missing one fails before the model
        state, source, step = loaded.state["model"], f"checkpoint {loaded.path}", loaded.step
        model = build_model_from_hook(config.model.name, **config.model.params)
    from speedtronic.engine.state_checks import state_mismatch

    mismatch = state_mismatch(model.state_dict(), state)
    if mismatch:
        raise CheckpointError(
            f"{source} does not fit model {config.model.name!r} of this config ({mismatch})"
        )
    model.load_state_dict(state)
    broken = non_finite_tensors(model)
    if broken:
        raise CheckpointError(
            f"{source} holds NaN or infinite weights (in the model's dtype) in "
            f"{', '.join(broken[:4])}{' and more' if len(broken) > 4 else ''}: the run diverged "
            "or the file was damaged; use an earlier checkpoint (--checkpoint PATH)"
        )
    if device is not None:
        model = model.to(device)
    model.eval()
    return TrainedModel(model=model, source=source, step=step)


def non_finite_tensors(model: Any) -> list[str]:
    """The names of ``model``'s floating parameters holding NaN or infinity (read after
    loading, so in the model's own dtype: float64 1e300 in a float32 model is infinite).
    Buffers are left alone: a mask buffer may hold -inf by design."""
    import torch

    return [
        name
        for name, tensor in model.named_parameters()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]


@dataclass(frozen=True)
class RunTokenizer:
    """How a run's text became token ids.

    ``kind`` is ``bytes`` (UTF-8 bytes are ids 0-255), ``tokenizers`` (a ``tokenizer.json``:
    ``path`` when it was found, else ``None`` and ``note`` says what is missing) or
    ``synthetic`` (no text at all; read as bytes where possible). ``eos_id`` is the end-of-text
    id the data used, if any.
    """

    kind: str
    path: Path | None = None
    eos_id: int | None = None
    name: str = ""
    note: str = ""

    def codec(self, vocab_size: int | None = None) -> Any:
        """The :class:`~speedtronic.inference.generation.TextCodec` that encodes prompts and decodes
        samples the way the run did; :class:`DataError` when the tokenizer file is missing."""
        from speedtronic.inference.generation import ByteCodec, TokenizerCodec

        if self.kind == "tokenizers":
            if self.path is None:
                raise DataError(f"{self.note}; give it with --tokenizer PATH")
            return TokenizerCodec(self.path, self.eos_id)
        return ByteCodec(vocab_size, self.eos_id)


def run_tokenizer(config: SpeedtronicConfig, override: str | None = None) -> RunTokenizer:
    """The tokenizer of ``config``'s data (see the module); ``override`` (``bytes`` or the
    path of a ``tokenizer.json`` or a folder holding one) replaces what the config implies."""
    if override is not None:
        return _explicit_tokenizer(config, override)
    if config.data.shards:
        from speedtronic.data import read_index

        index = read_index(config.data.shards)
        described = index.tokenizer
        if described.get("kind", BYTES) == BYTES:
            return RunTokenizer(BYTES, eos_id=index.eos_id, name=BYTES)
        name = str(described.get("name", _TOKENIZER_FILE))
        candidate = Path(config.data.shards) / _TOKENIZER_FILE
        expected = described.get("sha256")
        if candidate.is_file() and _sha256(candidate) == expected:
            return RunTokenizer("tokenizers", candidate, index.eos_id, name)
        return RunTokenizer(
            "tokenizers",
            None,
            index.eos_id,
            name,
            note=f"the run's tokenizer {name} (sha256 {str(expected)[:12]}...) is not in "
            f"{config.data.shards}",
        )
    if config.data.text_path:
        return RunTokenizer(BYTES, name=BYTES, note="UTF-8 bytes (core's text tokenizer)")
    return RunTokenizer(
        "synthetic", name="synthetic", note="trained on the synthetic stream: ids read as bytes"
    )


def _explicit_tokenizer(config: SpeedtronicConfig, override: str) -> RunTokenizer:
    if override == BYTES:
        eos = None
        if config.data.shards:
            from speedtronic.data import read_index

            eos = read_index(config.data.shards).eos_id
        return RunTokenizer(BYTES, eos_id=eos, name=BYTES)
    from speedtronic.data.encoders import load_encoder_spec

    path = Path(override).expanduser()
    if path.is_dir():
        path = path / _TOKENIZER_FILE
    spec = load_encoder_spec(path, append_eos=False)  # DataError naming the file when unusable
    eos = spec.eos_id
    if config.data.shards:
        from speedtronic.data import read_index

        index = read_index(config.data.shards)
        recorded = index.tokenizer.get("sha256")
        if recorded and recorded != spec.sha256:
            log.warning(
                "--tokenizer %s is not the tokenizer the shards in %s were prepared with "
                "(sha256 differs)",
                path,
                config.data.shards,
            )
        elif index.eos_id is not None:
            eos = index.eos_id
    return RunTokenizer("tokenizers", path, eos, spec.name)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
