"""Train from Python: the reference transformer from a config, then a model and a dataset of
your own through the same engine.

    python examples/train_reference.py --steps 40 --output-dir runs/example

Both runs use the public API only: ``SpeedtronicConfig``, ``register_model`` and
``speedtronic.runtime.build_runtime``. Needs speedtronic-core and speedtronic-models.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from speedtronic import SpeedtronicConfig, register_model
from speedtronic.runtime import build_runtime


@register_model("example_bigram")
class Bigram(nn.Module):
    """Your own model: any nn.Module whose forward returns the loss."""

    def __init__(self, vocab_size: int = 64, max_seq_len: int = 32, width: int = 32) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(input_ids))
        return F.cross_entropy(logits.view(-1, self.vocab_size), labels.reshape(-1))


class CountingDataset(Dataset):
    """Your own data: sequences that count up modulo the vocabulary, labels shifted by one."""

    def __init__(self, vocab_size: int = 64, seq_len: int = 32, size: int = 512) -> None:
        self.vocab_size, self.seq_len, self.size = vocab_size, seq_len, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = (torch.arange(self.seq_len + 1) + index) % self.vocab_size
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


def reference_config(steps: int, output_dir: Path) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict(
        {
            "run": {"name": "example-reference", "device": "cpu", "max_steps": steps},
            "model": {
                "name": "reference_transformer",
                "vocab_size": 256,
                "max_seq_len": 32,
                "n_layer": 1,
                "n_head": 2,
                "d_model": 32,
            },
            "data": {"micro_batch_size": 8},
            "optimizer": {"lr": 3e-3},
            "precision": {"mode": "fp32"},
            "checkpoint": {"save_final": True},
            "logging": {"log_every": 10, "progress": False},
            "output_dir": str(output_dir / "reference"),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/example"))
    args = parser.parse_args()

    # 1. The reference transformer on the synthetic stream, as the YAML configs do.
    result = build_runtime(reference_config(args.steps, args.output_dir)).trainer.fit()
    print(f"reference: {result.steps} steps, final loss {result.final_loss:.3f}")

    # 2. Your model (registered above, so the config names it) and your dataset.
    config = SpeedtronicConfig.from_dict(
        {
            "run": {"name": "example-byo", "device": "cpu", "max_steps": args.steps},
            "model": {"name": "example_bigram", "vocab_size": 64, "max_seq_len": 32},
            "data": {"micro_batch_size": 16, "shuffle": True},
            "optimizer": {"lr": 1e-2},
            "precision": {"mode": "fp32"},
            "checkpoint": {"save_final": True},
            "logging": {"log_every": 10, "progress": False},
            "output_dir": str(args.output_dir / "byo"),
        }
    )
    runtime = build_runtime(config, dataset=CountingDataset())
    result = runtime.trainer.fit()
    print(f"your model: {result.steps} steps, final loss {result.final_loss:.3f}")


if __name__ == "__main__":
    main()
