"""A method the race runs and the planner plans: ``NAME[:KEY=VALUE,KEY=VALUE...]``, parsed once for both.

Methods (``--method``, repeated): ``NAME[:KEY=VALUE,KEY=VALUE...]``.

- ``NAME`` is a gradcomp compressor as ``gradcomp train --compressor`` takes it (``topk``, ``cnat``,
  ``powersgd``, ``topk+fp16``, ...), or one of torch's own DDP baselines: ``torch-fp32`` (alias ``ddp``: plain
  DDP, torch's built-in fp32 allreduce), ``torch-fp16`` (``fp16_compress_hook``), ``torch-powersgd``
  (``powerSGD_hook``, one bucket; parameters ``rank`` (2), ``start_iter`` (2), ``min_compression_rate``,
  ``error_feedback``, ``warm_start``, ``seed``, ``batch_same_shape``).
- ``KEY=VALUE`` pairs are the compressor's parameters (as ``--param``), except these, which no compressor
  takes: ``feedback`` (``residual``, ``momentum_correction``, ``momentum_masking``, ``none``: as ``--feedback``),
  ``topology`` (as ``--topology``), ``server`` (``--server-compressor``) and ``server.KEY`` (``--server-param``),
  ``granularity``, ``ddp`` (``on``, the default: DDP with gradcomp's overlapping hook; ``off``: the aggregator
  after backward), ``bucket_cap_mb``, ``sgd.lr`` / ``sgd.momentum`` / ``sgd.weight_decay`` (this method's
  optimizer settings, e.g. ``sgd.lr=0.001`` for sign methods) and ``label``. ``error_feedback=true`` works as in
  ``--param``.
- The methods built for Adam (docs/adam.md): ``onebit_adam`` and ``zero_one_adam`` (``--optimizer onebit_adam``,
  no compressor; ``freeze_step=N``; ``warmup=cnat`` sends 1-bit Adam's warm-up, or 0/1 Adam's variance
  updates, through C_nat, as ``--warmup-compressor``; 0/1 Adam's ``var_update_scaler``, ``local_step_scaler``
  and ``local_step_clipper`` as its options of those names), and any compressor with ``local_steps=H`` and
  ``outer=nesterov`` (DiLoCo;
  ``outer.lr``, ``outer.momentum``; ``diloco:local_steps=32`` is ``none:local_steps=32,outer=nesterov``), or
  ``dense_steps=N`` (the first N steps dense fp32). These run after backward (``ddp=off``), as their exchange
  is not DDP's; ``lr=`` sets the learning rate of any method (``adam.lr`` too).

Examples: ``topk:density=0.01,feedback=residual``, ``cnat:topology=sharded,server=cnat``,
``signum:sgd.lr=0.001``, ``torch-powersgd:rank=4``, ``onebit_adam:freeze_step=150``, ``onebit_adam:warmup=cnat``,
``random_dithering:levels=7,local_steps=32,outer=nesterov``, ``powersgd:rank=2,dense_steps=100``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from gradcomp.errors import ConfigError
from gradcomp.experiments.race import torch_baselines as tb
from gradcomp.registry import parse_param_strings

DEFAULT_METHODS = (
    "torch-fp32",
    "torch-fp16",
    "torch-powersgd:rank=2",
    "topk:density=0.01,feedback=momentum_masking",
    "cnat:topology=sharded,server=cnat",
    "sbc:density=0.01",
    "qsgd",
    "powersgd:rank=2",
    "signum:sgd.lr=0.001",
    "efsignsgd:sgd.lr=0.4,sgd.momentum=0",
)
ZERO_ONE_KEYS = ("var_update_scaler", "local_step_scaler", "local_step_clipper")  # 0/1 Adam's schedule
RUN_KEYS = ("feedback", "topology", "server", "granularity", "ddp", "bucket_cap_mb", "label")
SGD_KEYS = ("lr", "momentum", "weight_decay")


@dataclass
class Method:
    text: str
    name: str
    baseline: str | None = None  # torch's own DDP communication, or None for a gradcomp method
    params: dict[str, Any] = field(default_factory=dict)
    feedback: str | None = None
    topology: str = "auto"
    server: str | None = None
    server_params: dict[str, Any] = field(default_factory=dict)
    granularity: str = "layer"
    ddp: bool = True
    bucket_cap_mb: float | None = None
    sgd: dict[str, float] = field(default_factory=dict)
    optimizer: str | None = None  # onebit_adam / zero_one_adam (None: the race's optimizer)
    freeze_step: int | None = None
    warmup: str = "none"  # 1-bit Adam's warm-up compressor (0/1 Adam's: its variance updates')
    zero_one: dict[str, int] = field(default_factory=dict)  # 0/1 Adam's ZERO_ONE_KEYS given (else the run's)
    local_steps: int | None = None
    outer: dict[str, Any] = field(default_factory=dict)  # optimizer, lr, momentum (DiLoCo's outer step)
    dense_steps: int = 0
    label: str = ""
    note: str = ""  # how the planner stands in for a torch baseline (planned)

    @property
    def is_gradcomp(self) -> bool:
        return self.baseline is None

    def key(self) -> dict[str, Any]:
        """What the planner's cached measurements of this method depend on."""
        return {"compressor": self.name, "params": self.params, "feedback": self.feedback, "topology": self.topology,
                "server": self.server, "server_params": self.server_params, "granularity": self.granularity,
                "ddp": self.ddp, "bucket_cap_mb": self.bucket_cap_mb, "optimizer": self.optimizer,
                "freeze_step": self.freeze_step, "warmup": self.warmup, "local_steps": self.local_steps,
                "outer": self.outer, "dense_steps": self.dense_steps,
                **({"zero_one": self.zero_one} if self.zero_one else {})}

    def config(self, base=None, num_parameters: int = 0):
        """This method's TrainConfig: ``base`` (the race's settings; TrainConfig's defaults) with the method's own."""
        if base is None:
            from gradcomp.experiments.run.config import TrainConfig

            base = TrainConfig()
        bucket = self.bucket_cap_mb
        if self.baseline == "torch-powersgd" and bucket is None:
            # one bucket for the whole model (first bucket included: DDP uses bucket_cap_mb for it when given)
            bucket = max(25.0, math.ceil(4 * num_parameters / 2**20) + 1.0)
        return dataclasses.replace(
            base,
            compressor="none" if self.baseline else self.name,
            params={} if self.baseline else dict(self.params),
            feedback=self.feedback,
            topology=self.topology,
            server_compressor=self.server,
            server_params=dict(self.server_params),
            granularity=self.granularity,
            ddp=self.ddp,
            bucket_cap_mb=bucket,
            lr=self.sgd.get("lr", base.lr),
            momentum=self.sgd.get("momentum", base.momentum),
            weight_decay=self.sgd.get("weight_decay", base.weight_decay),
            optimizer=self.optimizer or base.optimizer,
            freeze_step=self.freeze_step if self.freeze_step is not None else (
                base.freeze_step if (self.optimizer or base.optimizer) in ("onebit_adam", "zero_one_adam") else None),
            warmup_compressor=self.warmup,
            local_steps=self.local_steps,
            outer_optimizer=self.outer.get("optimizer", "sgd"),
            outer_lr=self.outer.get("lr", 0.7 if self.outer.get("optimizer") == "nesterov" else 1.0),
            outer_momentum=self.outer.get("momentum", 0.9 if self.outer.get("optimizer") == "nesterov" else 0.0),
            dense_steps=self.dense_steps,
            **{key: self.zero_one.get(key, getattr(base, key)) for key in ZERO_ONE_KEYS},
        )


def parse_method(text: str) -> Method:
    """``NAME[:KEY=VALUE,...]`` → Method (see the module's docstring); ConfigError when malformed."""
    spec = text.strip()
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ConfigError(f"--method needs a name, got {text!r}")
    baseline = tb.canonical(name)
    method = Method(text=spec, name=baseline or name, baseline=baseline, label=spec)
    if name in ("onebit_adam", "zero_one_adam"):  # optimizers that exchange: no compressor of their own
        method.name, method.optimizer, method.ddp = "none", name, False
    elif name == "diloco":
        method.name, method.outer["optimizer"], method.ddp = "none", "nesterov", False
    items = [item.strip() for item in rest.split(",") if item.strip()] if rest else []
    plain: list[str] = []
    server_items: list[str] = []
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            raise ConfigError(f"--method {text!r}: {item!r} is not KEY=VALUE")
        value = value.strip()
        if key.startswith("sgd."):
            what = key[4:]
            if what not in SGD_KEYS:
                raise ConfigError(f"--method {text!r}: sgd.{what} unknown (sgd.lr, sgd.momentum, sgd.weight_decay)")
            try:
                method.sgd[what] = float(value)
            except ValueError:
                raise ConfigError(f"--method {text!r}: sgd.{what} must be a number, got {value!r}") from None
        elif key.startswith("server."):
            server_items.append(f"{key[7:]}={value}")
        elif key == "label":
            method.label = value
        elif key == "ddp":
            parsed = parse_param_strings([f"ddp={value}"])["ddp"]
            if not isinstance(parsed, bool):
                raise ConfigError(f"--method {text!r}: ddp=on or ddp=off, got {value!r}")
            method.ddp = parsed
        elif key == "bucket_cap_mb":
            try:
                method.bucket_cap_mb = float(value)
            except ValueError:
                raise ConfigError(f"--method {text!r}: bucket_cap_mb must be a number, got {value!r}") from None
        elif key in ("feedback", "topology", "server", "granularity", "warmup"):
            setattr(method, key, value)
        elif key in ZERO_ONE_KEYS:
            if method.optimizer != "zero_one_adam":
                raise ConfigError(f"--method {text!r}: {key} is 0/1 Adam's (zero_one_adam:{key}=N)")
            try:
                method.zero_one[key] = int(value)
            except ValueError:
                raise ConfigError(f"--method {text!r}: {key} must be a whole number, got {value!r}") from None
        elif key in ("freeze_step", "local_steps", "dense_steps"):
            try:
                setattr(method, key, int(value))
            except ValueError:
                raise ConfigError(f"--method {text!r}: {key} must be a whole number, got {value!r}") from None
            if key in ("local_steps", "dense_steps"):
                method.ddp = False  # their exchange runs after backward
        elif key in ("outer", "outer.optimizer"):
            method.outer["optimizer"] = value
        elif key in ("outer.lr", "outer.momentum", "lr", "adam.lr"):
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"--method {text!r}: {key} must be a number, got {value!r}") from None
            if key.startswith("outer."):
                method.outer[key[6:]] = number
            else:
                method.sgd["lr"] = number
        else:
            plain.append(f"{key}={value}")
    method.params = parse_param_strings(plain)
    method.server_params = parse_param_strings(server_items)
    if baseline is None and name.startswith("torch-"):  # (a typo of a baseline: the compressors' list would not say)
        raise ConfigError(f"--method {text!r}: unknown torch baseline {name!r}; known: {', '.join(tb.BASELINES)}")
    if baseline is not None:
        if method.feedback or method.server or method.server_params or method.topology != "auto":
            raise ConfigError(f"--method {text!r}: torch's baselines take no feedback, topology or server")
        if not method.ddp:
            raise ConfigError(f"--method {text!r}: torch's baselines are DDP (ddp=off is for gradcomp methods)")
        method.params = tb.check_params(baseline, method.params)
    return method




def planned(text: str, equivalents: dict[str, str]) -> Method:
    """``text`` parsed for the planner: a torch baseline as the gradcomp method of ``equivalents`` that sends the
    same messages (one without, torch's PowerSGD hook, as itself: the planner runs the hook); the compressor and
    its parameters checked now. ``ddp`` stays as given (on unless ``ddp=off``): the planner times a DDP method
    bucket by bucket as the hook runs it, and one with ``ddp=off`` as the aggregator runs it after backward;
    torch's baselines are DDP."""
    m = parse_method(text)
    if m.optimizer is not None or m.local_steps is not None or m.dense_steps:
        return m  # planned phase by phase (study/phases.py), each phase's exchange checked there
    if m.baseline is not None:
        if m.baseline not in equivalents:  # torch's PowerSGD hook: no gradcomp twin, its own messages are measured
            m.note = "torch's powerSGD_hook itself, its all-reduces recorded (plan.measure_torch_powersgd)"
            return m
        name = equivalents[m.baseline]
        return Method(text=m.text, name=name, label=m.label, bucket_cap_mb=m.bucket_cap_mb,
                      note=f"planned as gradcomp's {name} (the same messages)")
    m.config().build_compressors()  # unknown compressor or parameter: ConfigError now
    return m
