"""``--eval-split``: the tail of the token stream for a corpus of few documents (the default
below 100 documents), documents drawn by hash otherwise, a warning when the held-out share is
far from the asked one; and ``speedtronic data prepare`` never imports torch."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speedtronic.data import check_shards, prepare, read_index
from speedtronic.data.preparation import TAIL_BELOW_DOCUMENTS


def book(tmp_path: Path, repeats: int = 400) -> Path:
    path = tmp_path / "book.txt"
    path.write_text(
        "".join(f"Chapter {i}. It is a truth universally acknowledged.\n" for i in range(repeats))
    )
    return path


def tokens(directory: Path, split: str) -> np.ndarray:
    """The split's token stream, its shards checked against index.json (sizes, sha256)."""
    shards = check_shards(read_index(directory), split, verify=True)
    return np.concatenate([np.fromfile(shard.path, dtype="<u2") for shard in shards])


def test_one_text_file_holds_out_the_asked_fraction_from_its_tail(tmp_path: Path) -> None:
    corpus = book(tmp_path)
    whole = prepare([corpus], tmp_path / "whole", progress=False)
    # Shards of 1000 tokens: the cut falls inside one shard, and later shards move whole.
    split = prepare(
        [corpus], tmp_path / "split", eval_fraction=0.1, shard_tokens=1000, progress=False
    )
    assert split.eval_split == "tail"  # one document: auto picks the tail
    total = whole.tokens["train"]
    assert split.tokens["eval"] == round(0.1 * total)
    assert split.tokens["train"] + split.tokens["eval"] == total
    assert split.shards["train"] > 1
    stream = tokens(tmp_path / "whole", "train")
    assert np.array_equal(tokens(tmp_path / "split", "train"), stream[: split.tokens["train"]])
    assert np.array_equal(tokens(tmp_path / "split", "eval"), stream[split.tokens["train"] :])
    index = json.loads((tmp_path / "split" / "index.json").read_text())
    assert index["eval_split"] == "tail"


def test_documents_split_of_few_documents_warns_and_names_the_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"{i}.txt").write_text(f"document {i} " * 200)
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        result = prepare(
            [corpus], tmp_path / "out", eval_fraction=0.05, eval_split="documents", progress=False
        )
    held = result.tokens["eval"] / (result.tokens["eval"] + result.tokens["train"])
    assert not 0.025 <= held <= 0.1  # 0 or 1/5 or more of five documents, never 5%
    assert "--eval-split tail" in caplog.text and "--blank-line-documents" in caplog.text


def test_many_documents_keep_the_per_document_split(tmp_path: Path) -> None:
    corpus = tmp_path / "many.txt"
    corpus.write_text("\n\n".join(f"paragraph {i} " * 5 for i in range(TAIL_BELOW_DOCUMENTS)))
    result = prepare(
        [corpus], tmp_path / "out", eval_fraction=0.2, split_blank_lines=True, progress=False
    )
    assert result.eval_split == "documents"
    assert result.documents["eval"] > 0 and result.documents["train"] > 0


def test_prepare_from_the_cli_never_imports_torch(tmp_path: Path) -> None:
    corpus = book(tmp_path, 50)
    code = (
        "import sys\n"
        "from speedtronic.cli import main\n"
        f"code = main(['data', 'prepare', {str(corpus)!r}, '--out', {str(tmp_path / 'o')!r}, "
        "'--eval-fraction', '0.1', '--no-progress'])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 False"
    assert "eval-split tail" in done.stderr  # auto says what it chose
