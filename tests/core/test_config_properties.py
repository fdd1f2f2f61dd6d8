"""Property-based tests: whatever a config file or an override holds, loading it either works
or raises one ConfigError, and the CLI answers with exit 0 or one ``error:`` line (exit 2).

Bounded (a fixed number of examples, no deadline) so the suite stays fast and deterministic.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speedtronic import SpeedtronicConfig, cli
from speedtronic.errors import SpeedtronicError

SECTIONS = [
    "run",
    "model",
    "data",
    "optimizer",
    "scheduler",
    "precision",
    "compile",
    "checkpoint",
    "logging",
    "distributed",
    "wandb",
    "tensorboard",
    "gradient_checkpointing",
    "seed",
    "max_steps",
]
KEYS = [
    "name",
    "seed",
    "device",
    "max_steps",
    "lr",
    "betas",
    "micro_batch_size",
    "target_batch_size",
    "interval",
    "mode",
    "enabled",
    "poll_interval",
    "outer_lr",
    "token",
    "vocab_size",
    "max_seq_len",
    "log_every",
    "params",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(string.printable, max_size=12),
    st.sampled_from(["auto", "cpu", "fp32", "bf16", ".inf", "1e300", "-1", "hf_token_abc"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.integers(0, 3)), children, max_size=3),
    ),
    max_leaves=8,
)
SECTION_VALUES = st.one_of(
    SCALARS,
    st.lists(VALUES, max_size=2),
    st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4),
    st.dictionaries(st.sampled_from(KEYS), SCALARS, min_size=1, max_size=4),
)
DOCUMENTS = st.dictionaries(st.sampled_from(SECTIONS), SECTION_VALUES, min_size=1, max_size=5)
BOUNDED = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _load(data: Any) -> None:
    try:
        SpeedtronicConfig.from_dict(data)
    except SpeedtronicError:
        pass


@BOUNDED
@given(DOCUMENTS)
def test_any_mapping_loads_or_raises_one_speedtronic_error(data: dict[str, Any]) -> None:
    _load(data)


@BOUNDED
@given(st.text(max_size=200))
def test_any_text_loads_or_raises_one_speedtronic_error(text: str) -> None:
    try:
        SpeedtronicConfig.from_string(text)
    except SpeedtronicError:
        pass


@BOUNDED
@given(
    st.lists(
        st.tuples(
            st.sampled_from([*SECTIONS, "run.seed", "optimizer.lr", "data.seq_len", "model.x"]),
            st.text(string.printable, max_size=20),
        ),
        max_size=3,
    )
)
def test_any_override_applies_or_raises_one_speedtronic_error(
    overrides: list[tuple[str, str]],
) -> None:
    try:
        SpeedtronicConfig().with_overrides([f"{key}={value}" for key, value in overrides])
    except SpeedtronicError:
        pass


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(DOCUMENTS)
def test_cli_validate_answers_with_exit_0_or_one_error_line(
    tmp_path_factory: Any, data: dict[str, Any]
) -> None:
    path = Path(tmp_path_factory.mktemp("prop")) / "config.yaml"
    try:
        path.write_text(yaml.safe_dump(data), encoding="utf-8")
    except (yaml.YAMLError, UnicodeEncodeError):
        return
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["validate", "--config", str(path)])
    lines = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    assert code in (0, 2)
    assert "Traceback" not in err.getvalue()
    if code == 2:
        assert len(lines) == 1
