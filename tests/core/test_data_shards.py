"""``data.shards``: memory-mapped token windows in a seeded per-epoch shuffle; the batch
contract, determinism, workers/ranks reading disjoint windows, lazy opening, exact resume, the
eval split, and one clear error per broken shard directory."""

from __future__ import annotations

import json
import os
import pickle
import random
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from core.toy_runs import data_config, merge_sections, tiny_transformer_run, train

from speedtronic import ConfigError, DataError
from speedtronic.data import (
    ShardTokenStream,
    SyntheticTokenStream,
    build_dataloader,
    build_eval_source,
    permute_windows,
    prepare,
    read_index,
    shard_source,
)

SEQ = 8


def rows(batches) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for batch in batches for row in batch["input_ids"]]


def take(iterator, count: int) -> list[dict[str, torch.Tensor]]:
    return list(islice(iterator, count))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Byte-level shards of 700 tokens (87 windows of 9 each), with an eval split."""
    root = tmp_path_factory.mktemp("shards")
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    lines = [json.dumps({"text": "".join(rng.choices(letters, k=rng.randint(5, 120)))})
             for _ in range(400)]  # fmt: skip
    (root / "c.jsonl").write_text("\n".join(lines) + "\n")
    prepare([root / "c.jsonl"], root / "out", shard_tokens=700, eval_fraction=0.15, workers=1)
    return root / "out"


def stream(corpus: Path, micro: int = 4, **kwargs) -> ShardTokenStream:
    index = read_index(corpus)
    split = kwargs.pop("split", "train")
    return ShardTokenStream(index.shards(split), index.dtype, SEQ, micro, **kwargs)


def shard_config(corpus: Path, **data) -> object:
    return data_config(shards=str(corpus), micro_batch_size=data.pop("micro_batch_size", 4), **data)


# ------------------------------------------------------------------ windows and the contract
def test_batches_are_shifted_windows_of_the_shards_in_the_synthetic_format(corpus):
    shards = stream(corpus, micro=16, seed=3)
    batch = shards.batch(0)
    synthetic = SyntheticTokenStream(257, SEQ, 16).batch(0)
    assert batch.keys() == synthetic.keys()
    for key in batch:
        assert batch[key].dtype == synthetic[key].dtype == torch.int64
        assert batch[key].shape == synthetic[key].shape == (16, SEQ)
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])

    index = read_index(corpus)
    files = [np.fromfile(s.path, dtype=index.numpy_dtype) for s in index.shards("train")]
    numbers, offsets = shards.locate(shards.window_ids(np.arange(16)))
    for row, (number, offset) in enumerate(zip(numbers, offsets)):
        window = files[number][offset : offset + SEQ + 1].astype(np.int64)
        assert offset % SEQ == 0 and len(window) == SEQ + 1
        assert batch["input_ids"][row].tolist() == window[:-1].tolist()
        assert batch["labels"][row].tolist() == window[1:].tolist()


def test_every_window_is_read_once_per_epoch_in_a_new_order(corpus):
    shards = stream(corpus, seed=1)
    total = shards.num_windows
    assert total == sum((s.tokens - 1) // SEQ for s in read_index(corpus).shards("train"))
    first = shards.window_ids(np.arange(total))
    second = shards.window_ids(np.arange(total, 2 * total))
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(total))
    assert first.tolist() != second.tolist() and first.tolist() != list(range(total))
    other_seed = stream(corpus, seed=2).window_ids(np.arange(total))
    assert other_seed.tolist() != first.tolist()
    in_order = stream(corpus, shuffle=False).window_ids(np.arange(2 * total))
    assert in_order.tolist() == list(range(total)) * 2


@pytest.mark.parametrize("size", [1, 2, 3, 5, 17, 1000, 65_539])
def test_the_window_permutation_is_a_bijection_for_any_size(size):
    for seed, epoch in ((0, 0), (7, 3), (-1, 10**6)):
        permuted = permute_windows(np.arange(size), size, seed, epoch)
        assert np.array_equal(np.sort(permuted), np.arange(size))
    if size > 16:  # and it really shuffles
        assert not np.array_equal(permute_windows(np.arange(size), size, 0, 0), np.arange(size))


def test_the_permutation_is_the_same_computed_per_sample_or_per_array_and_checks_its_input():
    size = 5000
    whole = permute_windows(np.arange(size), size, 3, 7)  # the vectorised path
    pieces = [permute_windows(np.arange(i, i + 10), size, 3, 7) for i in range(0, size, 10)]
    assert np.array_equal(np.concatenate(pieces), whole)  # the per-sample path (micro-batches)
    mixed = permute_windows(np.array([5, 5, 5]), size, 3, np.array([7, 8, 7]))
    assert mixed[0] == mixed[2] == whole[5] and mixed[1] != mixed[0]
    # Shuffled, not shifted: no correlation with the position, neighbours land far apart.
    assert abs(np.corrcoef(np.arange(size), whole)[0, 1]) < 0.1
    assert np.mean(np.abs(np.diff(whole)) <= 2) < 0.01
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 5000\)"):
        permute_windows(np.array([5000]), size, 0)


def test_samples_do_not_depend_on_micro_batch_size_or_workers(corpus):
    small = take(
        build_dataloader(shard_config(corpus, micro_batch_size=2), seq_len=SEQ).iterate(0), 12
    )
    large = take(
        build_dataloader(shard_config(corpus, micro_batch_size=6), seq_len=SEQ).iterate(0), 4
    )
    workers = build_dataloader(shard_config(corpus, micro_batch_size=2, num_workers=2), seq_len=SEQ)
    assert rows(small) == rows(large)
    assert rows(take(workers.iterate(0), 12)) == rows(small)


def test_ranks_read_disjoint_samples_that_together_are_the_single_process_stream(corpus):
    single = stream(corpus, micro=6, seed=4)
    ranks = [stream(corpus, micro=2, seed=4, rank=r, num_ranks=3) for r in range(3)]
    expected = single.window_ids(np.arange(6))
    seen = [r.window_ids(r.global_indices(0, 2)) for r in ranks]
    assert not set(seen[0].tolist()) & set(seen[1].tolist())
    assert [seen[r][i] for i in range(2) for r in range(3)] == expected.tolist()
    # The same split through build_dataloader (what a DDP rank or DiLoCo node passes).
    source = build_dataloader(shard_config(corpus, micro_batch_size=2), seq_len=SEQ, seed=4,
                              rank=1, num_ranks=3)  # fmt: skip
    assert rows(take(source.iterate(0), 1)) == rows([ranks[1].batch(0)])
    with pytest.raises(DataError, match="rank 3 of 3 is out of range"):
        build_dataloader(shard_config(corpus), seq_len=SEQ, rank=3, num_ranks=3)


# ------------------------------------------------------------------ what each process opens
class RecordingShards(ShardTokenStream):
    log_dir: Path

    def _open_shard(self, number: int) -> np.ndarray:
        worker = torch.utils.data.get_worker_info()
        name = str(worker.id) if worker else "main"
        with open(self.log_dir / f"opens-{os.getpid()}.txt", "a") as log:
            log.write(f"{name} {number}\n")
        return super()._open_shard(number)


def test_a_process_opens_only_the_shards_it_reads(corpus):
    in_order = stream(corpus, micro=4, shuffle=False)
    in_order.batch(0)
    assert in_order.opened() == [0]
    shuffled = stream(corpus, micro=4, seed=0)
    batch_shards, _ = shuffled.locate(shuffled.window_ids(np.arange(4)))
    shuffled.batch(0)
    assert shuffled.opened() == sorted(set(batch_shards.tolist()))
    assert len(shuffled.opened()) < len(shuffled.shards)
    copy = pickle.loads(pickle.dumps(shuffled))  # how a spawned worker receives it
    assert copy.opened() == [] and rows([copy.batch(0)]) == rows([shuffled.batch(0)])


def test_a_process_keeps_a_bounded_number_of_shards_mapped(corpus):
    bounded = stream(corpus, micro=16, seed=1)
    bounded.max_open = 2
    free = stream(corpus, micro=16, seed=1)
    assert rows([bounded.batch(b) for b in range(5)]) == rows([free.batch(b) for b in range(5)])
    assert len(bounded.opened()) == 2 < len(free.opened())


def test_dataloader_workers_open_only_the_shards_of_their_own_batches(corpus, tmp_path):
    index = read_index(corpus)
    recording = RecordingShards(index.shards("train"), index.dtype, SEQ, 2, seed=5)
    recording.log_dir = tmp_path
    source = build_dataloader(data_config(micro_batch_size=2, num_workers=2), dataset=recording)
    assert rows(take(source.iterate(0), 6)) == rows([recording.batch(b) for b in range(6)])
    opened: dict[str, set[int]] = {}
    for log in tmp_path.glob("opens-*.txt"):
        for line in log.read_text().splitlines():
            worker, number = line.split()
            opened.setdefault(worker, set()).add(int(number))
    assert {"0", "1"} <= set(opened)
    for worker in ("0", "1"):
        # Worker w builds batches w, w + 2, ...; prefetching may reach a few batches ahead.
        allowed: set[int] = set()
        for batch in range(int(worker), 20, 2):
            numbers, _ = recording.locate(recording.window_ids(np.arange(batch * 2, batch * 2 + 2)))
            allowed |= set(numbers.tolist())
        assert opened[worker] <= allowed


# ------------------------------------------------------------------ resume
def test_resuming_at_any_sample_is_bitwise_the_uninterrupted_stream(corpus):
    source = build_dataloader(shard_config(corpus, micro_batch_size=3), seq_len=SEQ, seed=9)
    total = stream(corpus).num_windows
    straight = take(source.iterate(0), total // 3 + 8)  # crosses an epoch boundary
    for batches_done in (1, 5, total // 3, total // 3 + 2):
        resumed = take(source.iterate(batches_done * 3), 4)
        for a, b in zip(resumed, straight[batches_done:]):
            assert torch.equal(a["input_ids"], b["input_ids"])
            assert torch.equal(a["labels"], b["labels"])
    assert source.exact_resume


def test_a_run_on_shards_resumed_midway_matches_the_uninterrupted_run(corpus, tmp_path):
    def config(name: str, **sections):
        run = tiny_transformer_run(
            tmp_path / name, data={"shards": str(corpus)}, scheduler={"total_steps": 8}
        )
        run["run"]["max_steps"] = 8
        run["model"]["vocab_size"] = 257
        return merge_sections(run, sections)

    _, straight, straight_trainer = train(config("straight"))
    _, first_events, _ = train(config("chain", run={"max_steps": 4}))
    result, resumed, trainer = train(config("chain", checkpoint={"interval": 4, "resume": True}))
    assert result.resumed_from == 4 and set(resumed.losses) == set(range(5, 9))
    for step, loss in {**first_events.losses, **resumed.losses}.items():
        assert loss == straight.losses[step], step
    for a, b in zip(
        trainer.model.state_dict().values(), straight_trainer.model.state_dict().values()
    ):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ the eval split
def test_the_eval_source_reads_eval_windows_in_order_the_same_every_time(corpus):
    config = shard_config(corpus, micro_batch_size=4)
    source = build_eval_source(config, seq_len=SEQ, vocab_size=257)
    first = take(source.iterate(0), 3)
    assert rows(first) == rows(take(source.iterate(0), 3))
    index = read_index(corpus)
    eval_tokens = np.fromfile(index.shards("eval")[0].path, dtype=index.numpy_dtype)
    expected = [tuple(eval_tokens[k * SEQ : k * SEQ + SEQ].tolist()) for k in range(12)]
    assert rows(first) == expected
    half = build_eval_source(config, seq_len=SEQ, micro_batch_size=2, rank=1, num_ranks=2)
    assert rows(take(half.iterate(0), 1)) == [expected[1], expected[3]]
    train_rows = set(rows(take(build_dataloader(config, seq_len=SEQ).iterate(0), 30)))
    assert "eval" in source.description and not train_rows & set(rows(first))


def test_a_corpus_without_eval_split_says_how_to_get_one(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "x" * 100}) + "\n")
    prepare([tmp_path / "c.jsonl"], tmp_path / "out", workers=1)
    with pytest.raises(DataError, match=r"has no eval split \(prepare it with --eval-fraction"):
        build_eval_source(shard_config(tmp_path / "out"), seq_len=SEQ)
    with pytest.raises(DataError, match=r"needs data.shards"):
        build_eval_source(data_config(), seq_len=SEQ)


# ------------------------------------------------------------------ validation
@pytest.fixture
def copy(corpus, tmp_path) -> Path:
    """A private copy of the corpus to break."""
    target = tmp_path / "copy"
    for path in corpus.rglob("*"):
        if path.is_file():
            (target / path.relative_to(corpus)).parent.mkdir(parents=True, exist_ok=True)
            (target / path.relative_to(corpus)).write_bytes(path.read_bytes())
    return target


def load(directory: Path, **data) -> None:
    build_dataloader(
        shard_config(directory, **data), seq_len=SEQ, vocab_size=data.pop("vocab", 257)
    )


def test_a_vocabulary_larger_than_the_model_is_an_error(corpus):
    vocab = r"declares a vocabulary of 257 tokens \(tokenizer bytes\), more than the model's"
    with pytest.raises(DataError, match=vocab + " vocab_size 256"):
        build_dataloader(shard_config(corpus), seq_len=SEQ, vocab_size=256)
    with pytest.raises(DataError, match=r"more than data.vocab_size 200"):
        build_dataloader(shard_config(corpus, vocab_size=200), seq_len=SEQ, vocab_size=257)


def test_shard_files_that_disagree_with_the_index_name_the_shard(copy):
    shard = copy / "train" / "shard_00001.bin"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-10])
    truncated = r"shard_00001.bin is truncated: it has 1390 bytes, but index.json lists 700"
    with pytest.raises(DataError, match=truncated + r" tokens of uint16 \(1400 bytes\)"):
        load(copy)
    shard.write_bytes(np.frombuffer(raw, dtype="<u2").astype("<u4").tobytes())
    dtype = r"shard_00001.bin has 2800 bytes, 700 tokens of uint32, but index.json lists 700"
    with pytest.raises(DataError, match=dtype + r" tokens of uint16 .*: a dtype mismatch"):
        load(copy)
    shard.write_bytes(raw + b"\0")
    with pytest.raises(DataError, match=r"shard_00001.bin has 1401 bytes, .*a size mismatch"):
        load(copy)
    shard.unlink()
    with pytest.raises(DataError, match=r"shard .*shard_00001.bin is missing"):
        load(copy)


def test_verify_shards_catches_a_changed_byte(copy):
    shard = copy / "train" / "shard_00002.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))
    load(copy)  # same size: only the sha256 tells
    with pytest.raises(DataError, match=r"shard .*train/shard_00002.bin fails data.verify_shards: "
                       r"its sha256 is [0-9a-f]{16}\.\.\., index.json says"):  # fmt: skip
        load(copy, verify_shards=True)


def test_verify_shards_catches_ids_outside_the_declared_vocabulary(copy):
    index = json.loads((copy / "index.json").read_text())
    index["vocab_size"], index["eos_id"] = 200, None
    (copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(
        DataError, match=r"holds token id 2[0-9][0-9], outside the vocabulary of 200"
    ):
        load(copy, verify_shards=True)


def edit_index(directory: Path, change) -> None:
    index = json.loads((directory / "index.json").read_text())
    change(index)
    (directory / "index.json").write_text(json.dumps(index))


def test_broken_indexes_are_clear(copy, tmp_path):
    with pytest.raises(DataError, match="directory not found"):
        load(tmp_path / "nowhere")
    (tmp_path / "bare").mkdir()
    with pytest.raises(DataError, match=r"has no index.json: .*did not finish"):
        load(tmp_path / "bare")
    cases = [
        (lambda i: i.update(version=2), "format version 2 is newer than this speedtronic"),
        (lambda i: i.update(format="other"), "not a token-shard index"),
        (lambda i: i.update(dtype="float32"), "dtype must be one of uint16, uint32"),
        (lambda i: i.update(vocab_size=70_000), "dtype uint16 cannot hold the ids of vocab_size"),
        (lambda i: i.update(eos_id=999), "eos_id must be null or an id below vocab_size"),
        (lambda i: i["splits"]["train"]["shards"][0].update(file="../../etc/passwd"),
         r"splits.train.shards\[0\].file must look like train/shard_00000.bin"),
        (lambda i: i["splits"]["train"]["shards"][0].update(file="eval/shard_00000.bin"),
         "is not in the train/ folder"),
        (lambda i: i["splits"]["train"]["shards"][0].update(tokens=-1),
         r"splits.train.shards\[0\].tokens must be a positive integer"),
        (lambda i: i["splits"]["train"]["shards"][0].update(sha256="x"), "sha256 must be 64"),
        (lambda i: i.pop("splits"), "splits must be an object with a train split"),
    ]  # fmt: skip
    original = (copy / "index.json").read_text()
    for change, message in cases:
        (copy / "index.json").write_text(original)
        edit_index(copy, change)
        with pytest.raises(DataError, match=message) as info:
            load(copy)
        assert "index.json" in str(info.value) and "data.shards" in str(info.value)
    (copy / "index.json").write_text("{not json")
    with pytest.raises(DataError, match=r"index.json: not valid JSON \(line 1"):
        load(copy)


def test_a_window_that_fits_nowhere_and_conflicting_config_keys(corpus):
    with pytest.raises(DataError, match=r"no shard holds a window of seq_len \+ 1 = 1001 tokens"):
        build_dataloader(shard_config(corpus), seq_len=1000, vocab_size=257)
    with pytest.raises(ConfigError, match=r"data.shards or data.text_path, not both"):
        data_config(shards=str(corpus), text_path="x.txt")


def test_the_shard_source_is_usable_on_its_own(corpus):
    source = shard_source(corpus, seq_len=SEQ, micro_batch_size=5, seed=2)
    batch = next(source.iterate(0))
    assert batch["input_ids"].shape == (5, SEQ)
    assert "train" in source.description and "shuffled by seed 2" in source.description
    counts = Counter(len(row) for row in rows([batch]))
    assert counts == {SEQ: 5}
