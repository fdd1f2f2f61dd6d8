"""Every CLI example in the docs runs, as written (issue 24).

The examples are the lines of README.md and docs/*.md that call ``speedtronic`` (or
``python -m speedtronic``), optionally after ``VAR=value`` assignments:

- in ```` ```bash ```` blocks: a command that must succeed (exit status 0);
- in ```` ```text ```` / ```` ```console ```` blocks, after ``$ ``: a command shown with its
  output; when that output has an ``error: ...`` line, the command must fail with exactly that
  line (``...`` in the documented line stands for any text).

Each page is one session of a reader: its commands run in document order in a scratch working
directory that holds a copy of ``configs/``, the files the page writes itself (a
``cat > FILE <<'EOF'`` heredoc in a bash block, or a code block right after an
``<!-- file: NAME -->`` comment), and stand-ins for the files the docs treat as the reader's own
(:data:`READER_FILES`). Other shell lines (``pip install``, ``ls``, ``export``) are not run.

The fast test parses every command with the real parser and validates the config and overrides
it names; the slow one runs them (in this process, through ``speedtronic.cli.main``, the
console script's entry point) except those in :data:`NOT_RUN`, each with its reason: commands
that need other processes running beside them, the network, or long training. README.md and
docs/tutorial.md are run by ``tests/e2e/test_readme.py`` instead, as a new user runs them: in a
fresh venv built the way the README says.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from core.plugin_fixtures import install_fixture_plugins, plugin_env

from speedtronic import cli, plugins, registry

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]

NEEDS_PEERS = (
    "a DumbDiLoCo master and its workers must run at the same time (the e2e tests run them)"
)
NEEDS_HUB = "needs a Hugging Face Hub repository and token (network)"
NEEDS_TOKENIZER = "needs a Hugging Face tokenizer.json, which nothing here may download"
LONG_RUN = "2000 steps of a 4-layer, 256-token model: minutes of CPU"
NEEDS_STORE = "needs the store of a running DumbDiLoCo run"
# The time budget: a reference page that shows `train` beside `validate` has its training
# examples parsed and validated only; README.md and tutorial.md train the same config for real.
REFERENCE = "the reference page's train examples are parsed and validated (the time budget)"

PLOTS_OTHER_RUNS = "draws runs this page does not train (README.md and tutorial.md plot theirs)"
# (page, command as written, continuations joined) -> why it is only parsed and validated.
NOT_RUN: dict[tuple[str, str], str] = {
    **{
        (page, command): NEEDS_PEERS
        for page in ("README.md", "docs/diloco.md")
        for command in (
            "speedtronic train -c configs/diloco.yaml --set distributed.role=master "
            "--set distributed.node_id=master --output-dir runs/diloco/master",
            "speedtronic train -c configs/diloco.yaml --set distributed.node_id=worker-1 "
            "--output-dir runs/diloco/worker-1",
            "speedtronic train -c configs/diloco.yaml --set distributed.node_id=worker-2 "
            "--output-dir runs/diloco/worker-2",
        )
    },
    (
        "docs/diloco.md",
        "speedtronic train -c configs/diloco.yaml --set distributed.repo_id=your-org/diloco-demo "
        "--set distributed.role=master --set distributed.node_id=master "
        "--output-dir runs/diloco/master",
    ): NEEDS_HUB,
    (
        "docs/cli.md",
        "speedtronic data prepare web/*.jsonl.gz --out data/gpt2 --tokenizer gpt2/tokenizer.json "
        "--workers 8",
    ): NEEDS_TOKENIZER,
    (
        "docs/data.md",
        "speedtronic data prepare my_corpus/ --out data/gpt2 "
        "--tokenizer ~/tokenizers/gpt2/tokenizer.json",
    ): NEEDS_TOKENIZER,
    (
        "docs/data.md",
        "speedtronic train --config configs/shards.yaml --set data.shards=data/my_corpus",
    ): LONG_RUN,
    (
        "docs/models.md",
        "speedtronic export --config diloco-worker.yaml --global --out exports/global",
    ): NEEDS_STORE,
    (
        "docs/monitoring.md",
        "speedtronic diloco status -c configs/diloco.yaml --run-dir runs/diloco/master "
        "--plot rounds.png",
    ): NEEDS_STORE,
    **{
        ("docs/cli.md", command): PLOTS_OTHER_RUNS
        for command in (
            "speedtronic plot runs/tutorial --out curves.png",
            "speedtronic plot runs/lr-3e-3 runs/lr-1e-3 --out compare.png --x tokens",
        )
    },
    **{
        ("docs/cli.md", command): REFERENCE
        for command in (
            "speedtronic train --config configs/smoke.yaml",
            "speedtronic train --config configs/smoke.yaml --max-steps 200 --output-dir runs/long "
            "--resume",
            "speedtronic train -c run.yaml --set data.micro_batch_size=4 --set optimizer.lr=1e-3",
            # (the text as parsed: shell quotes removed)
            "speedtronic generate -c run.yaml -p The  --max-new-tokens 500 --temperature 0.8 "
            "--top-k 40 --seed 1",
        )
    },
}

# Pages written for a reader who has already trained: what they ran before, run first.
BEFORE = {
    # export and generate read the smoke run's checkpoints: latest, best and step 50
    "docs/models.md": "speedtronic train --config configs/smoke.yaml --max-steps 50 "
    "--set checkpoint.keep_best=true",
    # eval, export and generate read the run in runs/demo (its latest and best checkpoints)
    "docs/cli.md": "speedtronic train --config configs/smoke.yaml --output-dir runs/demo "
    "--set checkpoint.keep_best=true",
}

# Pages whose examples need a plugin distribution installed first: the shell line the page
# shows for it, answered by installing the test fixture the page reproduces verbatim
# (tests/core/test_docs.py checks that). These pages run in subprocesses that see it.
INSTALLS = {"docs/plugins.md": "pip install -e ./speedtronic-throwaway"}
INSTALLED_PLUGIN = "speedtronic-throwaway"

SHELL_OPERATORS = {"&&", "||", "|", ";", ">", ">>", "<", "&"}
HEREDOC = re.compile(r"^cat\s+>\s*(?P<file>\S+)\s+<<-?\s*'?(?P<tag>\w+)'?\s*$")
FENCE = re.compile(
    r"^(?:<!-- file: (?P<file>\S+) -->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$",
    re.M | re.S,
)
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # the tokens as written, continuations joined, comments dropped
    argv: tuple[str, ...]  # after `speedtronic`
    env: tuple[tuple[str, str], ...] = ()
    module: bool = False  # `python -m speedtronic`
    expect_error: str | None = None  # the documented `error: ...` line

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


@dataclass(frozen=True)
class WriteFile:
    page: str
    line: int
    name: str
    content: str


@dataclass
class Page:
    name: str
    steps: list[Command | WriteFile] = field(default_factory=list)
    shell: list[str] = field(default_factory=list)  # the lines that are not run

    @property
    def commands(self) -> list[Command]:
        return [s for s in self.steps if isinstance(s, Command)]


def parse_command(page: str, line: int, source: str) -> Command | None:
    """A ``speedtronic`` command line, or None for any other shell line."""
    tokens = shlex.split(source, comments=True)
    env = []
    while tokens and ENV_ASSIGNMENT.match(tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env.append((key, value))
    if tokens[:1] == ["speedtronic"]:
        argv, module = tokens[1:], False
    elif tokens[:3] in (["python", "-m", "speedtronic"], ["python3", "-m", "speedtronic"]):
        argv, module = tokens[3:], True
    else:
        return None
    operators = SHELL_OPERATORS.intersection(argv)
    assert not operators, f"{page}:{line}: this test cannot run {operators} in {source!r}"
    text = " ".join([*(f"{k}={v}" for k, v in env), *tokens])
    return Command(page, line, text, tuple(argv), tuple(env), module)


def logical_lines(body: str, first_line: int) -> Iterator[tuple[int, str]]:
    """Lines of a shell block with ``\\`` continuations joined, numbered in the page."""
    pending, start = "", first_line
    for offset, raw in enumerate(body.splitlines()):
        if not pending:
            start = first_line + offset
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        yield start, pending + raw
        pending = ""
    if pending:
        yield start, pending


def read_page(name: str) -> Page:
    text = (ROOT / name).read_text()
    page = Page(name)
    for match in FENCE.finditer(text):
        first = text.count("\n", 0, match.start("body")) + 1
        lang, body = match.group("lang"), match.group("body")
        if match.group("file"):
            page.steps.append(WriteFile(name, first, match.group("file"), body))
        elif lang in ("bash", "sh", "shell"):
            read_shell_block(page, body, first)
        elif lang in ("text", "console"):
            read_transcript(page, body, first)
    return page


def read_shell_block(page: Page, body: str, first: int) -> None:
    lines = list(logical_lines(body, first))
    index = 0
    while index < len(lines):
        number, source = lines[index]
        index += 1
        heredoc = HEREDOC.match(source.strip())
        if heredoc:
            content = []
            while lines[index][1] != heredoc.group("tag"):
                content.append(lines[index][1] + "\n")
                index += 1
            index += 1
            page.steps.append(WriteFile(page.name, number, heredoc.group("file"), "".join(content)))
            continue
        if not source.strip() or source.lstrip().startswith("#"):
            continue
        command = parse_command(page.name, number, source)
        if command is None:
            page.shell.append(source.strip())
        else:
            page.steps.append(command)


def read_transcript(page: Page, body: str, first: int) -> None:
    """``$ command`` lines of an output block, each with the `error:` line shown after it."""
    current: Command | None = None
    for number, source in logical_lines(body, first):
        if source.startswith("$ "):
            if current is not None:
                page.steps.append(current)
            current = parse_command(page.name, number, source[2:])
        elif current is not None and source.startswith("error: ") and not current.expect_error:
            current = Command(**{**current.__dict__, "expect_error": source})
    if current is not None:
        page.steps.append(current)


DOCS = {name: read_page(name) for name in PAGES}
ALL_COMMANDS = [c for page in DOCS.values() for c in page.commands]
# README.md and the tutorial run as written, in a fresh venv built the way the README says,
# in tests/e2e/test_readme.py: here they are parsed and validated (the time budget).
RUN_IN_A_FRESH_VENV = ("README.md", "docs/tutorial.md")
RUN_PAGES = [
    name
    for name, page in DOCS.items()
    if name not in RUN_IN_A_FRESH_VENV
    and any((c.page, c.text) not in NOT_RUN for c in page.commands)
]


# ----------------------------------------------------------------- the reader's own files
def _text(seed: int, lines: int) -> str:
    words = ("the", "a", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "seven", "hex")
    state = seed
    out = []
    for _ in range(lines):
        row = []
        for _ in range(12):
            state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
            row.append(words[(state >> 33) % len(words)])
        out.append(" ".join(row) + ".\n")
    return "".join(out)


def _own_config() -> str:
    smoke = (ROOT / "configs" / "smoke.yaml").read_text()
    assert "output_dir: runs/smoke" in smoke
    return smoke.replace("output_dir: runs/smoke", "output_dir: runs/my-run")


def _worker_config() -> str:
    diloco = (ROOT / "configs" / "diloco.yaml").read_text()
    assert "\n  role: worker" in diloco
    return diloco.replace("\n  role: worker", "\n  node_id: worker-1\n  role: worker")


READER_FILES = {
    # "your config": the smoke run, writing elsewhere than configs/smoke.yaml does
    "run.yaml": _own_config,
    "diloco-worker.yaml": _worker_config,
    "my_text.txt": lambda: _text(1, 2000),
    "my_eval.txt": lambda: _text(2, 200),
    **{f"my_corpus/doc-{i:02d}.txt": (lambda i=i: _text(100 + i, 60)) for i in range(30)},
}


def workdir_for(page: Page, tmp_path: Path) -> Path:
    cwd = tmp_path / page.name.replace("/", "_")
    cwd.mkdir()
    shutil.copytree(ROOT / "configs", cwd / "configs")
    for name, make in READER_FILES.items():
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / name).write_text(make())
    return cwd


def write(step: WriteFile, cwd: Path) -> None:
    path = cwd / step.name
    assert path.resolve().is_relative_to(cwd.resolve()), step
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(step.content)


# ----------------------------------------------------------------- the fast checks
def test_the_docs_have_examples_and_every_one_is_understood() -> None:
    assert len(ALL_COMMANDS) >= 30, [c.where for c in ALL_COMMANDS]
    for page in ("README.md", "docs/tutorial.md", "docs/cli.md", "docs/troubleshooting.md"):
        assert DOCS[page].commands, f"no CLI example found in {page}"
    known = {(c.page, c.text) for c in ALL_COMMANDS}
    stale = sorted(set(NOT_RUN) - known)
    assert not stale, f"NOT_RUN names commands the docs no longer show: {stale}"
    for page, line in INSTALLS.items():
        assert line in DOCS[page].shell, f"{page} no longer shows {line!r}"


def _parse(command: Command) -> argparse.Namespace | None:
    parser = cli.build_parser()
    try:
        return parser.parse_args(list(command.argv))
    except SystemExit as exc:  # --help / --version print and exit 0; a bad flag exits 2
        assert exc.code == 0, f"{command.where}: the parser refuses it"
        return None


@pytest.mark.parametrize("name", [n for n in PAGES if n not in INSTALLS and DOCS[n].commands])
def test_every_command_parses_and_its_config_validates(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    page = DOCS[name]
    cwd = workdir_for(page, tmp_path)
    for step in page.steps:
        if isinstance(step, WriteFile):
            write(step, cwd)
    monkeypatch.chdir(cwd)
    for command in page.commands:
        args = _parse(command)
        if args is None or command.expect_error or not getattr(args, "config", None):
            continue
        # What `train` and `validate` read before anything else: the file and the overrides.
        cli.load_config(args)
    capsys.readouterr()


# ----------------------------------------------------------------- running them
@contextmanager
def reader_session(command: Command, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The command's environment, its import path, and no trace of it in this process after."""
    plugins.load_plugins()  # the installed plugins stay; only what the command adds goes
    factories = dict(registry._FACTORIES)
    registered = {plugins.pm.get_name(p) for p in plugins.pm.get_plugins()}
    modules = set(sys.modules)
    with monkeypatch.context() as patch:
        for key, value in command.env:
            patch.setenv(key, value)
            if key == "PYTHONPATH":
                for entry in value.split(os.pathsep):
                    patch.syspath_prepend(str((cwd / entry).resolve()))
        if command.module:  # `python -m` puts the working directory first on sys.path
            patch.syspath_prepend(str(cwd))
        try:
            yield
        finally:
            registry._FACTORIES.clear()
            registry._FACTORIES.update(factories)
            for plugin in list(plugins.pm.get_plugins()):
                name = plugins.pm.get_name(plugin)
                if name not in registered:
                    plugins.unregister(name)
            for module in set(sys.modules) - modules:
                file = getattr(sys.modules[module], "__file__", None) or ""
                if file.startswith(str(cwd)):
                    del sys.modules[module]


def run_in_process(
    command: Command, cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> tuple[int, str]:
    with reader_session(command, cwd, monkeypatch):
        try:
            code = cli.main(list(command.argv))
        except SystemExit as exc:  # --help, --version: argparse exits, as the script would
            code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


def run_in_subprocess(command: Command, cwd: Path, site: Path) -> tuple[int, str]:
    env = plugin_env(site, load=INSTALLED_PLUGIN, **dict(command.env))
    if command.module:
        env["PYTHONPATH"] = os.pathsep.join([str(cwd), env["PYTHONPATH"]])
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", *command.argv],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def matches(documented: str, printed: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in documented.split("..."))
    return re.fullmatch(pattern, printed) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN_PAGES)
def test_every_command_runs_as_written(
    name: str,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    page = DOCS[name]
    cwd = workdir_for(page, tmp_path)
    site = install_fixture_plugins(tmp_path_factory) if name in INSTALLS else None
    monkeypatch.chdir(cwd)
    before = [parse_command(name, 0, BEFORE[name])] if name in BEFORE else []
    for step in [*before, *page.steps]:
        if isinstance(step, WriteFile):
            write(step, cwd)
            continue
        if (step.page, step.text) in NOT_RUN:
            continue
        if site is not None:
            code, output = run_in_subprocess(step, cwd, site)
        else:
            code, output = run_in_process(step, cwd, monkeypatch, capsys)
        assert "Traceback" not in output, f"{step.where}\n{output}"
        if step.expect_error is None:
            assert code == 0, f"{step.where}: exit status {code}\n{output[-3000:]}"
            continue
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert code == 2 and errors, f"{step.where}: expected {step.expect_error!r}\n{output}"
        assert matches(step.expect_error, errors[-1]), (
            f"{step.where}: the page shows\n  {step.expect_error}\nbut the command printed\n"
            f"  {errors[-1]}"
        )
