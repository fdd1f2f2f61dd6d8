"""Weights & Biases and TensorBoard metric sinks for Speedtronic.

As a plugin, it adds the ``wandb:`` and ``tensorboard:`` config sections. From Python, the same
sinks are objects for ``MetricLogger(hooks=[...])`` or ``build_runtime(config, hooks=[...])``:
:class:`WandbSink` and :class:`TensorBoardSink`. Neither backend is imported until a sink is
built, so importing this package stays cheap.
"""

from speedtronic_logging.tensorboard_sink import TensorBoardSink
from speedtronic_logging.wandb_sink import WandbSink

__version__ = "0.1.0"
__all__ = ["TensorBoardSink", "WandbSink", "__version__"]
