"""Weights & Biases and TensorBoard metric sinks for Speedtronic."""

__version__ = "0.1.0"
