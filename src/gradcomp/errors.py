"""Error types that gradcomp raises for bad input.

All are ValueError subclasses, so callers that already catch ValueError keep working.
"""

from __future__ import annotations


class GradcompError(ValueError):
    """Base class of every error gradcomp raises for bad input or bad data."""


class WireError(GradcompError):
    """A buffer could not be decoded: truncated, oversized, corrupted, or not of the expected layout."""


class ConfigError(GradcompError):
    """A bad parameter, an unknown compressor name, or an unsupported tensor, caught before any communication."""


class NonFiniteGradientError(GradcompError):
    """A gradient holds NaN or Inf; raised with the parameter's name before anything is sent.

    ``step`` is the index of the exchange at which it was found, when the caller knows it: the training step
    when gradients are exchanged every step, the synchronisation round with ``--local-steps``.
    """

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step
