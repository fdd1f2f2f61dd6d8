"""``speedtronic data prepare`` as a library: layout, index, EOS, dtypes, the eval split,
determinism across reruns and worker counts, tokenizer.json through ``tokenizers``, atomicity."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from speedtronic import DataError
from speedtronic.data import prepare, read_index

SPLITS = ("train", "eval")
WORDS = ["speed", "tronic", "shard", "token", "window", "resume", "exact", "é", "日本"]


def documents(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 40))) for _ in range(count)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def tree(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path (the lock file aside)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".prepare.lock"
    }


def tokens(directory: Path, split: str = "train") -> np.ndarray:
    index = read_index(directory)
    parts = [np.fromfile(s.path, dtype=index.numpy_dtype) for s in index.shards(split)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=index.numpy_dtype)


def byte_stream(texts: list[str], eos: bool = True) -> list[int]:
    out: list[int] = []
    for text in texts:
        out.extend(text.encode("utf-8"))
        if eos:
            out.append(256)
    return out


def split_documents(stream: np.ndarray) -> list[str]:
    """Byte-level documents back from a token stream with EOS 256 after each."""
    pieces = np.split(stream, np.flatnonzero(stream == 256) + 1)[:-1]
    return [bytes(piece[:-1].astype(np.uint8)).decode() for piece in pieces]


# ------------------------------------------------------------------ layout and index
def test_byte_shards_hold_every_document_with_eos_in_order(tmp_path):
    texts = documents(300)
    source = write_jsonl(tmp_path / "corpus.jsonl", texts)
    result = prepare([source], tmp_path / "out", shard_tokens=1000, workers=1)

    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["format"] == "speedtronic-token-shards" and index["version"] == 1
    assert index["dtype"] == "uint16" and index["byte_order"] == "little"
    assert index["vocab_size"] == 257 and index["eos_id"] == 256
    assert index["tokenizer"]["name"] == "bytes" and len(index["tokenizer"]["sha256"]) == 64
    shards = index["splits"]["train"]["shards"]
    assert [s["file"] for s in shards] == [f"train/shard_{i:05d}.bin" for i in range(len(shards))]
    assert all(s["tokens"] == 1000 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 1000
    for shard in shards:  # little-endian uint16, sha256 of the file
        raw = (tmp_path / "out" / shard["file"]).read_bytes()
        assert len(raw) == 2 * shard["tokens"]
        assert hashlib.sha256(raw).hexdigest() == shard["sha256"]
    assert tokens(tmp_path / "out").tolist() == byte_stream(texts)
    assert result.documents == {"train": 300, "eval": 0} and result.shards["eval"] == 0
    assert not (tmp_path / "out" / "eval").exists()
    assert "300 documents" in result.summary() and "uint16" in result.summary()


def test_without_eos_documents_are_just_concatenated_and_the_vocab_is_256(tmp_path):
    texts = documents(20)
    source = write_jsonl(tmp_path / "corpus.jsonl", texts)
    prepare([source], tmp_path / "out", append_eos=False, workers=1)
    index = read_index(tmp_path / "out")
    assert index.vocab_size == 256 and index.eos_id is None and index.raw["append_eos"] is False
    assert tokens(tmp_path / "out").tolist() == byte_stream(texts, eos=False)


def test_inputs_of_every_kind_and_directories_in_sorted_order(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("\ufeffwhole file\n\nis one document\n")
    (corpus / "a.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n\n")
    with gzip.open(corpus / "sub" / "c.jsonl.gz", "wt") as handle:
        handle.write(json.dumps({"text": "from gzip"}) + "\n")
    (corpus / "notes.md").write_text("not an input")
    (corpus / ".hidden.txt").write_text("hidden files are skipped")
    blocks = tmp_path / "blocks.txt"
    blocks.write_text("first block\nline two\n\n\n  \nsecond block\n")

    prepare([corpus], tmp_path / "files", workers=1)
    expected = ["from jsonl", "\ufeffwhole file\n\nis one document\n"[1:], "from gzip"]
    assert tokens(tmp_path / "files").tolist() == byte_stream(expected)

    prepare([blocks], tmp_path / "blocks", split_blank_lines=True, workers=1)
    expected = ["first block\nline two", "second block"]
    assert tokens(tmp_path / "blocks").tolist() == byte_stream(expected)


def test_empty_documents_are_left_out_and_counted(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", ["one", "", "two"])
    result = prepare([source], tmp_path / "out", workers=1, progress=True)  # the rich bar too
    assert result.empty == 1 and result.documents["train"] == 2
    assert tokens(tmp_path / "out").tolist() == byte_stream(["one", "two"])


# ------------------------------------------------------------------ eval split
def test_eval_split_is_deterministic_disjoint_and_keeps_duplicates_together(tmp_path):
    texts = documents(400, seed=1)
    texts += texts[:50]  # exact duplicates must never straddle the split
    source = write_jsonl(tmp_path / "c.jsonl", texts)
    result = prepare([source], tmp_path / "out", eval_fraction=0.2, workers=1)

    decoded = {split: split_documents(tokens(tmp_path / "out", split)) for split in SPLITS}
    assert sorted(decoded["train"] + decoded["eval"]) == sorted(texts)
    assert not set(decoded["train"]) & set(decoded["eval"])
    assert 0.1 < len(decoded["eval"]) / len(texts) < 0.3
    assert result.documents["eval"] == len(decoded["eval"]) and result.shards["eval"] >= 1

    # Chosen by content, not position: reordering the inputs holds out the same documents.
    shuffled = list(texts)
    random.Random(5).shuffle(shuffled)
    write_jsonl(tmp_path / "shuffled.jsonl", shuffled)
    prepare([tmp_path / "shuffled.jsonl"], tmp_path / "again", eval_fraction=0.2, workers=1)
    again = split_documents(tokens(tmp_path / "again", "eval"))
    assert sorted(again) == sorted(decoded["eval"])


# ------------------------------------------------------------------ determinism
def test_reruns_and_worker_counts_give_byte_identical_output(tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", documents(3000, seed=2))
    blocks = tmp_path / "blocks.txt"
    blocks.write_text("\n\n".join(documents(500, seed=3)))
    args = ([big, blocks], {"shard_tokens": 5000, "eval_fraction": 0.1, "task_bytes": 8192})
    prepare(args[0], tmp_path / "one", workers=1, split_blank_lines=True, **args[1])
    prepare(args[0], tmp_path / "two", workers=2, split_blank_lines=True, **args[1])
    prepare(args[0], tmp_path / "one", workers=1, split_blank_lines=True, **args[1])  # rerun
    first, second = tree(tmp_path / "one"), tree(tmp_path / "two")
    assert len([name for name in first if name.startswith("train/")]) > 3
    assert first == second
    # Cutting the big files into many small pieces did not change what was read.
    prepare(args[0], tmp_path / "whole", workers=1, split_blank_lines=True, shard_tokens=5000,
            eval_fraction=0.1)  # fmt: skip
    assert tree(tmp_path / "whole") == first


def test_a_rerun_with_fewer_shards_removes_the_stale_ones(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", documents(200))
    prepare([source], tmp_path / "out", shard_tokens=500, eval_fraction=0.3, workers=1)
    assert len(list((tmp_path / "out" / "train").iterdir())) > 2
    prepare([source], tmp_path / "out", workers=1)
    assert [p.name for p in (tmp_path / "out" / "train").iterdir()] == ["shard_00000.bin"]
    assert not (tmp_path / "out" / "eval").exists()
    assert not list((tmp_path / "out").glob(".prepare-*"))


# ------------------------------------------------------------------ tokenizer.json
def trained_bpe(tmp_path: Path, texts: list[str]) -> tuple[Path, object]:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    path = tmp_path / "bpe" / "tokenizer.json"
    path.parent.mkdir()
    tokenizer.save(str(path))
    return path, tokenizer


def test_a_trained_bpe_tokenizer_json_encodes_whole_documents(tmp_path):
    texts = documents(200, seed=4)
    path, tokenizer = trained_bpe(tmp_path, texts)
    source = write_jsonl(tmp_path / "c.jsonl", texts)
    prepare([source], tmp_path / "out", tokenizer=path, workers=1, shard_tokens=300)

    index = read_index(tmp_path / "out")
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert index.eos_id == eos and index.vocab_size == tokenizer.get_vocab_size()
    assert (
        index.tokenizer["kind"] == "tokenizers" and index.tokenizer["name"] == "bpe/tokenizer.json"
    )
    assert index.tokenizer["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    expected = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert len(ids) < len(text.encode())  # merges happened
        expected += [*ids, eos]
    assert tokens(tmp_path / "out").tolist() == expected
    # Two worker processes load the same tokenizer and write the same bytes.
    prepare([source], tmp_path / "two", tokenizer=path.parent, workers=2, shard_tokens=300,
            task_bytes=2048)  # fmt: skip
    assert tree(tmp_path / "two") == tree(tmp_path / "out")


def test_a_vocabulary_beyond_65536_is_stored_as_uint32(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["</s>"] = 70_000
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    source = write_jsonl(tmp_path / "c.jsonl", ["w69999 w5 w65536", "w70 w1"])
    prepare([source], tmp_path / "out", tokenizer=path, workers=1)
    index = read_index(tmp_path / "out")
    assert index.dtype == "uint32" and index.vocab_size == 70_001 and index.eos_id == 70_000
    assert tokens(tmp_path / "out").tolist() == [69999, 5, 65536, 70000, 70, 1, 70000]
    assert (tmp_path / "out" / "train" / "shard_00000.bin").stat().st_size == 7 * 4


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("pyarrow") is None, reason="pyarrow not installed"
)
def test_parquet_row_groups_are_read_in_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = documents(50, seed=6)
    table = pa.table({"id": list(range(50)), "body": texts})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=7)
    prepare([tmp_path / "c.parquet"], tmp_path / "out", text_field="body", workers=1)
    assert tokens(tmp_path / "out").tolist() == byte_stream(texts)


# ------------------------------------------------------------------ atomicity
def test_a_failed_prepare_keeps_the_previous_output_and_leaves_no_shard(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", documents(300))
    prepare([good], tmp_path / "out", shard_tokens=1000, workers=1)
    before = tree(tmp_path / "out")
    later = tmp_path / "later.jsonl"
    later.write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    written = []
    with pytest.raises(DataError, match=r"later.jsonl:2"):
        prepare([good, later], tmp_path / "out", shard_tokens=100, workers=1, task_bytes=4096,
                on_result=written.append)  # fmt: skip
    assert len(written) > 2  # shards were being written when the bad line came
    assert tree(tmp_path / "out") == before
    assert not list((tmp_path / "out").glob(".prepare-*"))

    with pytest.raises(DataError):
        prepare([later], tmp_path / "fresh", workers=1)
    assert not list((tmp_path / "fresh").rglob("*.bin"))
    assert not (tmp_path / "fresh" / "index.json").exists()


KILL = """
import os, signal, sys
import speedtronic.data.preparation as impl

where = sys.argv[3]
finished = []
if where == "mid-shard":
    original = impl.SplitWriter._finish
    def finish(self):
        original(self)
        finished.append(1)
        if len(finished) == 2:
            self._open()
            self._handle.write(b"partial")
            self._handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    impl.SplitWriter._finish = finish
else:  # during the commit, after the old index is gone
    original = os.replace
    def replace(src, dst):
        if "/train/" in str(dst) and ".prepare-" not in str(dst):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(src, dst)
    impl.os.replace = replace
impl.prepare([sys.argv[1]], sys.argv[2], shard_tokens=500, workers=1, task_bytes=2048)
"""


@pytest.mark.parametrize("where", ["mid-shard", "commit"])
def test_a_killed_prepare_never_leaves_a_shard_that_looks_complete(tmp_path, where):
    source = write_jsonl(tmp_path / "c.jsonl", documents(400))
    old = write_jsonl(tmp_path / "old.jsonl", documents(100, seed=9))
    out = tmp_path / "out"
    prepare([old], out, shard_tokens=500, workers=1)
    before = tree(out)
    killed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILL), str(source), str(out), where],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    if where == "mid-shard":  # the old output is intact; the new shards never left staging
        assert {k: v for k, v in tree(out).items() if not k.startswith(".prepare-")} == before
        staged = [p for p in out.rglob("*") if p.is_file() and ".prepare-" in str(p)]
        assert any(p.name.endswith(".tmp") for p in staged)  # the partial one kept a temp name
    else:  # the old index is gone before any shard moves: the directory reads as unfinished
        assert not (out / "index.json").exists()
        with pytest.raises(DataError, match="did not finish"):
            read_index(out)
    # The next run cleans up and writes the complete output.
    prepare([source], out, shard_tokens=500, workers=1)
    assert not list(out.glob(".prepare-*"))
    assert tokens(out).size == read_index(out).tokens("train")


def test_output_files_are_readable_by_others(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", documents(5))
    prepare([source], tmp_path / "out", workers=1)
    umask = os.umask(0)
    os.umask(umask)
    for path in (tmp_path / "out" / "index.json", tmp_path / "out" / "train" / "shard_00000.bin"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask
