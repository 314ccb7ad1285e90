"""Defaults that train: the method + feedback pairs refused at the settings measured not to train (issue 52).

`gradcomp train` with no options is the docs' MNIST job (MNIST, SmallCNN, SGD lr 0.05 with momentum 0.9). Most
methods train there at their own defaults; the pairs in ``RULES`` do not: they diverge to NaN or end near
chance. Rather than let such a run spend its epoch and print a useless accuracy, ``refuse_untrained_defaults``
(called by ``TrainConfig.validate``, before any worker starts) refuses it with one line that names a setting
measured to train instead. The measurements, and the command that reproduces them, are in
docs/methods/feedback.md ("Defaults that train"; ``scripts/defaults_sweep.py``).

A rule matches only the defaults it was measured at: the MNIST dataset with the ``cnn`` model, SGD at lr 0.05
with momentum 0.9 (the momentum wherever it acts: the optimizer's, or a momentum policy's), no ``--local-steps``,
and the method's own parameter defaults (a ``--param`` equal to its default counts as the default). Any other
lr, momentum, parameter, model or dataset is the user's explicit choice and is not refused: nothing here is
known about it. ``GRADCOMP_ALLOW_UNTRAINED_DEFAULTS=1`` turns the refusals off, for runs that measure what these
defaults do (``scripts/defaults_sweep.py``, ``gradcomp sweep``'s study grid).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

from gradcomp.errors import ConfigError

__all__ = ["ALLOW_ENV", "RULES", "Rule", "accepted_pairs", "effective_feedback", "refuse_untrained_defaults"]

ALLOW_ENV = "GRADCOMP_ALLOW_UNTRAINED_DEFAULTS"
FEEDBACKS = ("none", "residual", "momentum_correction", "momentum_masking")

# the job the rules were measured on (TrainConfig's values as `gradcomp train` resolves its defaults)
MEASURED_ON = {"dataset": "mnist", "model": "cnn", "optimizer": "sgd", "lr": 0.05, "momentum": 0.9}


@dataclass(frozen=True)
class Rule:
    """``method`` with one of ``feedbacks`` (the effective policy) does not train at ``MEASURED_ON``.

    ``what`` says what it does there instead (in words; the numbers are in docs/methods/feedback.md) and
    ``remedy`` the flags measured to train instead."""

    method: str
    feedbacks: tuple[str, ...]
    what: str
    remedy: str


_RANDOM_BLOCK = ("randomblock",)
RULES: tuple[Rule, ...] = ()


def accepted_pairs(**settings: Any) -> list[tuple[str, str, list[str]]]:
    """(method, feedback policy, the ``gradcomp train`` flags that ask for it) for every built-in method and every
    policy ``TrainConfig.validate`` accepts for it, at ``settings`` (TrainConfig fields; the rules here ignored).

    Each method's default comes first, with no flag; a ``--feedback`` flag is listed only where it asks for a
    policy other than the default (``--feedback residual`` is ``--error-feedback``, ``none`` is
    ``--no-error-feedback``)."""
    from gradcomp.experiments.run.runner import TrainConfig
    from gradcomp.registry import BUILTIN

    before = os.environ.get(ALLOW_ENV)
    os.environ[ALLOW_ENV] = "1"
    try:
        out = []
        for name in BUILTIN:
            default = TrainConfig(compressor=name, **settings)
            default.validate()
            policy = effective_feedback(default)
            out.append((name, policy, []))
            for feedback in FEEDBACKS:
                if feedback == policy:
                    continue
                try:
                    TrainConfig(compressor=name, feedback=feedback, **settings).validate()
                except ConfigError:
                    continue
                out.append((name, feedback, ["--feedback", feedback]))
        return out
    finally:
        if before is None:
            os.environ.pop(ALLOW_ENV)
        else:
            os.environ[ALLOW_ENV] = before


def effective_feedback(cfg: Any) -> str:
    """The feedback policy a configuration runs with: ``--feedback``'s, else residual when error feedback is on
    (``--error-feedback``, or the method's own default, as for sbc), else none."""
    if cfg.feedback is not None:
        return cfg.feedback
    return "residual" if cfg.uses_error_feedback() else "none"


def _parameters_at_defaults(name: str, params: dict[str, Any]) -> bool:
    from gradcomp.registry import compressor_class

    signature = inspect.signature(compressor_class(name).__init__).parameters
    for key, value in params.items():
        if key == "error_feedback":  # the policy, matched by effective_feedback
            continue
        default = signature[key].default if key in signature else inspect.Parameter.empty
        if default is inspect.Parameter.empty or value != default:
            return False
    return True


def _at_measured_job(cfg: Any) -> bool:
    momentum = cfg.feedback_momentum if cfg.feedback_momentum is not None else cfg.momentum
    return (cfg.dataset == MEASURED_ON["dataset"] and cfg.model == MEASURED_ON["model"]
            and cfg.optimizer == MEASURED_ON["optimizer"] and cfg.lr == MEASURED_ON["lr"]
            and momentum == MEASURED_ON["momentum"] and cfg.local_steps is None)


def refuse_untrained_defaults(cfg: Any) -> None:
    """Raise ConfigError, one line naming the setting that trains, where ``cfg`` is a pair of ``RULES`` at the
    defaults it was measured not to train at; return otherwise.

    Why each rule exists: every rule is a pair that, on the docs' MNIST job at its defaults, diverged to NaN or
    ended at chance in the sweep of docs/methods/feedback.md, with no default of the method's own at fault (the
    method's parameters are its paper's); the remedy it names is a setting that sweep or an earlier study
    measured to train. Random selection with memory (``randomk``, ``randomblock`` with residual or a momentum
    policy) releases each coordinate's accumulation about once every 1/density steps: a gradient that many
    steps stale, stable only at a much smaller learning rate without momentum. ``randomblock`` without memory is
    unstable under momentum 0.9 as well. The sign methods move every coordinate by about the learning rate
    (``signsgd``, ``signum``) or need the effective step without optimizer momentum (``efsignsgd``,
    ``onebit``): SGD's lr 0.05 with momentum 0.9 is far too large for them.
    """
    if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        return
    if "+" in cfg.compressor or not _at_measured_job(cfg):
        return
    rules = [r for r in RULES if r.method == cfg.compressor]
    if not rules or not _parameters_at_defaults(cfg.compressor, cfg.params):
        return
    feedback = effective_feedback(cfg)
    for rule in rules:
        if feedback in rule.feedbacks:
            policy = "no feedback" if feedback == "none" else f"--feedback {feedback}"
            raise ConfigError(
                f"--compressor {cfg.compressor} with {policy} does not train at lr 0.05 with momentum 0.9 on "
                f"MNIST ({rule.what}; docs/methods/feedback.md, \"Defaults that train\"): give {rule.remedy}"
            )
