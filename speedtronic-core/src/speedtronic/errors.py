"""One error hierarchy for everything Speedtronic raises on purpose.

The CLI turns any :class:`SpeedtronicError` into a one-line message; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "PluginError",
    "SpeedtronicError",
    "TransportError",
]


class SpeedtronicError(Exception):
    """Base class of every error Speedtronic raises for a user-facing reason.

    The ``speedtronic`` command prints one ``error: ...`` line for it and exits with
    ``exit_code``: 2 (a user error) unless a subclass names its own documented status.
    """

    exit_code: int = 2


class ConfigError(SpeedtronicError, ValueError):
    """A configuration value, file or override is invalid.

    ``path`` is the dotted location of the offending field (``data.micro_batch_size``); the
    message starts with it so that every error names its field.
    """

    def __init__(self, message: str, path: str = "") -> None:
        self.message = message
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error located one level deeper, under ``prefix``."""
        if not prefix:
            return self
        path = f"{prefix}.{self.path}" if self.path else prefix
        return ConfigError(self.message, path)


class PluginError(SpeedtronicError):
    """A plugin is missing, failed to load, or answered a hook wrongly."""


class CheckpointError(SpeedtronicError):
    """A checkpoint could not be written, found, verified or loaded."""


class DataError(SpeedtronicError):
    """A data source is missing, unreadable, empty or inconsistent with the model."""


class TransportError(SpeedtronicError):
    """A remote or shared-storage operation failed (used by transport plugins)."""
