"""Error types that gradcomp raises for bad input.

Bad input (``GradcompError`` and its subclasses) are ValueErrors, so callers that already catch ValueError keep
working. A failed collective is not bad input: ``CommunicationError`` (a RuntimeError) and its subclass
``WorkerLostError``.
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


class CommunicationError(RuntimeError):
    """A collective failed: a worker disappeared, stopped answering within the time-out, or failed itself."""


class WorkerLostError(CommunicationError):
    """Another worker vanished, failed or timed out while this one waited at a collective."""


class Interrupted(KeyboardInterrupt):
    """The launcher was told to stop (Ctrl-C / SIGINT, SIGTERM) and stopped its workers.

    A KeyboardInterrupt, so that code which lets Ctrl-C through lets this through too. ``exit_code`` is the
    shell's convention for a death by that signal: 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM).
    """

    def __init__(self, signum: int, message: str | None = None):
        import signal

        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(message or f"stopped by {signal.Signals(self.signum).name}")
