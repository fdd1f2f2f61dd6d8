"""What a trainer state (the tree of a checkpoint, ``format`` :data:`STATE_FORMAT`) must hold
before it is trusted, and why a saved model state does not fit a model."""

from __future__ import annotations

from typing import Any

from speedtronic.errors import CheckpointError

__all__ = ["STATE_FORMAT", "check_trainer_state", "state_mismatch"]

STATE_FORMAT = 1


# What a trainer state must hold to be resumed; anything else is a corrupt checkpoint.
_STATE_INTS = ("step", "samples_seen", "tokens_seen")
_STATE_MAPPINGS = ("model", "optimizer", "scheduler", "rng")
_RNG_KEYS = ("python", "numpy", "torch")


def check_trainer_state(state: Any) -> None:
    """Raise :class:`CheckpointError` unless ``state`` has the shape :meth:`Trainer.state_dict`
    writes (a decoded checkpoint can still be tampered with consistently)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"the trainer state is a {type(state).__name__}, not a mapping")
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(
            f"unsupported trainer state format {state.get('format')!r} "
            f"(this version reads {STATE_FORMAT})"
        )
    for key in _STATE_INTS:
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"the trainer state's {key!r} is not a count: {value!r:.40}")
    for key in _STATE_MAPPINGS:
        if not isinstance(state.get(key), dict):
            raise CheckpointError(f"the trainer state has no {key!r} mapping")
    missing = [key for key in _RNG_KEYS if key not in state["rng"]]
    if missing:
        raise CheckpointError(f"the trainer state's rng lacks {missing}")


def state_mismatch(expected: dict[str, Any], saved: Any, shown: int = 4) -> str:
    """Why ``saved`` (a state dict) cannot load into a model whose state dict is ``expected``:
    each tensor whose shape differs, with both shapes, then missing and unexpected names (the
    first few, then a count); ``""`` when it fits."""
    if not isinstance(saved, dict):
        return f"the saved model state is a {type(saved).__name__}"
    problems: list[str] = []
    shapes = [
        f"{name}: checkpoint {list(saved[name].shape)} vs model {list(tensor.shape)}"
        for name, tensor in expected.items()
        if name in saved
        and hasattr(saved[name], "shape")
        and tuple(saved[name].shape) != tuple(tensor.shape)
    ]
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    for label, items in (
        ("shape mismatch", shapes),
        ("missing in the checkpoint", missing),
        ("not in this model", unexpected),
    ):
        if items:
            more = f" and {len(items) - shown} more" if len(items) > shown else ""
            problems.append(f"{label}: {'; '.join(items[:shown])}{more}")
    if problems:
        problems.append("was model.* changed?")
    return "; ".join(problems)
