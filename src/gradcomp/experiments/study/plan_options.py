"""What `gradcomp plan` is asked (study/plan.py): the methods, the parameter shapes, and every option checked before
anything is measured."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradcomp.errors import ConfigError
from gradcomp.experiments.race import race
from gradcomp.experiments.race.method import Method, planned
from gradcomp.experiments.study import phases as phased
from gradcomp.netmodel import NetworkModel, parse_bandwidth, parse_bytes, parse_latency

BASELINE_EQUIVALENTS = {"torch-fp32": "none", "torch-fp16": "fp16"}
# the race's default methods (experiments/race/race.py, read from there so the two never drift apart) with torch's DDP
# baselines as the gradcomp method that sends the same messages (torch's PowerSGD hook has none: measured itself),
# plus cheap ones: bf16, terngrad
DEFAULT_METHODS = (
    *(BASELINE_EQUIVALENTS.get(m, m) for m in race.DEFAULT_METHODS),
    "bf16",
    "terngrad",
)


def parse_method(text: str) -> Method:
    """``NAME[:KEY=VALUE,...]`` as ``gradcomp race --method`` takes it; ConfigError for an unknown method."""
    return planned(text, BASELINE_EQUIVALENTS)


def load_shapes(path: str) -> list[tuple[int, ...]]:
    """A JSON file holding a list of shapes (lists of positive integers), or ``{"shapes": [...]}``."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"--shapes {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--shapes {path}: not JSON ({exc})") from None
    if isinstance(data, dict):
        data = data.get("shapes")
    return check_shapes(data, f"--shapes {path}")


def check_shapes(data: object, what: str = "shapes") -> list[tuple[int, ...]]:
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{what}: expected a non-empty list of shapes such as [[128, 64], [64]]")
    shapes = []
    for i, shape in enumerate(data):
        if not isinstance(shape, list) or not shape or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape
        ):
            raise ConfigError(f"{what}: shape {i} must be a non-empty list of positive integers, got {shape!r}")
        shapes.append(tuple(shape))
    return shapes


@dataclass
class PlanOptions:
    model: str | None = "convnet"
    shapes: list[tuple[int, ...]] | None = None
    shapes_source: str | None = None
    dataset: str = "mnist"
    data_root: str | None = None
    batch_size: int | None = None  # None: the model's training default (gradcomp train's: 16 for a language model)
    workers: int = 4
    link: str | float = "1gbit"
    latency: str | float = 0.0
    burst: str | float = 0.0
    device: str = "cpu"
    methods: Sequence[str] = DEFAULT_METHODS
    compute_ms: float | None = None
    colocated: int = 1
    cache: bool = True
    cache_dir: str | None = None
    seed: int = 0
    pilots: bool = True  # with --model: rank by predicted time to a target from short pilots (study/pilot.py)
    pilot_steps: int | None = None  # None: pilot.PILOT_STEPS for the model's kind
    target: float | None = None  # None: fp32's value at its pilot's end
    steps: int | None = None  # the run's length: how a phased method's steps divide (study/phases.py)
    recorded: Sequence[str] = ()  # runs to read steps to the target from, instead of pilots (study/recorded.py)

    def checked(self) -> tuple[NetworkModel, list[Method]]:
        """Everything checked before any measurement; returns the network and the parsed methods."""
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 2:
            raise ConfigError(f"--workers must be an integer >= 2 (a plan compares ways to communicate), got "
                              f"{self.workers!r}")
        if (self.model is None) == (self.shapes is None):
            raise ConfigError("give --model NAME or --shapes FILE (one of the two)")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.compute_ms is not None and not (math.isfinite(self.compute_ms) and self.compute_ms >= 0):
            raise ConfigError(f"--compute-ms must be a number >= 0, got {self.compute_ms}")
        if isinstance(self.colocated, bool) or not isinstance(self.colocated, int) or self.colocated < 1:
            raise ConfigError(f"--colocated must be an integer >= 1, got {self.colocated!r}")
        if self.colocated > 1 and self.device != "cpu":
            raise ConfigError("--colocated shares this machine's CPU cores between workers: it needs --device cpu")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but torch sees no CUDA device")
        network = NetworkModel(parse_bandwidth(self.link, "--link"), parse_latency(self.latency, "--latency"),
                               parse_bytes(self.burst, "--burst"))
        if not self.methods:
            raise ConfigError("--methods: give at least one method")
        methods = [parse_method(m) for m in self.methods]
        if self.device != "cpu" and any(m.baseline == "torch-powersgd" for m in methods):
            raise ConfigError("--methods torch-powersgd: the planner runs torch's hook on the CPU only")
        labels = [m.label for m in methods]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"--methods: a method is given twice ({', '.join(labels)})")
        if self.recorded and self.model is None:
            raise ConfigError("--recorded reads runs of a model: give --model (not --shapes)")
        if self.recorded and not self.pilots:
            raise ConfigError("--recorded and --no-pilot: give one (recorded runs rank by time to target; --no-pilot "
                              "by step time)")
        phased.check(methods, self.steps)
        return network, methods

