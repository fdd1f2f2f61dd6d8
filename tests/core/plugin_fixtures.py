"""Real plugin distributions for the core tests, and a way to run the CLI against them.

The distributions under ``fixtures/`` are pip-installed once per session into a temporary
``--target`` directory. Only subprocesses see them (through ``PYTHONPATH``): the test process
and the environment's site-packages are left untouched, so nothing needs uninstalling.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"
THROWAWAY = FIXTURES / "throwaway_plugin"
BROKEN = FIXTURES / "broken_plugin"

_sites: dict[str, Path] = {}


def install_fixture_plugins(tmp_path_factory: Any) -> Path:
    """Install both fixture distributions into a fresh directory (once per session)."""
    if "site" in _sites:
        return _sites["site"]
    root = tmp_path_factory.mktemp("plugin-dists")
    sources = []
    for source in (THROWAWAY, BROKEN):
        # pip builds a local project in place (build/, *.egg-info): build a copy instead.
        copy = root / source.name
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        sources.append(str(copy))
    site = root / "site"
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
        "--no-build-isolation", "--no-cache-dir", "--disable-pip-version-check",
        "--target", str(site), *sources,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"pip could not install the fixture plugins:\n{done.stderr}")
    _sites["site"] = site
    return site


# What the subprocesses load by default: the fixture plugins (when installed) and core's
# built-ins, not whatever else happens to be installed (that is slow and not under test).
FIXTURE_PLUGINS = "speedtronic-throwaway,speedtronic-throwaway-broken"
ALL_INSTALLED = None


def plugin_env(
    site: Path | None = None, load: str | None = "default", **extra: str
) -> dict[str, str]:
    """This process's environment, plus ``site`` on PYTHONPATH and ``extra`` variables.

    ``load`` becomes ``SPEEDTRONIC_LOAD_PLUGINS``: by default the fixture plugins (or none
    without ``site``); :data:`ALL_INSTALLED` loads every installed plugin.
    """
    env = dict(os.environ)
    env.pop("SPEEDTRONIC_LOAD_PLUGINS", None)
    if load == "default":
        load = FIXTURE_PLUGINS if site is not None else ""
    if load is not None:
        env["SPEEDTRONIC_LOAD_PLUGINS"] = load
    env["PYTHONUNBUFFERED"] = "1"
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``python -m speedtronic ARGS`` in a subprocess, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", *args],
        env=env if env is not None else plugin_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_python(
    code: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE`` in a subprocess, output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env if env is not None else plugin_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def user_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """Assert ``result`` is a clean user error (exit 2, no traceback); return its error line."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]
