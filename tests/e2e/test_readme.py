"""README.md's commands and snippets, run in order as a new user would, in a fresh directory
holding a copy of ``configs/`` (the README runs from the repository root).

Parsed from README.md itself, so the test breaks when the README does. What is not run, and
why:

- the venv and ``pip install`` parts of the set-up line: this test uses the environment it runs
  in, where the four distributions are installed already;
- ``nox`` and ``pip install nox`` (the test and CI commands: this test is part of them);
- ``text`` blocks (alternative install commands for other machines, not steps to follow).

The DiLoCo block's three commands are "one per terminal": they run at the same time, with
``--max-steps`` appended to keep the suite short (each node runs 150 steps instead of the
config's 3000), the one change made to any command.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SKIPPED = (
    ("python3", "-m", "venv"),
    (".",),
    ("pip", "install"),
    ("python3", "-m", "pip", "install"),
    ("python3", "-m", "nox"),
)
DILOCO_STEPS = "150"


def blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block of README.md, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [(match.group(1), match.group(2)) for match in FENCE.finditer(text)]


def commands(body: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, ``&&``
    chains split, the skipped set-up steps left out."""
    joined = body.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            end = words.index("&&") if "&&" in words else len(words)
            command, words = words[:end], words[end + 1 :]
            if command and not any(tuple(command[: len(s)]) == s for s in SKIPPED):
                found.append(command)
    return found


def argv(command: list[str]) -> list[str]:
    assert command[0] == "speedtronic", f"the README runs something new: {command}"
    return [sys.executable, "-m", "speedtronic", *command[1:]]


def run(command: list[str], cwd: Path, env: dict[str, str]) -> None:
    started = time.perf_counter()
    done = subprocess.run(
        argv(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=1200
    )
    print(f"{time.perf_counter() - started:6.1f}s  {shlex.join(command)}")
    assert done.returncode == 0, f"{shlex.join(command)} failed:\n{done.stderr[-3000:]}"


def test_the_readme_parses_into_the_steps_this_test_runs() -> None:
    languages = [language for language, _ in blocks()]
    assert "python" in languages and "bash" in languages
    setup = commands(blocks()[0][1])
    assert setup == [
        ["speedtronic", "train", "--config", "configs/smoke.yaml", "--output-dir", "runs/smoke"]
    ]


@pytest.mark.slow
def test_the_readme_runs_as_written_one_step_after_another(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    env = {**os.environ}
    env.pop("PYTHONPATH", None)  # only what is installed, as for a user
    for language, body in blocks():
        if language == "python":
            started = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True,
                text=True, timeout=1200,
            )  # fmt: skip
            print(f"{time.perf_counter() - started:6.1f}s  python snippet")
            assert done.returncode == 0, f"README snippet failed:\n{body}\n{done.stderr[-3000:]}"
            continue
        if language != "bash":
            continue
        steps = commands(body)
        if any("configs/diloco.yaml" in step for step in steps):
            nodes = [argv([*step, "--max-steps", DILOCO_STEPS]) for step in steps]
            started = time.perf_counter()
            processes = [
                subprocess.Popen(
                    node,
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for node in nodes
            ]
            for process in processes:
                _, stderr = process.communicate(timeout=1800)
                assert process.returncode == 0, stderr[-3000:]
            print(f"{time.perf_counter() - started:6.1f}s  the DiLoCo demo ({DILOCO_STEPS} steps)")
            continue
        for step in steps:
            run(step, tmp_path, env)
