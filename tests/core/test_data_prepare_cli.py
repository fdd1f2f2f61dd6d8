"""``speedtronic data prepare`` on the command line (a real subprocess, and in-process for the
flags), the shards example config, and the docs page that walks through both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from speedtronic import SpeedtronicConfig, cli
from speedtronic.data import read_index
from speedtronic.engine.runtime import build_runtime

ROOT = Path(__file__).parents[2]


def corpus(tmp_path: Path, count: int = 200) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    lines = [json.dumps({"text": f"document {i} " + "shard " * (i % 13)}) for i in range(count)]
    (folder / "part.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "notes.txt").write_text("a text file is one document\n")
    return folder


def speedtronic(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", *args], capture_output=True, text=True, timeout=120
    )


def test_prepare_as_a_subprocess_writes_shards_and_one_summary_line(tmp_path):
    folder = corpus(tmp_path)
    out = tmp_path / "out"
    done = speedtronic("data", "prepare", str(folder), "--out", str(out), "--eval-fraction",
                       "0.2", "--shard-tokens", "500", "--workers", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepared 201 documents from 2 files")
    assert "tokens/s" in lines[0] and "MB/s" in lines[0]
    index = read_index(out)
    assert len(index.shards("train")) > 2 and index.shards("eval")

    (folder / "part.jsonl").write_text('{"text": "ok"}\n{"text": 1}\n')
    failed = speedtronic("data", "prepare", str(folder), "--out", str(tmp_path / "bad"))
    assert failed.returncode == 2
    assert failed.stderr.strip() == (
        f"error: {folder / 'part.jsonl'}:2: field 'text' is int, not a string"
    )
    assert not (tmp_path / "bad" / "index.json").exists()


def test_the_flags_reach_prepare(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("one\n\ntwo\n")
    (folder / "b.jsonl").write_text('{"body": "three"}\n{oops\n')
    flags = ["--no-append-eos", "--blank-line-documents", "--text-field", "body", "--skip-bad"]
    flags += ["--workers", "1", "--shard-tokens", "4", "--no-progress"]
    code = cli.main(["data", "prepare", str(folder), "-o", str(tmp_path / "out"), *flags])
    assert code == 0
    summary = capsys.readouterr().out
    assert "skipped 1 bad records" in summary
    index = read_index(tmp_path / "out")
    assert (
        index.eos_id is None and index.raw["split_blank_lines"] and index.raw["shard_tokens"] == 4
    )
    stream = b"".join(Path(s.path).read_bytes() for s in index.shards("train"))
    assert bytes(stream[::2]) == b"onetwothree"

    assert cli.main(["data"]) == 2  # no subcommand: the help
    with pytest.raises(SystemExit) as info:  # argparse's own usage error, exit status 2
        cli.main(["data", "prepare", str(folder), "--out", str(tmp_path / "x"),
                  "--eval-fraction", "1.5"])  # fmt: skip
    assert info.value.code == 2 and "must be in [0, 1)" in capsys.readouterr().err


def test_the_shards_example_config_validates_and_trains_on_a_tiny_corpus(tmp_path, capsys):
    example = ROOT / "configs" / "shards.yaml"
    # The corpus does not exist yet: the file alone validates; with it, the whole run.
    assert cli.main(["validate", "--config", str(example), "--config-only"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["shards"] == "data/my_corpus"

    folder = corpus(tmp_path)
    assert cli.main(["data", "prepare", str(folder), "--out", str(tmp_path / "shards"),
                     "--eval-fraction", "0.1", "--workers", "1", "--no-progress"]) == 0  # fmt: skip
    config = SpeedtronicConfig.from_file(example).with_overrides(
        {
            "data.shards": str(tmp_path / "shards"),
            "data.num_workers": 0,
            "data.micro_batch_size": 2,
            "data.target_batch_size": 4,
            "model.max_seq_len": 16,
            "model.n_layer": 1,
            "model.d_model": 32,
            "run.device": "cpu",
            "run.max_steps": 3,
            "run.output_dir": str(tmp_path / "run"),
            "precision.mode": "fp32",
            "logging.progress": False,
        }
    )
    runtime = build_runtime(config, console=False)
    assert "shards" in runtime.data.description
    result = runtime.trainer.fit()
    assert result.steps == 3 and torch.isfinite(torch.tensor(result.final_loss))


def test_the_docs_walk_through_prepare_and_document_every_flag():
    page = (ROOT / "docs" / "data.md").read_text()
    assert "## Prepare your corpus" in page
    parser = cli.build_parser()
    data = next(a for a in parser._actions if a.dest == "command").choices["data"]
    prepare = next(a for a in data._actions if a.dest == "data_command").choices["prepare"]
    for action in prepare._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help", *cli.GLOBAL_FLAGS):  # global: in docs/cli.md
                assert f"`{flag}" in page, f"data prepare {flag} is not documented"
    for key in ("data.shards", "data.verify_shards", "build_eval_source"):
        assert key in page
