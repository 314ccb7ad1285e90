"""The method registry: ``gradcomp.make(name, **params)`` and the CLI's ``--compressor NAME --param k=v``.

Both paths build the same object. Where a name comes from, in the order looked up:

1. ``BUILTIN`` below: gradcomp's own methods, one explicit table of name → ``"module:Class"``. A module is
   imported the first time one of its names is asked for (``make("topk")`` imports ``compressors.sparse``
   only); nothing registers itself as a side effect of being imported.
2. ``register(cls)``: a class defined at run time (a script, a notebook).
3. Other installed packages, through the entry-point group ``gradcomp.methods`` (``ENTRY_POINT_GROUP``): a
   package declares ``name = "module:Class"`` under ``[project.entry-points."gradcomp.methods"]`` in its
   ``pyproject.toml``, and once installed its method is made, listed (``gradcomp list``) and trained like a
   built-in, without touching gradcomp (``examples/plugin``; docs/adding-a-method.md). The entry points'
   names are read when first needed; a plugin's module is imported only when its method is asked for, or
   listed.

A broken plugin breaks only its own name. One that fails to import (an ImportError, any exception, a syntax
error, even ``sys.exit`` at import), whose object is not a ``Compressor`` or ``Scheme`` class with that ``name``,
or whose name two plugins give, is a ConfigError naming the package to fix when that name is asked for; every
other name keeps working, and ``gradcomp list`` lists the others and reports each broken one. A plugin whose
name is a built-in's (or a ``register``-ed class's) is ignored with a ``PluginWarning`` that names its package:
the built-in wins, so which class ``topk`` means never depends on what else is installed. Unknown names and bad
parameters raise ConfigError before anything is sent.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import warnings
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from gradcomp.compressors.base import Compressor
from gradcomp.errors import ConfigError
from gradcomp.schemes.base import Scheme

__all__ = [
    "BUILTIN", "ENTRY_POINT_GROUP", "PluginWarning", "available", "compressor_class", "make", "origin",
    "parse_param_strings", "register",
]

ENTRY_POINT_GROUP = "gradcomp.methods"

# Every built-in method: name → "module:Class". Compressors (one message per step; any topology) first, then
# the methods that own their rounds (Scheme subclasses).
BUILTIN: dict[str, str] = {
    "none": "gradcomp.compressors.dense:NoCompression",
    "fp16": "gradcomp.compressors.dense:Float16",
    "bf16": "gradcomp.compressors.dense:BFloat16",
    "topk": "gradcomp.compressors.sparse:TopK",
    "randomk": "gradcomp.compressors.sparse:RandomK",
    "randomblock": "gradcomp.compressors.sparse:RandomBlock",
    "threshold": "gradcomp.compressors.sparse:Threshold",
    "dgc": "gradcomp.compressors.dgc:DGC",
    "sbc": "gradcomp.compressors.sbc:SparseBinary",
    "stc": "gradcomp.compressors.sbc:SparseTernary",
    "cnat": "gradcomp.compressors.natural:NaturalCompression",
    "natural_dithering": "gradcomp.compressors.natural:NaturalDithering",
    "random_dithering": "gradcomp.compressors.natural:RandomDithering",
    "terngrad": "gradcomp.compressors.natural:TernGrad",
    "qsgd": "gradcomp.compressors.qsgd:QSGD",
    "signsgd": "gradcomp.compressors.sign:SignSGD",
    "signum": "gradcomp.compressors.sign:Signum",
    "efsignsgd": "gradcomp.compressors.sign:EFSignSGD",
    "onebit": "gradcomp.compressors.sign:OneBit",
    # methods that own their rounds
    "powersgd": "gradcomp.schemes.powersgd:PowerSGD",
    "sketch": "gradcomp.schemes.sketch:SketchedSGD",
    "local_topk": "gradcomp.schemes.topk_baselines:LocalTopK",
    "true_topk": "gradcomp.schemes.topk_baselines:TrueTopK",
    "terngrad_shared": "gradcomp.schemes.terngrad_shared:TernGradShared",
    "lgc": "gradcomp.schemes.lgc:LGC",
}

_REGISTERED: dict[str, type] = {}  # register(cls): classes named at run time


def register(cls: type) -> type:
    """Register a compressor or scheme class under its ``name`` for this process (usable as a decorator).

    For a class defined in a script; a package makes its methods available through the entry-point group
    instead. A name taken by a built-in or by another registered class is a TypeError; registering the same
    class again is harmless.
    """
    name = getattr(cls, "name", "")
    if not name:
        raise TypeError(f"{cls.__name__} has no name")
    if not (isinstance(cls, type) and issubclass(cls, (Compressor, Scheme))):
        raise TypeError(f"{cls!r} is neither a Compressor nor a Scheme subclass")
    taken = _builtin_class(name) if name in BUILTIN else _REGISTERED.get(name)
    if taken is not None and taken is not cls:
        raise TypeError(f"method name {name!r} is taken by {taken.__module__}.{taken.__qualname__}")
    _REGISTERED[name] = cls
    return cls


@functools.cache
def _builtin_class(name: str) -> type:
    module, _, attr = BUILTIN[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def _describe(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    package = f"package {dist.name} {dist.version}" if dist is not None else "an unknown package"
    return f"{package} (entry point {ep.name} = {ep.value!r} in group {ENTRY_POINT_GROUP!r})"


@functools.lru_cache(maxsize=1)
def _entry_points() -> tuple[EntryPoint, ...]:
    """The installed packages' entry points of the group, read once per process."""
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


class PluginWarning(UserWarning):
    """An installed plugin is ignored (its name is a built-in's or a registered class's): the warning names the
    package to fix. A warning, not an error: the method of that name still works, it is the built-in one."""


# The shadowed entry points already warned about in this process ("name=value"). The worker processes a command
# starts look the names up again and say nothing (``_in_worker``): the command that started them has said it.
_warned: set[str] = set()


def _in_worker() -> bool:
    """A worker process: started by multiprocessing (gradcomp's launcher, a test's workers), or a rank other than 0
    of torchrun or gradcomp race (rank 0 speaks for them; torchrun's own process does not look plugins up)."""
    import multiprocessing

    return multiprocessing.parent_process() is not None or os.environ.get("RANK", "0") != "0"


def _plugins() -> dict[str, EntryPoint | tuple[EntryPoint, ...]]:
    """The plugins' names → entry point (nothing imported), or → the several entry points of a name that more
    than one plugin gives (that name is unusable; the others are not).

    A plugin whose name is a built-in's or a registered class's is left out with a PluginWarning (once, not again
    in the workers a command starts): a broken or careless package must not take over, or take away, a method
    that gradcomp ships.
    """
    found: dict[str, list[EntryPoint]] = {}
    for ep in _entry_points():
        if ep.name in BUILTIN or ep.name in _REGISTERED:
            said = f"{ep.name}={ep.value}"
            if said not in _warned and not _in_worker():
                _warned.add(said)
                which = "built-in" if ep.name in BUILTIN else "registered"
                warnings.warn(
                    f"gradcomp: ignoring plugin method {ep.name!r} from {_describe(ep)}: {ep.name!r} is a {which} "
                    f"method's name, and the {which} one wins; rename it in that package's entry points "
                    "(or uninstall it)",
                    PluginWarning,
                    stacklevel=3,
                )
            continue
        same = found.setdefault(ep.name, [])
        if all(other.value != ep.value for other in same):  # one package seen twice on the path is one plugin
            same.append(ep)
    return {name: eps[0] if len(eps) == 1 else tuple(eps) for name, eps in found.items()}


@functools.cache
def _load_plugin(ep: EntryPoint) -> type:
    try:
        cls = ep.load()
    except (Exception, SystemExit) as exc:  # SystemExit: a module that calls sys.exit() when imported
        raise ConfigError(
            f"plugin method {ep.name!r} from {_describe(ep)} failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, (Compressor, Scheme))):
        raise ConfigError(
            f"plugin method {ep.name!r} from {_describe(ep)} is {cls!r}, not a gradcomp Compressor or Scheme class"
        )
    if getattr(cls, "name", "") != ep.name:
        raise ConfigError(
            f"plugin method {ep.name!r} from {_describe(ep)}: its class {cls.__qualname__} is named "
            f"{getattr(cls, 'name', '')!r}; the class's name and the entry point's must agree"
        )
    return cls


def available() -> list[str]:
    """Every method name: built-in, registered and plugin (plugins are not imported to list their names)."""
    return sorted(set(BUILTIN) | set(_REGISTERED) | set(_plugins()))


def compressor_class(name: str) -> type:
    """The class of the method ``name`` (importing its module, or the plugin's, on first use).

    A broken plugin is a ConfigError for its own name only; built-ins win over plugins of the same name.
    """
    if name in BUILTIN:
        _plugins()  # warn now about a plugin that this built-in shadows, whichever name is asked for
        return _builtin_class(name)
    if name in _REGISTERED:
        _plugins()
        return _REGISTERED[name]
    plugin = _plugins().get(name)
    if isinstance(plugin, tuple):
        raise ConfigError(
            f"two plugins name a method {name!r}: {' and '.join(map(_describe, plugin))}; uninstall or rename one"
        )
    if plugin is not None:
        return _load_plugin(plugin)
    raise ConfigError(f"unknown compressor {name!r}; available: {', '.join(available())}")


def origin(name: str) -> str:
    """Where the method ``name`` comes from: "built-in", "registered", or the plugin's package and version."""
    if name in BUILTIN:
        return "built-in"
    if name in _REGISTERED:
        return "registered"
    plugin = _plugins().get(name)
    if plugin is None:
        raise ConfigError(f"unknown compressor {name!r}; available: {', '.join(available())}")
    dists = [getattr(ep, "dist", None) for ep in (plugin if isinstance(plugin, tuple) else (plugin,))]
    named = [f"{dist.name} {dist.version}" for dist in dists if dist is not None]
    return f"plugin {' and '.join(named)}" if named else "plugin"


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
