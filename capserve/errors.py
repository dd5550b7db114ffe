"""The errors a user can cause, in one place. Each message says what is wrong and how to fix it; the command
line prints them as one line (exit status 2) and the service answers them as 4xx or refuses to start."""

from __future__ import annotations


class UsageError(Exception):
    """A mistake in the command line or its inputs: printed as one line, exit status 2, no traceback."""


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message says what is wrong and how to fix it."""


class RuntimeLoadError(ValueError):
    """An artifact that cannot be opened by a runtime: missing, corrupt, or built for another model or GPU."""


class InputError(ValueError):
    """A batch whose shape or dtype the runtime cannot accept; the message says what was expected."""


class PrecisionError(ValueError):
    """A precision the chosen backend or device cannot serve; the message says what to change."""


class ExportError(ValueError):
    """An export that cannot be done as asked; the message says what to change."""


class Int8GateError(ExportError):
    """An INT8 graph that disagrees with FP32 more than the bound allows; nothing was written."""


class Int8SpeedError(Int8GateError):
    """An INT8 graph not clearly faster than FP32 on the machine that exports it; nothing was written."""


class DataError(ValueError):
    """Data a user brought that cannot be used as it is; the message says what to fix."""


class ConfigurationError(ValueError):
    """A setting or model directory the service cannot start with; the message says what to change."""
