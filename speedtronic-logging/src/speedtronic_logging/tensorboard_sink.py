"""The TensorBoard backend: event files written by ``torch.utils.tensorboard.SummaryWriter``.

torch ships the writer; it needs the ``tensorboard`` package (the ``[tensorboard]`` extra) for
the event-file format. The redacted config is written twice at the start: as a YAML text panel
and as the run's hyperparameters (HParams dashboard, with the outcome recorded at the end).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import yaml

from speedtronic_logging.config import TensorBoardConfig
from speedtronic_logging.extras import require
from speedtronic_logging.sink import BackendSink, RunStart, section_settings, settings_of

log = logging.getLogger("speedtronic.logging")

FEATURE = "TensorBoard logging (tensorboard.enabled, TensorBoardSink)"
# The scalar the HParams dashboard shows next to each run's hyperparameters.
HPARAMS_METRICS = ("train/loss",)


def load() -> Any:
    """Import the writer and the HParams protos, or raise the PluginError naming the extra.

    Only protobuf modules of ``tensorboard`` are used: its high-level summary API needs
    TensorFlow, which the extra does not install.
    """
    writer = require("torch.utils.tensorboard", "tensorboard", FEATURE)
    require("tensorboard.plugins.hparams.metadata", "tensorboard", FEATURE)
    return writer


def default_log_dir(run: RunStart) -> Path:
    """``<run.output_dir>/tensorboard``."""
    return run.output_dir / "tensorboard"


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """Nested config mappings as ``section.key`` hyperparameters (lists become JSON text)."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(list(value), default=str)
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        elif value is not None:  # HParams has no null; an unset option is simply absent
            flat[name] = str(value)
    return flat


def markdown_table(values: dict[str, Any]) -> str:
    """A two-column Markdown table, which TensorBoard's text panel renders."""
    rows = ["| key | value |", "| --- | --- |"]
    rows += [f"| {key} | {str(value).replace('|', '&#124;')} |" for key, value in values.items()]
    return "\n".join(rows)


def _hparams_summary(tag: str, data: Any) -> Any:
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import metadata

    value = summary_pb2.Summary.Value(
        tag=tag, metadata=metadata.create_summary_metadata(data), tensor=metadata.NULL_TENSOR
    )
    return summary_pb2.Summary(value=[value])


def hparams_start_summaries(hyperparameters: dict[str, Any]) -> list[Any]:
    """The HParams ``experiment`` and ``session_start_info`` summaries of one run."""
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    infos = []
    for name, value in flatten(hyperparameters).items():
        if isinstance(value, bool):
            start.hparams[name].bool_value = value
            kind = api_pb2.DATA_TYPE_BOOL
        elif isinstance(value, (int, float)):
            start.hparams[name].number_value = value
            kind = api_pb2.DATA_TYPE_FLOAT64
        else:
            start.hparams[name].string_value = value
            kind = api_pb2.DATA_TYPE_STRING
        infos.append(api_pb2.HParamInfo(name=name, type=kind))
    experiment = api_pb2.Experiment(
        hparam_infos=infos,
        metric_infos=[
            api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in HPARAMS_METRICS
        ],
    )
    return [
        _hparams_summary(
            metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)
        ),
        _hparams_summary(
            metadata.SESSION_START_INFO_TAG,
            plugin_data_pb2.HParamsPluginData(session_start_info=start),
        ),
    ]


def hparams_end_summary(failed: bool) -> Any:
    """The HParams ``session_end_info`` summary: the run succeeded or failed."""
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    end = plugin_data_pb2.SessionEndInfo(
        status=api_pb2.STATUS_FAILURE if failed else api_pb2.STATUS_SUCCESS,
        end_time_secs=time.time(),
    )
    return _hparams_summary(
        metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end)
    )


class TensorBoardBackend:
    """Writes one run's scalars, config and summary to a TensorBoard log directory."""

    def __init__(self, settings: TensorBoardConfig, run: RunStart) -> None:
        writer_module = load()
        self.log_dir = Path(settings.log_dir) if settings.log_dir else default_log_dir(run)
        # On resume from step N, purge_step N+1 hides what a crashed run logged after its
        # last checkpoint, so the curves do not double back on themselves.
        self.writer = writer_module.SummaryWriter(
            log_dir=str(self.log_dir),
            flush_secs=settings.flush_secs,
            purge_step=run.start_step + 1 if run.start_step else None,
        )
        text = yaml.safe_dump(run.hyperparameters, sort_keys=False)
        self.writer.add_text("config", f"```yaml\n{text}```", run.start_step)
        for summary in hparams_start_summaries(run.hyperparameters):
            self.writer.file_writer.add_summary(summary, run.start_step)
        self.writer.flush()
        log.info("TensorBoard event files: %s", self.log_dir)

    def log_run_info(self, step: int, info: dict[str, Any]) -> None:
        """The ``train_start`` facts as a text panel."""
        self.writer.add_text("run_info", markdown_table(info), step)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """One ``add_scalar`` per value."""
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def log_summary(self, step: int, summary: dict[str, Any]) -> None:
        """The final summary as a text panel."""
        self.writer.add_text("summary", markdown_table(summary), step)

    def finish(self, failed: bool) -> None:
        """Mark the HParams session succeeded or failed, flush and close the writer."""
        try:
            self.writer.file_writer.add_summary(hparams_end_summary(failed))
            self.writer.flush()
        finally:
            self.writer.close()


class TensorBoardSink(BackendSink):
    """TensorBoard event files as a metric sink: ``MetricLogger(hooks=[TensorBoardSink()])``.

    Takes the settings of the ``tensorboard:`` section (``log_dir``, ``flush_secs``), checked
    the same way. Each ``train_start`` event opens a writer on ``log_dir`` (default
    ``<run.output_dir>/tensorboard`` of the config that event carries) and ``close()`` marks the
    run succeeded or failed and closes the writer. Raises :class:`~speedtronic.PluginError`
    naming the ``[tensorboard]`` extra when the ``tensorboard`` package is missing.
    """

    label = "TensorBoard"

    def __init__(self, **settings: Any) -> None:
        self.settings: TensorBoardConfig = section_settings(
            TensorBoardConfig, "tensorboard", settings
        )
        load()
        super().__init__()

    @classmethod
    def from_section(cls, section: TensorBoardConfig) -> TensorBoardSink:
        """The sink a config's ``tensorboard:`` section describes."""
        return cls(**settings_of(section))

    def open_backend(self, run: RunStart) -> TensorBoardBackend:
        """A writer for the run that ``train_start`` announced."""
        return TensorBoardBackend(self.settings, run)
