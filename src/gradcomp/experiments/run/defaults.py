"""Defaults that train: the method + feedback pairs refused at the settings measured not to train.

`gradcomp train` with no options is the docs' MNIST job (MNIST, SmallCNN, SGD lr 0.05 with momentum 0.9). Most
methods train there at their own defaults; the pairs in ``RULES`` do not: they diverge to NaN or end near
chance. Rather than let such a run spend its epoch and print a useless accuracy, ``refuse_untrained_defaults``
(called by ``gradcomp train`` after ``TrainConfig.validate``, before any worker starts; the library, ``gradcomp sweep``,
``race`` and ``plan`` build the same configurations unrefused) refuses it with one line that names a setting
measured to train instead. The measurements, and the command that reproduces them, are in
docs/methods/feedback.md ("Defaults that train"; ``scripts/defaults_sweep.py``).

A rule matches only the defaults it was measured at: the MNIST dataset with the ``cnn`` model, SGD at lr 0.05
with momentum 0.9 (the momentum wherever it acts: the optimizer's, or a momentum policy's), no ``--local-steps``,
and the method's own parameter defaults (a ``--param`` equal to its default counts as the default). Any other
lr, momentum, parameter, model or dataset is the user's explicit choice and is not refused: nothing here is
known about it. ``gradcomp train --allow-untrained-defaults`` turns the refusals off, for runs that measure what these
defaults do (``scripts/defaults_sweep.py``, the docs' results scripts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradcomp.errors import ConfigError

__all__ = ["RULES", "Rule", "accepted_pairs", "effective_feedback", "refuse_untrained_defaults"]

FEEDBACKS = ("none", "residual", "momentum_correction", "momentum_masking")

# the job the rules were measured on (TrainConfig's values as `gradcomp train` resolves its defaults)
MEASURED_ON = {"dataset": "mnist", "model": "cnn", "optimizer": "sgd", "lr": 0.05, "momentum": 0.9}


@dataclass(frozen=True)
class Rule:
    """``method`` with one of ``feedbacks`` (the effective policy) does not train at ``MEASURED_ON``.

    ``what`` says what it does there instead, in words (the numbers are in docs/methods/feedback.md);
    ``remedies`` are the flags measured to train instead, the first the one to try first."""

    method: str
    feedbacks: tuple[str, ...]
    what: str
    remedies: tuple[str, ...]


_MEMORY = ("residual", "momentum_correction", "momentum_masking")
_ALL = ("none", *_MEMORY)
RULES: tuple[Rule, ...] = (
    Rule("randomk", _MEMORY, "it ends at chance",
         ("--feedback residual --lr 0.004 --momentum 0 --epochs 12", "--feedback none --param density=0.1")),
    Rule("randomk", ("none",), "it learns about 1/density times slower than SGD and is far below it after the "
         "epoch", ("--param density=0.1",)),
    Rule("randomblock", _ALL, "it diverges or stays near chance",
         ("--feedback residual --lr 0.006 --momentum 0 --epochs 10",)),
    Rule("natural_dithering", _MEMORY, "it ends at chance", ("--feedback none",)),
    Rule("random_dithering", _ALL, "it diverges or ends near chance",
         ("--feedback none --param levels=127",)),
    Rule("qsgd", _MEMORY, "it ends near chance", ("--feedback none",)),
    Rule("signsgd", _ALL, "it ends near chance", ("--feedback none --lr 0.001 --momentum 0",)),
    Rule("signum", _ALL, "it ends at chance", ("--feedback none --lr 0.001",)),
    Rule("efsignsgd", ("residual",), "it ends at chance", ("--feedback residual --lr 0.4 --momentum 0",)),
    Rule("onebit", ("residual", "none"), "it ends near chance", ("--feedback residual --lr 0.4 --momentum 0",)),
    Rule("sbc", ("residual",), "it ended at chance on one seed of three, and 4 points below SGD on the others",
         ("--local-steps 4",)),
)
_POLICY = {"none": "without feedback", "residual": "with error feedback"}


def accepted_pairs(**settings: Any) -> list[tuple[str, str, list[str]]]:
    """(method, feedback policy, the ``gradcomp train`` flags that ask for it) for every built-in method and every
    policy ``TrainConfig.validate`` accepts for it, at ``settings`` (TrainConfig fields; the rules here ignored).

    Each method's default comes first, with no flag; a ``--feedback`` flag is listed only where it asks for a
    policy other than the default (``--feedback residual`` is ``--error-feedback``, ``none`` is
    ``--no-error-feedback``)."""
    from gradcomp.experiments.run.config import TrainConfig
    from gradcomp.registry import BUILTIN

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


def effective_feedback(cfg: Any) -> str:
    """The feedback policy a configuration runs with: ``--feedback``'s, else residual when error feedback is on
    (``--error-feedback``, or the method's own default, as for sbc), else none."""
    if cfg.feedback is not None:
        return cfg.feedback
    return "residual" if cfg.uses_error_feedback() else "none"


def _parameters_at_defaults(name: str, params: dict[str, Any]) -> bool:
    """Whether ``params`` build the method as its defaults do (``density=0.01`` is top-k's default ``None``)."""
    from gradcomp.registry import compressor_class

    cls = compressor_class(name)
    params = {k: v for k, v in params.items() if k != "error_feedback"}  # the policy: effective_feedback's
    try:
        return cls(**params).params() == cls().params()
    except Exception:  # parameters the method refuses were refused before; anything else is not a default
        return False


def _at_measured_job(cfg: Any) -> bool:
    momentum = cfg.feedback_momentum if cfg.feedback_momentum is not None else cfg.momentum
    return (cfg.dataset == MEASURED_ON["dataset"] and cfg.model == MEASURED_ON["model"]
            and cfg.optimizer == MEASURED_ON["optimizer"] and cfg.lr == MEASURED_ON["lr"]
            and momentum == MEASURED_ON["momentum"] and cfg.local_steps is None)


def refuse_untrained_defaults(cfg: Any) -> None:
    """Raise ConfigError, one line naming the setting that trains, where ``cfg`` is a pair of ``RULES`` at the
    defaults it was measured not to train at; return otherwise.

    Why each rule exists: each pair, on the docs' MNIST job at its defaults, diverged to NaN or ended near chance
    in the sweep of docs/methods/feedback.md, and no default of the method's own is at fault (its parameters are
    its paper's), so the setting to change is the job's; the remedy named is one that sweep, or the study or
    method page it cites, measured to train.

    - ``randomk``, ``randomblock`` with memory (residual or a momentum policy): each coordinate is released
      about once every 1/density steps with everything it accumulated, a gradient that many steps stale,
      stable only at a much smaller learning rate without momentum (or, for random-k, without memory at a
      larger density). ``randomblock`` without memory is unstable under momentum 0.9 as well; ``randomk``
      without memory applies a density's share of the gradient per step, too little for one epoch.
    - ``natural_dithering``, ``random_dithering``, ``qsgd`` with memory: they are unbiased quantisers whose
      variance exceeds the signal's on these layers; error feedback is meant for contractive compressors, and
      around one of these its residual grows. Without feedback, their default, natural dithering and QSGD
      train; standard dithering at its default 7 levels does not (on the edge of stability: its variance,
      about the square root of a layer's size over the levels, is largest there), at more levels it does.
    - ``signsgd``, ``signum``: with a majority vote every coordinate moves by the learning rate itself, so
      SGD's 0.05 is far too large a step; with memory the unscaled sign is not contractive either.
    - ``efsignsgd``, ``onebit``: optimizer momentum on top of their error feedback is unstable; they train at
      the effective step 0.05 / (1 - 0.9) without momentum. ``onebit`` without its error feedback does not.
    """
    if "+" in cfg.compressor or not _at_measured_job(cfg):
        return
    rules = [r for r in RULES if r.method == cfg.compressor]
    if not rules or not _parameters_at_defaults(cfg.compressor, cfg.params):
        return
    feedback = effective_feedback(cfg)
    for rule in rules:
        if feedback in rule.feedbacks:
            policy = _POLICY.get(feedback, f"with --feedback {feedback}")
            remedies = [r.replace(f"--feedback {feedback} ", "") for r in rule.remedies]  # the policy it has
            raise ConfigError(
                f"--compressor {cfg.compressor} {policy} does not train at lr 0.05 with momentum 0.9 on MNIST "
                f"({rule.what}; docs/methods/feedback.md, \"Defaults that train\"): give {' or '.join(remedies)}"
            )
