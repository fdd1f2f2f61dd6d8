"""The generated docs pages match the code, and the hand-written ones match what they show."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from core.plugin_fixtures import THROWAWAY, plugin_env

from speedtronic import cli, docgen, hookimpl, plugins
from speedtronic.config import CORE_SECTIONS
from speedtronic.schema import Section, option

DOCS = Path(__file__).parents[2] / "docs"
REGENERATE = "regenerate it: {command}"


def test_configuration_reference_is_generated_from_the_schema() -> None:
    page = (DOCS / "configuration.md").read_text()
    assert page == docgen.render_config_reference(), REGENERATE.format(
        command=docgen.CONFIG_COMMAND
    )


def test_hook_reference_is_generated_from_the_hookspecs() -> None:
    page = (DOCS / "hooks.md").read_text()
    assert page == docgen.render_hook_reference(), REGENERATE.format(command=docgen.HOOKS_COMMAND)


@pytest.mark.parametrize(("page", "file"), [("config", "configuration.md"), ("hooks", "hooks.md")])
def test_the_regeneration_command_reproduces_the_page(page: str, file: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "speedtronic.docgen", page],
        env=plugin_env(load=""), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == (DOCS / file).read_text()


def test_configuration_reference_documents_every_field() -> None:
    page = docgen.render_config_reference()
    for name, section in CORE_SECTIONS.items():
        assert f"## `{name}`" in page
        for field in section.__dataclass_fields__.values():
            assert f"| `{field.name}` |" in page, f"{name}.{field.name}"
            assert field.metadata.get("help"), f"{name}.{field.name} has no help text"


@dataclass
class DocsTestConfig(Section):
    """A plugin section for the reference page."""

    depth: int = option(3, ge=1, help="How deep to go.")


class DocsTestPlugin:
    @hookimpl
    def config_sections(self) -> dict[str, type]:
        return {"core_test_docs": DocsTestConfig}


def test_plugin_sections_are_documented_on_request() -> None:
    name = plugins.register(DocsTestPlugin(), name="core-test-docs")
    try:
        core_only = docgen.render_config_reference()
        with_plugins = docgen.render_config_reference(include_plugins=True)
    finally:
        plugins.unregister(name)
    assert "core_test_docs" not in core_only  # the committed page does not depend on plugins
    assert with_plugins.startswith(core_only.rstrip("\n"))
    assert "### `core_test_docs` (from an installed plugin)" in with_plugins
    assert "| `depth` | int | `3` | How deep to go. Must be >= 1. |" in with_plugins


def test_the_plugin_page_shows_the_tested_example_verbatim() -> None:
    page = (DOCS / "plugins.md").read_text()
    files = [p for p in THROWAWAY.rglob("*") if p.is_file() and p.suffix in (".py", ".toml")]
    assert len(files) == 4
    for path in files:
        if path.name == "__init__.py":
            continue  # a docstring only; the page says so
        assert path.read_text() in page, f"docs/plugins.md is out of date with {path.name}"
    for hook in ("build_model", "config_sections", "on_metric", "register_commands"):
        assert f"def {hook}(" in page


def test_the_cli_page_documents_every_option() -> None:
    page = (DOCS / "cli.md").read_text()
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in ("train", "validate", "plugins"):
        assert f"## `speedtronic {name}`" in page
        for action in commands[name]._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help", "--debug"):
                    assert f"`{flag}" in page, f"{name} {flag} is not documented"
    assert "--debug" in page and "SPEEDTRONIC_LOAD_PLUGINS" in page
