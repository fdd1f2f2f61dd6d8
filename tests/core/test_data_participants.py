"""``participant_seed`` (the ``data_seed`` hook's answer): every built-in source gives each
participant of a multi-node run its own sample order, the same samples as a plain run per
epoch, resumable; evaluation data never depends on it; the source says how it was split."""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path

import pytest
import torch
from core.toy_runs import data_config
from torch.utils.data import Dataset

from speedtronic.data import build_dataloader, prepare
from speedtronic.data.text import TokenizedTextStream, byte_tokenizer

SEQ = 8


class Numbers(Dataset):
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([index])}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("participants")
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    text = "".join(rng.choices(letters, k=8 * 40 + 1))  # 40 blocks of seq 8
    (root / "text.txt").write_text(text)
    lines = [json.dumps({"text": "".join(rng.choices(letters, k=60))}) for _ in range(40)]
    (root / "c.jsonl").write_text("\n".join(lines) + "\n")
    prepare([root / "c.jsonl"], root / "shards", workers=1)
    return {"text": root / "text.txt", "shards": root / "shards"}


def config_for(kind: str, files: dict[str, Path]):
    data = {"micro_batch_size": 4}
    if kind == "text":
        data["text_path"] = str(files["text"])
    if kind == "shards":
        data["shards"] = str(files["shards"])
    return data_config(**data)


def rows(source, count: int, start: int = 0) -> list[tuple[int, ...]]:
    batches = islice(source.iterate(start), count)
    return [tuple(row.tolist()) for batch in batches for row in batch["input_ids"]]


def build(kind: str, files: dict[str, Path], participant_seed: int | None):
    dataset = Numbers(40) if kind == "map-style" else None
    return build_dataloader(
        config_for(kind, files),
        dataset,
        seq_len=SEQ,
        vocab_size=257,
        participant_seed=participant_seed,
    )


@pytest.mark.parametrize("kind", ["synthetic", "text", "shards", "map-style"])
def test_each_participant_seed_reads_its_own_order(kind: str, files: dict[str, Path]) -> None:
    plain, one, two = (build(kind, files, seed) for seed in (None, 11, 12))
    assert rows(one, 3) != rows(two, 3)  # different samples from the first micro-batch on
    assert rows(one, 3) == rows(build(kind, files, 11), 3)  # a pure function of the seed
    assert rows(one, 2, start=8) == rows(one, 5)[8:16]  # resumes exactly
    assert one.split == "own order (participant seed 11)" and plain.split == "not split"
    if kind in ("text", "map-style"):  # read in order by a plain run: the same samples
        assert rows(one, 10) != rows(plain, 10)
        assert sorted(rows(one, 10)) == sorted(rows(plain, 10))  # one epoch of 40


def test_ranks_and_a_participant_seed_together(files: dict[str, Path]) -> None:
    config = config_for("text", files)
    ranks = [
        build_dataloader(config, seq_len=SEQ, rank=r, num_ranks=2, participant_seed=5)
        for r in range(2)
    ]
    assert ranks[1].split == "own order (participant seed 5), disjoint slice 1 of 2"
    halves = [set(rows(source, 5)) for source in ranks]  # 20 samples each: one epoch
    assert not halves[0] & halves[1] and len(halves[0] | halves[1]) == 40


def test_a_tokenized_text_stream_is_reordered_per_seed(files: dict[str, Path]) -> None:
    def blocks(seed: int | None, epoch: int = 0) -> list[tuple[int, ...]]:
        stream = TokenizedTextStream(
            files["text"], SEQ, 4, byte_tokenizer, chunk_bytes=64, order_seed=seed
        )
        return [tuple(b.tolist()) for b in stream.blocks(epoch=epoch)]

    plain, one, two = blocks(None), blocks(1), blocks(2)
    assert one != plain and one != two and sorted(one) == sorted(plain) == sorted(two)
    assert blocks(1, epoch=1) != one  # a new order every pass
