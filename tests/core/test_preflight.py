"""Errors the config and its files decide alone come before the model is built, and, for
``train``, before torch is imported. The model here leaves a marker file when it is built, so
the order is checked without timing anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from speedtronic.data import prepare

MARKER_MODEL = """
import os
from pathlib import Path

import torch


class Tiny(torch.nn.Module):
    vocab_size = 256
    max_seq_len = 8

    def __init__(self):
        super().__init__()
        Path(os.environ["MARKER"]).write_text("built")
        self.emb = torch.nn.Embedding(256, 4)

    def forward(self, input_ids, labels=None):
        return self.emb(input_ids).sum()
"""

# Runs one command in a fresh interpreter and reports its exit code and whether torch was
# imported by then.
PROBE = """
import json, sys
from speedtronic.cli import main
code = main(sys.argv[1:])
print(json.dumps({"rc": code, "torch": "torch" in sys.modules}))
"""


@pytest.fixture
def run(tmp_path: Path):
    (tmp_path / "marker_model.py").write_text(textwrap.dedent(MARKER_MODEL))
    marker = tmp_path / "built.txt"

    def run(config: dict[str, Any], *args: str) -> tuple[dict[str, Any], str]:
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {
            **os.environ,
            "MARKER": str(marker),
            "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run(
            [sys.executable, "-c", PROBE, *args, "--config", str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        assert not marker.exists(), "the model was built before the error"
        return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr

    return run


def config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    return {
        "run": {"device": "cpu", "max_steps": 2, "output_dir": str(tmp_path / "out")},
        "model": {"name": "marker_model:Tiny"},
        **sections,
    }


def test_a_fresh_run_into_a_directory_with_checkpoints_fails_before_torch(
    tmp_path: Path, run
) -> None:
    (tmp_path / "out" / "checkpoints" / "step_00000007").mkdir(parents=True)
    result, stderr = run(config(tmp_path), "train")
    assert result == {"rc": 2, "torch": False}
    assert "already holds checkpoints (up to step_00000007)" in stderr
    assert "--resume" in stderr


def test_a_missing_text_file_fails_before_torch(tmp_path: Path, run) -> None:
    missing = tmp_path / "no-such.txt"
    result, stderr = run(config(tmp_path, data={"text_path": str(missing)}), "train")
    assert result == {"rc": 2, "torch": False}
    assert f"error: data.text_path: file not found: {missing}" in stderr


def test_shards_without_an_eval_split_fail_before_torch_and_say_how_to_make_one(
    tmp_path: Path, run
) -> None:
    corpus = tmp_path / "book.txt"
    corpus.write_text("It is a truth universally acknowledged. " * 50)
    prepare([corpus], tmp_path / "shards", eval_fraction=0.0, progress=False)
    sections = {"data": {"shards": str(tmp_path / "shards")}, "eval": {"every": 1}}
    result, stderr = run(config(tmp_path, **sections), "train")
    assert result == {"rc": 2, "torch": False}
    assert "has no eval split" in stderr
    assert "--eval-split tail" in stderr and "--blank-line-documents" in stderr
    result, stderr = run(config(tmp_path, **sections), "eval")
    assert result["rc"] == 2 and "has no eval split" in stderr


def test_eval_without_a_checkpoint_fails_before_the_model(tmp_path: Path, run) -> None:
    result, stderr = run(config(tmp_path), "eval")
    assert result["rc"] == 2
    assert "train first" in stderr
