"""The compressor registry: ``gradcomp.make(name, **params)`` and the CLI's ``--compressor NAME --param k=v``.

Both paths build the same object. Methods register themselves in the leaf module ``gradcomp.catalog``; this
module imports them (no module imports one that imports it back). Unknown names and bad parameters raise
ConfigError before anything is sent.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import gradcomp.compressors
import gradcomp.schemes.lgc  # registers lgc
import gradcomp.schemes.powersgd  # registers powersgd
import gradcomp.schemes.sketch  # registers sketch
import gradcomp.schemes.terngrad_shared  # registers terngrad_shared
import gradcomp.schemes.topk_baselines  # noqa: F401  (registers local_topk, true_topk)
from gradcomp.catalog import CATALOG, register
from gradcomp.errors import ConfigError
from gradcomp.schemes.base import Scheme

__all__ = ["available", "compressor_class", "make", "parse_param_strings", "register"]


def available() -> list[str]:
    return sorted(CATALOG)


def compressor_class(name: str) -> type:
    try:
        return CATALOG[name]
    except KeyError:
        raise ConfigError(f"unknown compressor {name!r}; available: {', '.join(available())}") from None


def make(
    name: str,
    *,
    error_feedback: bool | None = None,
    feedback: str | None = None,
    feedback_momentum: float = 0.9,
    **params: Any,
):
    """Build a registered compressor; ``error_feedback=True`` wraps it in ErrorFeedback.

    ``error_feedback=None`` takes the compressor's own default (on for SBC and STC, whose papers build the
    residual into the method; off for the rest). ``feedback`` names a policy instead (``"none"``,
    ``"residual"`` = error feedback, ``"momentum_correction"``, ``"momentum_masking"``: DGC's worker-side
    momentum with ``feedback_momentum``, see ``gradcomp.feedback``); give one of the two, not both.
    """
    if not isinstance(name, str):
        raise ConfigError(
            f"a compressor is named by a string (see gradcomp.available()), got {name!r} ({type(name).__name__})"
        )
    if error_feedback is not None and not isinstance(error_feedback, bool):
        # a string such as "no" is truthy: it would turn error feedback on
        raise ConfigError(f"error_feedback must be true or false, got {error_feedback!r}")
    if feedback is not None:
        from gradcomp.feedback import FEEDBACK_POLICIES, apply_feedback

        if feedback not in FEEDBACK_POLICIES:
            raise ConfigError(f"feedback must be one of {FEEDBACK_POLICIES}, got {feedback!r}")
        if error_feedback is not None and error_feedback != (feedback == "residual"):
            raise ConfigError(f"feedback={feedback!r} contradicts error_feedback={error_feedback}: give one")
        if issubclass(compressor_class(name.split("+")[0]), Scheme) and feedback != "none":
            raise ConfigError(f"{name!r} owns its rounds: it takes no feedback policy")
        _refuse_second_residual(name, feedback != "none")
        bare = make(name, error_feedback=False, **params)
        return apply_feedback(bare, feedback, feedback_momentum)
    _refuse_second_residual(name, bool(error_feedback))
    if "+" in name:
        return _make_composed(name, error_feedback, params)
    cls = compressor_class(name)
    owns_rounds = issubclass(cls, Scheme)
    signature = inspect.signature(cls.__init__)
    accepted = [
        name
        for name, p in signature.parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if owns_rounds and "error_feedback" in accepted and "error_feedback" in params:
        raise ConfigError(f"give {name!r}'s error feedback as error_feedback=..., once")
    if owns_rounds:
        # a method that owns its rounds builds error feedback in where its paper does (PowerSGD)
        if "error_feedback" in accepted:
            if error_feedback is not None:
                params = {**params, "error_feedback": error_feedback}
        elif error_feedback:
            raise ConfigError(f"{name!r} owns its rounds and takes no error feedback")
        error_feedback = False
    elif error_feedback is None:
        error_feedback = cls.default_error_feedback
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ConfigError(
            f"compressor {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"its parameters: {', '.join(accepted) or '(none)'}"
        )
    try:
        compressor = cls(**params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad parameters for compressor {name!r}: {exc}") from exc
    if error_feedback:
        from gradcomp.feedback import ErrorFeedback

        compressor = ErrorFeedback(compressor)
    return compressor


def _refuse_second_residual(name: str, wanted: bool) -> None:
    if wanted and getattr(compressor_class(name.split("+")[0]), "owns_feedback", False):
        raise ConfigError(
            f"{name!r} keeps its own residual (momentum correction and masking): it takes no error feedback "
            "or feedback policy on top"
        )


def _make_composed(name: str, error_feedback: bool | None, params: dict[str, Any]):
    """``"topk+cnat"``: the parameters go to the first compressor, the second runs with its defaults."""
    from gradcomp.compressors.compose import ComposedValues

    parts = name.split("+")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"a composed compressor is 'first+second', got {name!r}")
    if any(issubclass(compressor_class(p), Scheme) for p in parts if p):
        raise ConfigError(f"{name!r}: a method that owns its rounds cannot be composed")
    inner = make(parts[0], error_feedback=False, **params)
    composed = ComposedValues(inner, make(parts[1], error_feedback=False))
    if error_feedback is None:
        error_feedback = compressor_class(parts[0]).default_error_feedback
    if error_feedback:
        from gradcomp.feedback import ErrorFeedback

        return ErrorFeedback(composed)
    return composed


def parse_param_strings(items: Iterable[str], option: str = "--param") -> dict[str, Any]:
    """``["density=0.01", "scale=true"]`` → ``{"density": 0.01, "scale": True}`` (ints, floats, bools, strings).

    A key given twice is a ConfigError; ``option`` names the command-line option in the messages.
    """
    params: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{option} expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip().replace("-", "_")
        if not key.isidentifier():
            raise ConfigError(f"{option}: bad parameter name {key!r}")
        value = _parse_value(raw.strip())
        if key in params:
            raise ConfigError(f"{option} {key} given twice ({key}={params[key]!r} and {item}): give it once")
        params[key] = value
    return params


def _parse_value(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return raw
