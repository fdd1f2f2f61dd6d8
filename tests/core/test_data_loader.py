"""build_dataloader: user datasets, loader options, shuffling, resume, and clear errors."""

from __future__ import annotations

import logging
from itertools import islice
from typing import Any

import pytest
import torch
from core.toy_runs import data_config
from torch.utils.data import Dataset, IterableDataset

from speedtronic import DataError, SpeedtronicConfig
from speedtronic.data import build_dataloader
from speedtronic.data import source as data_source
from speedtronic.data import text as data_text


class Numbers(Dataset):
    """Sample ``i`` is ``{"x": [i]}``."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([index])}


class Counting(IterableDataset):
    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self):
        return iter(torch.arange(self.length).split(1))


def indices(batches) -> list[int]:
    return [int(value) for batch in batches for value in batch["x"].flatten()]


def test_map_style_dataset_cycles_in_order_without_shuffle():
    source = build_dataloader(data_config(micro_batch_size=4), dataset=Numbers(10))
    assert indices(islice(source.iterate(0), 5)) == [*range(10), *range(10)]
    assert source.exact_resume


def test_map_style_shuffle_is_a_seeded_permutation_per_epoch_and_resumes_exactly():
    config = data_config(micro_batch_size=5, shuffle=True)
    source = build_dataloader(config, dataset=Numbers(20))
    first = indices(islice(source.iterate(0), 12))  # three epochs
    epochs = [first[0:20], first[20:40], first[40:60]]
    assert all(sorted(epoch) == list(range(20)) for epoch in epochs)
    assert epochs[0] != list(range(20)) and epochs[0] != epochs[1]
    again = build_dataloader(config, dataset=Numbers(20))
    assert indices(islice(again.iterate(0), 4)) == first[:20]
    assert indices(islice(source.iterate(25), 3)) == first[25:40]  # resume mid-epoch


def test_map_style_shuffle_follows_the_seed_argument():
    # The runtime passes the data_seed hook's answer (DiLoCo: per node) as `seed`.
    config = data_config(micro_batch_size=5, shuffle=True)
    default = indices(islice(build_dataloader(config, dataset=Numbers(20)).iterate(0), 4))
    same = build_dataloader(config, dataset=Numbers(20), seed=config.data_seed)
    other = build_dataloader(config, dataset=Numbers(20), seed=config.data_seed + 1)
    assert indices(islice(same.iterate(0), 4)) == default
    assert indices(islice(other.iterate(0), 4)) != default


def test_iterable_dataset_is_collated_repeated_and_ignores_shuffle(caplog):
    config = data_config(micro_batch_size=3, shuffle=True)
    with caplog.at_level(logging.WARNING, logger="speedtronic.data"):
        source = build_dataloader(config, dataset=Counting(6))
        batches = list(islice(source.iterate(0), 4))
    assert [b.flatten().tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]] * 2
    assert any("map-style" in r.getMessage() for r in caplog.records)
    assert not source.exact_resume


def test_loader_options_are_honoured(monkeypatch):
    made: list[dict[str, Any]] = []

    class Recording(torch.utils.data.DataLoader):
        def __init__(self, dataset, **kwargs):
            made.append(kwargs)
            super().__init__(dataset, **kwargs)

    monkeypatch.setattr(data_source, "DataLoader", Recording)
    config = data_config(micro_batch_size=2, num_workers=2, prefetch_factor=3, pin_memory=True)
    with pytest.warns(UserWarning, match="pin_memory"):  # no accelerator on a CPU machine
        next(build_dataloader(config, dataset=Numbers(8)).iterate(0))
        next(build_dataloader(config, seq_len=4, vocab_size=8).iterate(0))
    for kwargs in made:
        assert kwargs["num_workers"] == 2
        assert kwargs["prefetch_factor"] == 3
        assert kwargs["pin_memory"] is True
    assert made[0]["batch_size"] == 2 and made[1]["batch_size"] is None
    made.clear()
    next(build_dataloader(data_config(micro_batch_size=2), dataset=Numbers(8)).iterate(0))
    assert made[0]["num_workers"] == 0 and "prefetch_factor" not in made[0]


# ------------------------------------------------------------------ errors
def text_config(path) -> SpeedtronicConfig:
    return data_config(micro_batch_size=2, text_path=str(path))


def test_missing_directory_and_empty_text_paths_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    for path, words in ((missing, "not found"), (tmp_path, "not a regular file"), (empty, "empty")):
        with pytest.raises(DataError, match=words) as info:
            build_dataloader(text_config(path), seq_len=8, vocab_size=256)
        assert str(path) in str(info.value) and "data.text_path" in str(info.value)


def test_unreadable_text_path_names_the_path(tmp_path, monkeypatch):
    path = tmp_path / "secret.txt"
    path.write_text("some text\n")

    def refuse(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(data_text, "open", refuse, raising=False)  # root ignores chmod 000
    with pytest.raises(DataError, match="cannot read") as info:
        build_dataloader(text_config(path), seq_len=8, vocab_size=256)
    assert str(path) in str(info.value)


def test_text_too_short_or_yielding_no_block_is_an_error(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DataError, match="fewer than one block") as info:
        build_dataloader(text_config(short), seq_len=8, vocab_size=256)
    assert str(short) in str(info.value)
    source = build_dataloader(
        text_config(short), tokenizer=lambda text: [1, 2], seq_len=8, vocab_size=256
    )
    with pytest.raises(DataError, match="yields no block") as info:
        next(source.iterate(0))
    assert str(short) in str(info.value)


def test_data_limits_must_fit_the_model(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello world " * 10)
    with pytest.raises(DataError, match="at least 256"):
        build_dataloader(text_config(text), seq_len=8, vocab_size=100)
    with pytest.raises(DataError, match=r"data\.seq_len is 32 but the model's max_seq_len is 16"):
        build_dataloader(data_config(seq_len=32), seq_len=16, vocab_size=10)
    with pytest.raises(DataError, match=r"data\.vocab_size is 64"):
        build_dataloader(data_config(vocab_size=64), seq_len=16, vocab_size=10)
    source = build_dataloader(
        data_config(micro_batch_size=2, seq_len=4, vocab_size=5), seq_len=16, vocab_size=10
    )
    batch = next(source.iterate(0))
    assert batch["input_ids"].shape == (2, 4) and batch["input_ids"].max() < 5


def test_empty_map_dataset_is_an_error():
    with pytest.raises(DataError, match="empty"):
        build_dataloader(data_config(), dataset=Numbers(0))


def test_the_data_package_keeps_every_name_of_the_single_module_and_stays_light():
    import importlib
    import subprocess
    import sys

    import speedtronic.data as package

    old = ["IGNORE_INDEX", "Batch", "ByteTextStream", "DataSource", "IndexedTokenStream",
           "SyntheticTokenStream", "TokenizedTextStream", "Tokenizer", "build_dataloader",
           "byte_tokenizer", "check_text_file", "repeat_epochs", "split_windows", "BYTE_VOCAB",
           "DataLoader", "_loader", "_skip", "_user_source"]  # fmt: skip
    for name in [*old, *package.__all__]:
        assert getattr(package, name) is not None, name
    for module in ("streams", "synthetic", "text", "source", "user", "loader", "shards",
                   "format", "documents", "encoders", "preparation", "prepare_cli"):  # fmt: skip
        assert importlib.import_module(f"speedtronic.data.{module}").__all__
    # `prepare` is the function even once its module is imported.
    assert callable(package.prepare) and not isinstance(package.prepare, type(package))
    # The prepare side (and its spawned workers) never pays for importing torch.
    probe = "import sys, speedtronic.data.preparation; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
