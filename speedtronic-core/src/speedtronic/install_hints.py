"""How to install a first-party distribution, said the same way everywhere a missing one is
named (a leaf module: the lazy plugin paths and the plugin manager both use it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CORE_DISTRIBUTION", "install_command"]

CORE_DISTRIBUTION = "speedtronic-core"


def _checkout_folder(distribution: str) -> Path | None:
    """The folder of ``distribution`` in a Speedtronic source checkout: the one the working
    directory is in (core may be installed from it without being editable), else the one this
    core runs from; None outside any checkout."""
    here = Path.cwd().resolve()
    for root in (here, *here.parents, Path(__file__).resolve().parents[3]):
        project = root / distribution / "pyproject.toml"
        if not (root / CORE_DISTRIBUTION / "pyproject.toml").is_file() or not project.is_file():
            continue
        try:
            named = f'name = "{distribution}"' in project.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if named:
            return root / distribution
    return None


def install_command(distribution: str, extra: str = "") -> str:
    """How to install a first-party ``distribution`` (with ``extra``, e.g. ``"wandb"``): from
    the source checkout the working directory is in or this core runs from, when there is one
    (the distributions are not on PyPI yet), else by name."""
    suffix = f"[{extra}]" if extra else ""
    by_name = f"pip install '{distribution}{suffix}'" if extra else f"pip install {distribution}"
    folder = _checkout_folder(distribution)
    if folder is None:
        return by_name
    try:
        shown = f"./{folder.relative_to(Path.cwd().resolve())}"
    except ValueError:
        shown = str(folder)
    local = f"pip install '{shown}{suffix}'" if extra else f"pip install {shown}"
    return f"{local} (this source checkout; {by_name} once published)"
