"""Per-node data with real processes: two nodes started from one config (``data.text_path``, no
``num_nodes``/``node_rank``) read different samples, so their step losses differ from the very
first step; with ``data.node_split: none`` they read the same stream and their losses are equal.
The ``train_start`` event says how each node's data was split."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from diloco_nodes import master_and_workers, run_together, write_config

pytestmark = pytest.mark.slow

STEPS = 3


def text_file(path: Path) -> Path:
    """A few hundred lines of varied words: every block of it is different."""
    rng = random.Random(0)
    words = ["pride", "prejudice", "letter", "ball", "sister", "estate", "walk", "rain", "tea"]
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(400))
    path.write_text("\n".join(lines) + "\n")
    return path


def pair(tmp_path: Path, text: Path, node_split: str) -> list:
    tmp_path.mkdir()
    config = write_config(
        tmp_path,
        run={"max_steps": STEPS},
        model={"vocab_size": 256},
        data={"micro_batch_size": 4, "text_path": str(text), "node_split": node_split},
        logging={"log_every": 1},
        checkpoint={"save_final": False},
        # No boundary before the last step: both nodes train from the same initial weights.
        distributed={"inner_steps": 50, "round_timeout": 5},
    )
    return master_and_workers(tmp_path, config, workers=1)


def step_losses(node) -> list[float]:
    return [e["loss"] for e in node.events("step")]


def test_nodes_of_one_config_read_their_own_samples_unless_node_split_none(
    tmp_path: Path,
) -> None:
    text = text_file(tmp_path / "corpus.txt")
    own = pair(tmp_path / "auto", text, "auto")
    same = pair(tmp_path / "none", text, "none")
    # Both runs at once (they share nothing but the text file), and every node starts training
    # together: a worker that started after its master had finished would install the master's
    # trained global at train start, and its first loss would differ for that reason alone.
    run_together(own + same, tmp_path / "barrier")
    own_losses = [step_losses(node) for node in own]
    same_losses = [step_losses(node) for node in same]
    assert all(len(losses) == STEPS for losses in own_losses + same_losses)
    assert own_losses[0][0] != own_losses[1][0]  # different samples from step 1
    assert same_losses[0] == same_losses[1]  # the same stream, step for step
    splits = {
        (case, node.node_id): node.events("train_start")[0]["data"]["split"]
        for case, group in (("auto", own), ("none", same))
        for node in group
    }
    assert splits[("auto", "master")].startswith("own order (participant seed ")
    assert splits[("auto", "master")] != splits[("auto", "w1")]
    assert splits[("none", "master")] == splits[("none", "w1")] == "not split"
