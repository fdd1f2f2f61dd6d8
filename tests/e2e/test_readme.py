"""README.md's and docs/tutorial.md's shell commands, run as written, one after another, as a
new user would: in a fresh copy of the checkout, in the venv that the README's own set-up line
creates there (``python3 -m venv .venv && . .venv/bin/activate && pip install ...``).

Parsed from the pages themselves, so the test breaks when a page does. Each line of a ``bash``
block runs in ``bash`` from the copy's root with that venv activated (as it stays in the
reader's terminal after the set-up line), continuation lines joined; a ``python`` block runs in
the venv's Python; a ``$ command`` of a ``text`` block runs too, and must print the ``error:``
line shown under it; a block after ``<!-- file: NAME -->`` is written to NAME first. The
tutorial's stand-ins for the reader's own files (``my_text.txt``, ``my_corpus/``) are those of
``tests/core/test_docs_examples.py``. What is not run as written, and why (:data:`NOT_AS_WRITTEN`):

- ``nox`` and ``pip install nox``: the test and CI commands, of which this test is part;
- the inner loop, ``pytest -m "not slow"``: it runs with ``--collect-only`` (every test module
  imports in the venv the README's test-suite command built: the missing-distribution failure
  of issue 43) and then ``tests/test_test_environment.py`` (every optional piece the suite
  exercises is installed), a minute rather than the ten a full run takes on two cores;
- the DiLoCo block's three commands are "one per terminal": they run at the same time, with
  ``--max-steps`` appended (150 steps per node instead of the config's 3000).

``text`` blocks without a ``$`` line (alternative installs for other machines, output shown)
are not steps to follow. Every wait is a subprocess with a timeout.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/tutorial.md")
FENCE = re.compile(
    r"^(?:<!-- file: (?P<file>\S+) -->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$",
    re.M | re.S,
)
SETUP = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints-cpu.txt torch "
    "'./speedtronic-core[plot]' ./speedtronic-models && speedtronic train --config "
    "configs/smoke.yaml --output-dir runs/smoke"
)
INNER_LOOP = 'pytest -m "not slow"'
DILOCO_STEPS = "150"
CI_ITSELF = "the test and CI commands: this test is part of them"
NOT_AS_WRITTEN = {
    "python3 -m pip install nox && python3 -m nox -s tests lint wheels docs": CI_ITSELF,
    **{
        f"python3 -m nox -s {session}": CI_ITSELF
        for session in ('tests -- -m "not slow"', "tests", "lint", "docs", "wheels")
    },
    INNER_LOOP: "collected, then tests/test_test_environment.py run (the time budget)",
}
LONG_S = 1800  # the longest any one documented command may take (a venv build, busy cores)


@dataclass(frozen=True)
class Step:
    """One thing a page asks the reader to do, in page order."""

    page: str
    line: int
    kind: str  # "shell" | "python" | "transcript" | "file" | "terminals"
    text: str  # the shell line, the Python source or the file's content
    name: str = ""  # the file to write
    error: str = ""  # a transcript's documented `error: ...` line

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.text[:200]}"


def logical_lines(body: str) -> list[tuple[int, str]]:
    """(offset, line) of a shell block: ``\\`` continuations joined, blanks and comments out."""
    found, pending, start = [], "", 0
    for offset, raw in enumerate(body.splitlines()):
        if not pending:
            start = offset
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1].rstrip() + " "
            continue
        line = without_comment(pending + raw.strip())
        pending = ""
        if line and not line.startswith("#"):
            found.append((start, line))
    return found


def without_comment(line: str) -> str:
    """``line`` less a trailing ``# comment`` (a ``#`` outside quotes after a blank)."""
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].strip()
    return line.strip()


def steps(page: str) -> list[Step]:
    """Every step of ``page``, in order."""
    text = (ROOT / page).read_text(encoding="utf-8")
    found: list[Step] = []
    for match in FENCE.finditer(text):
        first = text.count("\n", 0, match.start("body")) + 1
        lang, body = match.group("lang"), match.group("body")
        if match.group("file"):
            found.append(Step(page, first, "file", body, name=match.group("file")))
        elif lang == "python":
            found.append(Step(page, first, "python", body))
        elif lang == "bash":
            lines = logical_lines(body)
            if any("configs/diloco.yaml" in line for _, line in lines):
                found.append(Step(page, first, "terminals", "\n".join(text for _, text in lines)))
                continue
            found.extend(Step(page, first + offset, "shell", line) for offset, line in lines)
        elif lang in ("text", "console"):
            found.extend(transcript(page, first, body))
    return found


def transcript(page: str, first: int, body: str) -> list[Step]:
    """The ``$ command`` lines of an output block, each with the ``error:`` line after it."""
    found: list[Step] = []
    for offset, line in enumerate(body.splitlines()):
        if line.startswith("$ "):
            found.append(Step(page, first + offset, "transcript", line[2:]))
        elif line.startswith("error: ") and found and not found[-1].error:
            last = found[-1]
            found[-1] = Step(last.page, last.line, last.kind, last.text, error=line)
    return found


# ----------------------------------------------------------------- the fast checks
def test_the_pages_parse_into_the_steps_this_test_runs() -> None:
    readme = steps("README.md")
    shell = [s.text for s in readme if s.kind == "shell"]
    assert shell[0] == SETUP, "the README's first command is no longer the set-up line"
    assert INNER_LOOP in shell and shell.index(INNER_LOOP) > 0
    assert [s.kind for s in readme].count("terminals") == 1
    assert {s.kind for s in readme} >= {"shell", "python", "terminals"}
    known = set(shell)
    assert not set(NOT_AS_WRITTEN) - known, "NOT_AS_WRITTEN names lines the README lost"
    tutorial = steps("docs/tutorial.md")
    assert [s.text for s in tutorial if s.kind == "shell"][:2] == [
        "python3 -m venv .venv && . .venv/bin/activate",
        "pip install -c constraints-cpu.txt torch './speedtronic-core[plot]' ./speedtronic-models",
    ]
    assert any(s.kind == "transcript" and s.error for s in tutorial)
    assert {s.name for s in tutorial if s.kind == "file"} == {"my_models.py", "my_run.yaml"}


def noxfile_install() -> tuple[tuple[str, ...], dict[str, str]]:
    """noxfile.py's DISTRIBUTIONS and install_all's extras, read statically (no nox here)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    distributions: tuple[str, ...] = ()
    extras: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "DISTRIBUTIONS":
                distributions = ast.literal_eval(node.value)
            elif node.targets[0].id == "extras":
                extras = ast.literal_eval(node.value)
    assert distributions and extras, "noxfile.py's install_all changed shape"
    return distributions, extras


def test_the_readme_installs_what_its_quickstart_and_the_test_suite_use() -> None:
    readme = [s.text for s in steps("README.md") if s.kind == "shell"]
    quickstart = [line for line in readme if line.startswith("speedtronic plot")]
    assert quickstart, "the Quickstart no longer plots"
    setup = shlex.split(readme[0])
    core = [word for word in setup if word.startswith("./speedtronic-core")]
    assert core and "plot" in core[0], f"the set-up line does not install plot's extra: {core}"
    # The test-suite command: the four distributions with exactly nox's extras, and the tools.
    distributions, extras = noxfile_install()
    suite = next(line for line in readme if "requirements-test.txt" in line)
    words = shlex.split(suite)
    assert words[:4] == ["pip", "install", "-c", "constraints-cpu.txt"]
    editable = [words[i + 1] for i, word in enumerate(words) if word == "-e"]
    assert editable == [f"./{dist}{extras.get(dist, '')}" for dist in distributions]
    assert words[-2:] == ["-r", "requirements-test.txt"]
    assert readme.index(suite) + 1 == readme.index(INNER_LOOP), "install, then the inner loop"


def test_reference_small_says_it_is_for_a_gpu_and_what_runs_on_a_cpu() -> None:
    from speedtronic import cli
    from speedtronic.engine.runtime import check_runtime

    header = []
    for line in (ROOT / "configs" / "reference-small.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    text = " ".join(header)
    assert "Sized for a GPU" in text and "configs/smoke.yaml" in text
    command = " ".join(line.rstrip("\\").strip() for line in header if line.startswith(
        ("speedtronic train", "--set")
    ))  # fmt: skip
    args = cli.build_parser().parse_args(shlex.split(command)[1:])
    config = cli.load_config(args)  # relative to the checkout root, as the reader runs it
    assert config.data.micro_batch_size * config.data.seq_len <= 1024  # a CPU-sized step
    assert not config.compile.enabled
    assert "time per step (estimate): about" in check_runtime(config)


# ----------------------------------------------------------------- running them
def copy_checkout(target: Path) -> None:
    """The files of this checkout a fresh clone has (tracked, or new and not ignored)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True, timeout=120,
        ).stdout.decode()  # fmt: skip
        names = [name for name in listed.split("\0") if name and (ROOT / name).is_file()]
    except (OSError, subprocess.SubprocessError):
        names = []
    if not names:  # not a git checkout: everything but what a build or a run leaves
        ignore = shutil.ignore_patterns(
            ".git", ".venv", ".nox", "runs", "__pycache__", "*.egg-info"
        )
        shutil.copytree(ROOT, target, ignore=ignore, dirs_exist_ok=True)
        return
    for name in names:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)


def reader_env() -> dict[str, str]:
    """This environment less what points into it: the reader's shell knows nothing of it, and
    a command the fresh venv lacks must fail, not fall through to this test's own venv."""
    env = dict(os.environ)
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "SPEEDTRONIC_LOAD_PLUGINS", "PYTEST_XDIST_WORKER"):
        env.pop(key, None)
    env["PATH"] = os.pathsep.join(
        entry for entry in env.get("PATH", "").split(os.pathsep)
        if not (Path(entry) / "activate").exists()  # no other venv's bin first
    )  # fmt: skip
    return env


def in_venv(line: str) -> list[str]:
    """``line`` in bash with the checkout's venv active, once the set-up line has made it."""
    return ["bash", "-c", f"if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi\n{line}"]


def shell(step: Step, line: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    done = subprocess.run(in_venv(line), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=LONG_S)  # fmt: skip
    print(f"{time.perf_counter() - started:6.1f}s  {line[:150]}", flush=True)
    return done


def expect_success(done: subprocess.CompletedProcess, step: Step) -> None:
    assert done.returncode == 0, (
        f"{step.where}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )


def run_step(step: Step, cwd: Path, env: dict[str, str]) -> None:
    if step.kind == "file":
        (cwd / step.name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / step.name).write_text(step.text)
    elif step.kind == "python":
        done = shell(step, f"python - <<'SNIPPET'\n{step.text}SNIPPET", cwd, env)
        expect_success(done, step)
    elif step.kind == "terminals":
        run_terminals(step, cwd, env)
    elif step.kind == "transcript":
        done = shell(step, step.text, cwd, env)
        if step.error:
            printed = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
            pattern = ".*".join(re.escape(part) for part in step.error.split("..."))
            assert done.returncode == 2 and printed, f"{step.where}\n{done.stderr[-3000:]}"
            assert re.fullmatch(pattern, printed[-1]), f"{step.where}\nprinted {printed[-1]}"
        else:
            expect_success(done, step)
    elif step.text == INNER_LOOP:
        done = shell(step, f"{INNER_LOOP} --collect-only -q", cwd, env)
        expect_success(done, step)
        collected = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", done.stdout)
        assert collected and int(collected.group(1)) > 100, done.stdout[-2000:]
        expect_success(shell(step, "pytest -q tests/test_test_environment.py", cwd, env), step)
    elif step.text not in NOT_AS_WRITTEN:
        expect_success(shell(step, step.text, cwd, env), step)


def run_terminals(step: Step, cwd: Path, env: dict[str, str]) -> None:
    """The "one per terminal" commands, at the same time."""
    started = time.perf_counter()
    processes = [
        subprocess.Popen(in_venv(f"{line} --max-steps {DILOCO_STEPS}"), cwd=cwd, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in step.text.splitlines()
    ]  # fmt: skip
    try:
        for process in processes:
            _, stderr = process.communicate(timeout=LONG_S)
            assert process.returncode == 0, f"{step.where}\n{stderr[-3000:]}"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=60)
    print(f"{time.perf_counter() - started:6.1f}s  the DiLoCo demo ({DILOCO_STEPS} steps)")


@pytest.mark.slow
def test_the_readme_and_the_tutorial_run_as_written_in_a_fresh_venv(tmp_path: Path) -> None:
    from core.test_docs_examples import READER_FILES

    checkout = tmp_path / "speedtronic"
    copy_checkout(checkout)
    for name, make in READER_FILES.items():  # the tutorial's "your own" files
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(make())
    env = reader_env()
    for page in PAGES:
        for step in steps(page):
            run_step(step, checkout, env)
    assert (checkout / ".venv" / "bin" / "speedtronic").exists()
