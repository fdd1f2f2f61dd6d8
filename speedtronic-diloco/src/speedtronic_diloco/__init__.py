"""DumbDiLoCo for Speedtronic: asynchronous DiLoCo-style training through a shared store."""

__version__ = "0.1.0"
