"""Developer and CI sessions: tests, lint, docs, wheels.

The test path installs the CPU build of PyTorch through constraints-cpu.txt; the libraries'
own metadata only ask for torch>=2.1.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).parent
DISTRIBUTIONS = (
    "speedtronic-core",
    "speedtronic-models",
    "speedtronic-diloco",
    "speedtronic-logging",
)
CONSTRAINTS = ("-c", str(ROOT / "constraints-cpu.txt"))

nox.options.sessions = ["tests", "lint", "docs"]
nox.options.reuse_existing_virtualenvs = True


def install_all(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "torch")
    # Every optional ecosystem piece the tests exercise for real: tokenizers and pyarrow for
    # `data prepare`, matplotlib for `plot`, transformers for hf_causal_lm and export, W&B and
    # TensorBoard.
    extras = {
        "speedtronic-core": "[tokenizers,parquet,plot]",
        "speedtronic-models": "[transformers]",
        "speedtronic-logging": "[all]",
    }
    editable = [
        arg for dist in DISTRIBUTIONS for arg in ("-e", f"{ROOT / dist}{extras.get(dist, '')}")
    ]
    session.install(*CONSTRAINTS, *editable)
    session.install(*CONSTRAINTS, "-r", str(ROOT / "requirements-test.txt"))


@nox.session
def tests(session: nox.Session) -> None:
    """Install the four distributions (CPU torch) and run the test suite."""
    install_all(session)
    # Two workers (pytest-xdist): most of the suite's time is real subprocesses starting and
    # polling, which overlaps on two cores; every wait in the tests is a bounded poll.
    session.run("pytest", *(session.posargs or ["-q", "-n", "2"]))


def tracked_python_files() -> list[str]:
    """The Python files git tracks (a scratch file of yours in the checkout is not the
    project's); the whole tree where this is not a git checkout."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", "*.py"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return ["."]
    # Tracked but deleted in the working tree (not committed yet): nothing to lint.
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the Python files git tracks."""
    session.install("ruff==0.17.6")
    files = tracked_python_files()
    # --force-exclude: ruff.toml's exclusions apply to files named on the command line too.
    session.run("ruff", "check", "--force-exclude", *files)
    session.run("ruff", "format", "--check", "--force-exclude", *files)


@nox.session
def docs(session: nox.Session) -> None:
    """Build docs/ with mkdocs in strict mode, the API reference included (mkdocstrings reads
    the four distributions' sources statically: no torch; the config reference is checked by a
    test)."""
    session.install("-r", str(ROOT / "docs" / "requirements.txt"))
    session.run(
        "mkdocs", "build", "--strict",
        "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(ROOT / "site"),
    )  # fmt: skip


@nox.session
def benchmarks(session: nox.Session) -> None:
    """Re-measure every published figure into benchmarks/RESULTS.md (quick modes; pass
    ``-- --only NAME`` for some; not a default session: it takes many minutes)."""
    install_all(session)
    session.run("python", str(ROOT / "benchmarks" / "run_all.py"), "--quick", *session.posargs)


@nox.session
def wheels(session: nox.Session) -> None:
    """Build a wheel of every distribution, each on its own, into dist/; then prove that the
    core wheel alone (no plugins) gives a working ``speedtronic`` command."""
    session.install("build")
    dist_dir = ROOT / "dist"
    for dist in DISTRIBUTIONS:
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist_dir), str(ROOT / dist))
    core_wheel = max(dist_dir.glob("speedtronic_core-*.whl"), key=lambda p: p.stat().st_mtime)
    session.install(*CONSTRAINTS, "torch")
    session.install(*CONSTRAINTS, str(core_wheel))
    session.run("speedtronic", "--version")
    session.run("speedtronic", "plugins")
    session.run(
        "speedtronic", "validate", "--config", str(ROOT / "configs" / "smoke.yaml"), "--config-only"
    )
    # Without speedtronic-models the reference model is unknown: one clear error, exit 2.
    output = session.run(
        "speedtronic",
        "train",
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--output-dir",
        session.create_tmp(),
        success_codes=[2],
        silent=True,
    )
    if "speedtronic-models" not in (output or ""):
        session.error(f"the missing-plugin error does not name speedtronic-models: {output!r}")
