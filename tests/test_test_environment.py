"""The test path installs every optional piece the suite exercises, so no test that uses one
is silently skipped: `pytest.importorskip` in a test is for a developer's partial install."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(
    "module",
    ["transformers", "tokenizers", "pyarrow", "wandb", "tensorboard", "hypothesis", "fcntl"],
)
def test_the_optional_dependencies_of_the_suite_are_installed(module: str) -> None:
    importlib.import_module(module)
