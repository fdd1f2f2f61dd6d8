"""``speedtronic plot``: PNG pictures of real runs from their metrics JSONL, and its errors."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from core.toy_runs import tiny_transformer_run, train

from speedtronic import DataError
from speedtronic.cli import main
from speedtronic.observe.plot import read_run, run_panels, smooth

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two real 8-step runs with evaluation, one with a known peak (so it has mfu)."""
    root = tmp_path_factory.mktemp("plot-runs")
    made = []
    for name, extra in (("base", {}), ("peaked", {"peak_tflops": 0.01})):
        directory = root / name
        train(
            tiny_transformer_run(
                directory,
                run={"max_steps": 8, "threads": 1, **extra},
                eval={"every": 4, "batches": 1},
                checkpoint={"interval": 0, "save_final": False},
            )
        )
        made.append(directory)
    return made[0], made[1]


def test_plot_of_a_real_run_is_a_png(runs: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "curves.png"
    assert main(["plot", str(runs[0]), "--out", str(out)]) == 0
    width, height = png_size(out)
    assert width >= 800 and height >= 600 and out.stat().st_size > 20_000
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("x", ["step", "tokens", "time"])
def test_two_runs_overlaid_on_each_x_axis(runs: tuple[Path, Path], tmp_path: Path, x: str) -> None:
    out = tmp_path / f"both-{x}.png"
    assert main(["plot", str(runs[0]), str(runs[1]), "--out", str(out), "--x", x]) == 0
    png_size(out)
    panels = {p.title: p for p in run_panels([read_run(r) for r in runs], x)}  # type: ignore[arg-type]
    labels = {line.label for line in panels["loss"].lines if line.label}
    assert labels == {"base train", "base eval", "peaked train", "peaked eval"}
    # One run knows its peak: the efficiency panel is MFU, in percent of that peak.
    (mfu,) = panels["model FLOPs utilisation"].lines
    steps = read_run(runs[1]).steps()
    assert mfu.y == pytest.approx([100 * s["mfu"] for s in steps])
    assert panels["loss"].xlabel == {"step": "optimizer step", "tokens": "tokens",
                                     "time": "time (s)"}[x]  # fmt: skip


def test_a_resumed_run_is_one_curve_and_a_fresh_start_replaces_an_old_one(tmp_path: Path) -> None:
    lines = [
        {"event": "train_start", "start_step": 0, "time": 0.0},
        {"event": "step", "step": 1, "loss": 9.0, "tokens": 10, "time": 1.0},
        {"event": "train_start", "start_step": 0, "time": 5.0},  # a new run in the same dir
        {"event": "step", "step": 1, "loss": 3.0, "tokens": 10, "time": 6.0},
        {"event": "step", "step": 2, "loss": 2.5, "tokens": 20, "time": 7.0},
        {"event": "train_start", "start_step": 1, "time": 9.0},  # resumed from step 1
        {"event": "step", "step": 2, "loss": 2.0, "tokens": 20, "time": 10.0},
    ]
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(line) for line in lines) + '\n{"event": "st'  # torn last line
    )
    run = read_run(tmp_path)
    assert [(s["step"], s["loss"]) for s in run.steps()] == [(1, 3.0), (2, 2.0)]


def test_smoothing_keeps_a_short_run_as_it_is_and_smooths_a_long_one() -> None:
    assert smooth([5.0, 3.0, 2.0]) == [5.0, 3.0, 2.0]
    noisy = [1.0 if i % 2 else 0.0 for i in range(500)]
    assert max(smooth(noisy)[100:]) - min(smooth(noisy)[100:]) < 0.3


def cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def test_bad_inputs_are_one_clear_error(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "x.png")
    missing = tmp_path / "nowhere"
    assert cli_error(["plot", str(missing), "--out", out], capsys) == (
        f"error: run directory {missing} does not exist"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty} holds no metrics.jsonl" in cli_error(
        ["plot", str(empty), "--out", out], capsys
    )
    (empty / "metrics.jsonl").write_text("")
    assert "holds no metric events" in cli_error(["plot", str(empty), "--out", out], capsys)
    (empty / "metrics.jsonl").write_text('{"event": "train_start", "start_step": 0}\n')
    assert "no step records" in cli_error(["plot", str(empty), "--out", out], capsys)
    assert not Path(out).exists()


def test_without_matplotlib_the_error_names_the_extra(
    runs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    error = cli_error(["plot", str(runs[0]), "--out", str(tmp_path / "x.png")], capsys)
    assert "pip install 'speedtronic-core[plot]'" in error
    with pytest.raises(DataError, match=r"speedtronic-core\[plot\]"):
        from speedtronic.observe.plot import require_matplotlib

        require_matplotlib()
