"""Seed-era import paths resolve lazily through speedtronic-diloco, and core never imports a
plugin package on its own. Each case runs in a fresh interpreter: a stand-in
``speedtronic_diloco`` on PYTHONPATH plays "installed", an import blocker plays "not installed"."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from core.plugin_fixtures import ALL_INSTALLED, plugin_env, run_python

import speedtronic
import speedtronic.config as config_module

SEED_ERA = {
    "from speedtronic import DumbDiLoCoCoordinator":
        "from speedtronic import DumbDiLoCoCoordinator as found",
    "from speedtronic import DumbDiLoCo": "from speedtronic import DumbDiLoCo as found",
    "from speedtronic import SyncResult": "from speedtronic import SyncResult as found",
    "import speedtronic.distributed": "import speedtronic.distributed as found",
    "speedtronic.distributed": "import speedtronic; found = speedtronic.distributed",
    "from speedtronic.distributed import DumbDiLoCoCoordinator":
        "from speedtronic.distributed import DumbDiLoCoCoordinator as found",
    "speedtronic.config.DistributedConfig":
        "import speedtronic.config; found = speedtronic.config.DistributedConfig",
}  # fmt: skip

# Runs every seed-era import in the same interpreter and reports what each gave.
PROBE = """
import json, sys
results = {}
for label, statement in STATEMENTS.items():
    scope = {}
    try:
        exec(statement, scope)
        found = scope["found"]
        results[label] = ["ok", getattr(found, "__qualname__", getattr(found, "__name__", ""))]
    except Exception as exc:
        results[label] = [type(exc).__name__, str(exc), getattr(exc, "name", None)]
print(json.dumps(results))
"""

BLOCK_DILOCO = """
import sys

class HideSpeedtronicDiloco:
    def find_spec(self, name, path=None, target=None):
        if name == "speedtronic_diloco" or name.startswith("speedtronic_diloco."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideSpeedtronicDiloco())
"""


def probe(prelude: str = "", pythonpath: Path | None = None) -> dict[str, list[Any]]:
    code = prelude + f"STATEMENTS = {SEED_ERA!r}\n" + PROBE
    result = run_python(code, env=plugin_env(pythonpath, load=""))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def fake_diloco(root: Path, body: str) -> Path:
    package = root / "speedtronic_diloco"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(body))
    return root


INSTALLED = """
    '''A stand-in for speedtronic-diloco with the seed-era public names.'''
    __version__ = "9.9.9"
    __all__ = ["DistributedConfig", "DumbDiLoCoCoordinator", "SyncResult"]

    class DistributedConfig:
        pass

    class DumbDiLoCoCoordinator:
        pass

    class SyncResult:
        pass
"""


def test_import_speedtronic_imports_no_plugin_and_no_torch() -> None:
    code = (
        "import sys\n"
        "import speedtronic, speedtronic.config, speedtronic.cli, speedtronic.plugins\n"
        "import speedtronic.schema, speedtronic.registry, speedtronic.hookspecs\n"
        "speedtronic.SpeedtronicConfig, speedtronic.register_model, speedtronic.hookimpl\n"
        "names = ('speedtronic_diloco', 'speedtronic_models', 'speedtronic_logging', 'torch')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in names))\n"
        "print(speedtronic.plugins.pm.get_plugins() == set())\n"
    )
    result = run_python(code, env=plugin_env(load=ALL_INSTALLED))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "True"]  # nothing imported, nothing loaded


def test_seed_era_names_resolve_when_the_distribution_is_installed(tmp_path: Path) -> None:
    root = fake_diloco(tmp_path, INSTALLED)
    results = probe(pythonpath=root)
    assert results == {
        "from speedtronic import DumbDiLoCoCoordinator": ["ok", "DumbDiLoCoCoordinator"],
        # DumbDiLoCo has always been the coordinator's alias.
        "from speedtronic import DumbDiLoCo": ["ok", "DumbDiLoCoCoordinator"],
        "from speedtronic import SyncResult": ["ok", "SyncResult"],
        "import speedtronic.distributed": ["ok", "speedtronic.distributed"],
        "speedtronic.distributed": ["ok", "speedtronic.distributed"],
        "from speedtronic.distributed import DumbDiLoCoCoordinator": [
            "ok", "DumbDiLoCoCoordinator",
        ],
        "speedtronic.config.DistributedConfig": ["ok", "DistributedConfig"],
    }  # fmt: skip


def test_seed_era_names_are_the_plugins_own_objects(tmp_path: Path) -> None:
    root = fake_diloco(tmp_path, INSTALLED)
    code = (
        "import speedtronic, speedtronic_diloco as d\n"
        "from speedtronic.distributed import *\n"
        "from speedtronic.config import DistributedConfig as C\n"
        "print(d.__file__)\n"
        "print(speedtronic.DumbDiLoCo is speedtronic.DumbDiLoCoCoordinator "
        "is d.DumbDiLoCoCoordinator is DumbDiLoCoCoordinator, speedtronic.SyncResult is "
        "SyncResult is d.SyncResult, C is DistributedConfig is d.DistributedConfig)\n"
    )
    result = run_python(code, env=plugin_env(root, load=""))
    assert result.returncode == 0, result.stderr
    where, identical = result.stdout.splitlines()
    assert where.startswith(str(root))  # the stand-in shadowed the real distribution
    assert identical == "True True True"


def test_seed_era_names_without_the_distribution_name_it() -> None:
    results = probe(prelude=BLOCK_DILOCO)
    assert set(results) == set(SEED_ERA)
    for label, (kind, message, *_) in results.items():
        assert kind == "ImportError", (label, kind, message)
        assert "speedtronic-diloco" in message and "pip install speedtronic-diloco" in message


def test_core_works_without_the_distribution() -> None:
    code = BLOCK_DILOCO + (
        "import speedtronic\n"
        "config = speedtronic.SpeedtronicConfig.from_dict({'max_steps': 3})\n"
        "print(config.run.max_steps)\n"
        "try:\n"
        "    speedtronic.SpeedtronicConfig.from_dict({'distributed': {'enabled': True}})\n"
        "except speedtronic.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    result = run_python(code, env=plugin_env(load=""))
    assert result.returncode == 0, result.stderr
    steps, error = result.stdout.splitlines()
    assert steps == "3"
    assert error.startswith("distributed: unknown key (provided by speedtronic-diloco")


def test_a_name_missing_from_an_installed_distribution_is_an_import_error(
    tmp_path: Path,
) -> None:
    root = fake_diloco(tmp_path, "__version__ = '0.0.1'\nclass DumbDiLoCoCoordinator: pass\n")
    results = probe(pythonpath=root)
    kind, message, _ = results["from speedtronic import SyncResult"]
    assert kind == "ImportError"
    assert message == (
        "the installed speedtronic-diloco (0.0.1) does not provide SyncResult; "
        "pip install --upgrade speedtronic-diloco"
    )
    assert results["from speedtronic import DumbDiLoCo"] == ["ok", "DumbDiLoCoCoordinator"]


def test_a_missing_dependency_inside_the_plugin_keeps_its_own_error(tmp_path: Path) -> None:
    root = fake_diloco(tmp_path, "import speedtronic_missing_dependency_xyz\n")
    results = probe(pythonpath=root)
    for kind, message, name in results.values():
        assert kind == "ModuleNotFoundError"
        assert name == "speedtronic_missing_dependency_xyz", message


def test_with_the_real_distribution_each_name_resolves_or_names_it() -> None:
    # Whatever state the installed speedtronic-diloco is in, users never see AttributeError.
    for name in ("DumbDiLoCoCoordinator", "DumbDiLoCo", "SyncResult"):
        try:
            value = getattr(speedtronic, name)
        except ImportError as exc:
            assert "speedtronic-diloco" in str(exc)
        else:
            assert isinstance(value, type)


def test_unknown_attributes_are_still_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        _ = speedtronic.NotAThing
    assert not hasattr(speedtronic, "NotAThing")
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        _ = config_module.NotAThing
