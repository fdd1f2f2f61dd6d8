"""The built-in streams: synthetic tokens, byte-level text, tokenized text; determinism, the
label contract, and what each DataLoader worker reads."""

from __future__ import annotations

import os
import random
import string
from collections import Counter
from itertools import islice, pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from core.toy_runs import data_config
from torch.utils.data import get_worker_info

from speedtronic.data import (
    ByteTextStream,
    SyntheticTokenStream,
    TokenizedTextStream,
    build_dataloader,
)


def take(iterator, count: int) -> list[dict[str, torch.Tensor]]:
    return list(islice(iterator, count))


def rows(batches) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for batch in batches for row in batch["input_ids"]]


# ------------------------------------------------------------------ synthetic
def test_synthetic_labels_are_the_next_tokens_and_follow_a_learnable_rule():
    batch = SyntheticTokenStream(vocab_size=50, seq_len=12, micro_batch_size=64, seed=3).batch(0)
    inputs, labels = batch["input_ids"], batch["labels"]
    assert inputs.shape == labels.shape == (64, 12)
    assert inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(labels[:, :-1], inputs[:, 1:])
    steps = Counter(((labels - inputs) % 50).flatten().tolist())
    assert set(steps) == {1, 2, 3, 5}
    assert steps[1] > steps[2] > steps[5]  # skewed: most of it is predictable
    assert inputs.min() >= 0 and labels.max() < 50


def test_synthetic_samples_depend_only_on_seed_and_index():
    small = SyntheticTokenStream(64, 16, micro_batch_size=2, seed=7)
    large = SyntheticTokenStream(64, 16, micro_batch_size=8, seed=7)
    resumed = SyntheticTokenStream(64, 16, micro_batch_size=2, seed=7, start_sample=4)
    assert rows([small.batch(i) for i in range(4)]) == rows([large.batch(0)])
    assert rows([resumed.batch(0)]) == rows([small.batch(2)])
    assert rows([SyntheticTokenStream(64, 16, 8, seed=8).batch(0)]) != rows([large.batch(0)])
    assert rows([SyntheticTokenStream(64, 16, 8, seed=-1).batch(0)])  # any int seeds


def test_synthetic_source_is_identical_with_workers_and_on_resume():
    single = build_dataloader(data_config(micro_batch_size=4), seq_len=8, vocab_size=32, seed=5)
    workers = build_dataloader(
        data_config(micro_batch_size=4, num_workers=2), seq_len=8, vocab_size=32, seed=5
    )
    expected = take(single.iterate(0), 6)
    assert rows(take(workers.iterate(0), 6)) == rows(expected)
    assert rows(take(single.iterate(8), 4)) == rows(expected[2:])
    assert single.exact_resume


# ------------------------------------------------------------------ byte-level text
class ReadLog:
    """A file handle that appends ``worker offset length`` for every read to a log file."""

    def __init__(self, path: str, log_dir: Path) -> None:
        info = get_worker_info()
        self.worker = str(info.id) if info else "main"
        self.handle = open(path, "rb")  # noqa: SIM115 - closed with the stream's process
        self.log = open(log_dir / f"reads-{os.getpid()}.txt", "a")  # noqa: SIM115

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.handle.seek(offset, whence)

    def read(self, size: int = -1) -> bytes:
        offset = self.handle.tell()
        data = self.handle.read(size)
        self.log.write(f"{self.worker} {offset} {len(data)}\n")
        self.log.flush()
        return data


class RecordingByteStream(ByteTextStream):
    log_dir: Path

    def _open(self):
        return ReadLog(self.path, self.log_dir)


class RecordingTokenizedStream(TokenizedTextStream):
    log_dir: Path

    def _open(self):
        return ReadLog(self.path, self.log_dir)


def read_ranges(log_dir: Path) -> dict[str, list[tuple[int, int]]]:
    ranges: dict[str, list[tuple[int, int]]] = {}
    for log in log_dir.glob("reads-*.txt"):
        for line in log.read_text().splitlines():
            worker, offset, length = line.split()
            ranges.setdefault(worker, []).append((int(offset), int(offset) + int(length)))
    return ranges


def char_tokenizer(text: str) -> list[int]:
    """A module-level tokenizer (DataLoader workers may need to pickle it)."""
    return [ord(char) % 97 for char in text]


@pytest.fixture
def text_file(tmp_path) -> Path:
    # Random letters, so that blocks taken from different places differ.
    rng = random.Random(0)
    lines = ["".join(rng.choices(string.ascii_letters, k=5 + i % 70)) + "\n" for i in range(300)]
    path = tmp_path / "corpus.txt"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def test_byte_stream_blocks_tile_the_file_with_shifted_labels(text_file):
    raw = np.frombuffer(text_file.read_bytes(), dtype=np.uint8)
    stream = ByteTextStream(text_file, seq_len=16, micro_batch_size=4)
    batches = [stream.batch(i) for i in range(stream.num_blocks // 4)]
    inputs = torch.cat([b["input_ids"] for b in batches]).flatten().numpy()
    labels = torch.cat([b["labels"] for b in batches]).flatten().numpy()
    covered = len(inputs)
    assert np.array_equal(inputs, raw[:covered])  # disjoint and complete, in file order
    assert np.array_equal(labels, raw[1 : covered + 1])
    wrapped = stream.batch(stream.num_blocks // 4 + 100)  # wraps around, never runs out
    assert wrapped["input_ids"].shape == (4, 16)


def test_byte_stream_workers_read_only_their_own_blocks(text_file, tmp_path):
    seq, micro, batches = 8, 2, 24
    log_dir = tmp_path / "reads"
    log_dir.mkdir()
    stream = RecordingByteStream(text_file, seq_len=seq, micro_batch_size=micro)
    stream.log_dir = log_dir
    assert stream.num_blocks > 4 * micro * batches  # no wrap-around within this test

    single = rows(take(iter(stream), batches))
    two = build_dataloader(data_config(micro_batch_size=micro, num_workers=2), dataset=stream)
    assert rows(take(two.iterate(0), batches)) == single  # same order as one process

    reads = read_ranges(log_dir)
    assert {"0", "1"} <= set(reads)
    for worker in ("0", "1"):
        own = {
            (batch * micro + j) * seq
            for batch in range(int(worker), 4 * batches, 2)
            for j in range(micro)
        }
        assert reads[worker], f"worker {worker} read nothing"
        for start, end in reads[worker]:
            assert start in own and end - start == seq + 1, (worker, start, end)
        assert sum(end - start for start, end in reads[worker]) < text_file.stat().st_size / 2


# ------------------------------------------------------------------ tokenized text
def multiset(blocks) -> Counter:
    return Counter(tuple(block.tolist()) for block in blocks)


@pytest.mark.parametrize("newlines", [True, False])
def test_chunks_tile_the_file_at_line_or_character_edges(tmp_path, newlines):
    text = "日本語 é ü " * 60 if not newlines else "".join(f"row {i} é\n" for i in range(120))
    path = tmp_path / "mixed.txt"
    path.write_text(text, encoding="utf-8")
    raw = path.read_bytes()
    stream = TokenizedTextStream(
        path, seq_len=8, micro_batch_size=2, tokenizer=char_tokenizer, chunk_bytes=64
    )
    ranges = [stream.chunk_range(c) for c in range(stream.num_chunks)]
    assert ranges[0][0] == 0 and ranges[-1][1] == len(raw)
    for (start, end), (next_start, _) in pairwise(ranges):
        assert start < end == next_start
        assert end - start <= 64 + stream.scan_bytes
    for start, end in ranges:
        raw[start:end].decode("utf-8")  # strict: no character is cut in two
        if newlines and end < len(raw):
            assert raw[end - 1 : end] == b"\n"


def test_tokenized_blocks_of_all_workers_are_exactly_those_of_one_process(text_file):
    stream = TokenizedTextStream(
        text_file, seq_len=8, micro_batch_size=2, tokenizer=char_tokenizer, chunk_bytes=256
    )
    single = multiset(stream.blocks(0, 1))
    first, second = multiset(stream.blocks(0, 2)), multiset(stream.blocks(1, 2))
    assert sum(single.values()) > 100
    assert first + second == single
    assert all(len(block) == 9 for block in single)


@pytest.mark.parametrize("one_long_line", [False, True])
def test_tokenized_workers_read_only_their_own_byte_ranges(tmp_path, text_file, one_long_line):
    if one_long_line:  # the old way of finding line edges read to the end of the file here
        text_file.write_text(text_file.read_text().replace("\n", " ") * 2, encoding="utf-8")
    size = text_file.stat().st_size
    log_dir = tmp_path / "reads"
    log_dir.mkdir()
    chunk, scan = 1024, 64
    stream = RecordingTokenizedStream(
        text_file,
        seq_len=8,
        micro_batch_size=2,
        tokenizer=char_tokenizer,
        chunk_bytes=chunk,
        scan_bytes=scan,
    )
    stream.log_dir = log_dir
    expected = multiset(
        TokenizedTextStream(text_file, 8, 2, char_tokenizer, chunk_bytes=chunk).blocks(0, 1)
    )
    source = build_dataloader(data_config(micro_batch_size=2, num_workers=2), dataset=stream)
    seen: Counter = Counter()
    for batch in islice(source.iterate(0), 4 * sum(expected.values())):
        windows = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
        seen.update(tuple(row.tolist()) for row in windows)
        if set(seen) == set(expected):
            break
    assert set(seen) == set(expected)  # every block arrives, and nothing else

    reads = read_ranges(log_dir)
    assert {"0", "1"} <= set(reads)
    for worker, spans in reads.items():
        own = [
            (c * chunk - 1, (c + 1) * chunk + scan + 1)
            for c in range(int(worker), stream.num_chunks, 2)
        ]
        for start, end in spans:
            assert any(lo <= start and end <= hi for lo, hi in own), (worker, start, end)
        touched = np.zeros(size, dtype=bool)
        for start, end in spans:
            touched[start:end] = True
        # Half the chunks plus at most `scan` bytes past each of their edges.
        assert touched.sum() < 0.6 * size, f"worker {worker} read {touched.sum()} of {size} bytes"


def test_tokenizer_may_return_a_mapping_or_a_tensor(text_file):
    def mapping(text):
        return {"input_ids": [ord(c) % 50 for c in text]}

    def tensor(text):
        return torch.tensor([ord(c) % 50 for c in text])

    for tokenizer in (mapping, tensor):
        config = data_config(micro_batch_size=3, text_path=str(text_file))
        source = build_dataloader(config, tokenizer=tokenizer, seq_len=10, vocab_size=64)
        batch = next(source.iterate(0))
        assert batch["input_ids"].shape == batch["labels"].shape == (3, 10)
        assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
        assert not source.exact_resume
