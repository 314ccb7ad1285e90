"""Methods whose steps are not all alike, for `gradcomp plan`: dense warm-ups, 1-bit Adam, 0/1 Adam, local steps.

The planner measures one exchange of the gradient per step (plan.measure_method). Some methods exchange
something else, or not every step, or differently in two phases of the run:

- ``--dense-steps N`` (any compressor, ``dense_steps=N``): N steps of a dense fp32 exchange, then the method;
- 1-bit Adam (``onebit_adam``): F steps of AdamW whose gradients go through its warm-up exchange (fp32
  all-reduce; C_nat or natural dithering sharded both ways; fp16 / bf16 all-reduced), then 1-bit momentum:
  signs and one scale per shard, sharded both ways with error feedback on both sides (``efsignsgd``, topology
  ``sharded``, server ``efsignsgd``: the exchange OneBitAdam runs). F is ``freeze_step`` or 15 % of the run;
- 0/1 Adam (``zero_one_adam``): its schedule replayed step by step as ZeroOneAdam keeps it
  (``train.zero_one_adam.schedule``).
  In the variance stage (the first F steps) a step that updates the variance is a warm-up exchange (as 1-bit
  Adam's), every other one a 1-bit exchange of the gradient; in the local stage a step sends nothing, except the
  sync at the end of each run of H local steps, a 1-bit exchange of the change, with H doubling every
  ``local_step_scaler`` steps up to ``local_step_clipper``. Each stretch of one variance interval becomes two
  phases, its warm-up steps first and its 1-bit steps after them (the stretch's time is exact, the order within
  it is not: the interval is 1 for the first κ updates, 2 for the next κ, ...), and each stretch of one local
  interval one phase with an exchange every (its steps / its syncs) steps;
- local steps (local SGD / AdamW, DiLoCo's outer step, SBC's local steps): one exchange of the method's
  compressor every H steps, each worker computing alone in between.

Each is planned as its **phases**: every phase's exchange is an ordinary method that the planner measures and
prices as it does any other (traffic counted on simulated workers, compression timed, collectives priced), and
the method's step is the run's mean over its phases, an exchange of every H steps costing 1/H per step. Its time
to a number of steps is summed phase by phase (``PlanRow.seconds_for``), not the mean step times the steps: a
method with an expensive warm-up reaches an early target in its warm-up's time. So the planner needs the run's
length, ``gradcomp plan --steps``.

Not modelled: dense steps together with local steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gradcomp.errors import ConfigError
from gradcomp.experiments.race.method import Method
from gradcomp.train.zero_one_adam import schedule as zero_one_schedule

SHARDED_WARMUPS = ("cnat", "natural_dithering")  # 1-bit Adam's warm-ups that go sharded both ways (the others all-reduced)


@dataclass(frozen=True)
class Phase:
    what: str  # what the phase's steps do, for the plan's note
    method: Method  # the exchange measured for it: an ordinary method
    start: int  # the run's steps [start, stop) are in this phase
    stop: int
    every: float = 1  # its exchange runs once in this many steps (0/1 Adam: on average)


def is_phased(method: Method) -> bool:
    return method.optimizer is not None or method.local_steps is not None or bool(method.dense_steps)


def _exchange(label: str, name: str, **fields) -> Method:
    return Method(text=label, name=name, label=label, ddp=False, **fields)


def freeze_step(method: Method, steps: int) -> int:
    """1-bit Adam's freeze step in a run of ``steps``, as the runner resolves it."""
    return dataclasses.replace(method.config(), steps=steps).resolved_freeze_step()


def phases(method: Method, steps: int | None) -> list[Phase] | None:
    """A phased method's phases over a run of ``steps``; None for a method of one exchange per step. ConfigError
    for what the planner does not model, or a run too short for the method's phases."""
    if not is_phased(method):
        return None
    if method.local_steps is not None and method.dense_steps:
        raise ConfigError(f"--methods {method.text!r}: gradcomp plan models dense steps or local steps, not both")
    if steps is None:
        raise ConfigError(f"--methods {method.text!r}: its steps are not all alike (a warm-up, or an exchange every "
                          "H steps): give the run's length, --steps N, to plan it")
    label = method.label
    if method.optimizer in ("onebit_adam", "zero_one_adam"):
        f = freeze_step(method, steps)
        if not 1 <= f < steps:
            raise ConfigError(f"--methods {method.text!r}: freeze step {f} must lie in [1, --steps {steps})")
        warm = method.warmup or "none"
        if warm in SHARDED_WARMUPS:
            warmup = _exchange(f"{label} [warm-up]", warm, topology="sharded", server=warm)
        else:
            warmup = _exchange(f"{label} [warm-up]", warm)
        onebit = _exchange(f"{label} [1-bit]", "efsignsgd", topology="sharded", server="efsignsgd")
        through = warm if warm != "none" else "fp32"
        if method.optimizer == "zero_one_adam":
            return _zero_one_phases(method, steps, f, warmup, onebit, through)
        return [Phase(f"{f} AdamW steps, gradients through {through}", warmup, 0, f),
                Phase(f"{steps - f} steps of 1-bit momentum, sharded", onebit, f, steps)]
    if method.dense_steps:
        n = int(method.dense_steps)
        if not 0 < n < steps:
            raise ConfigError(f"--methods {method.text!r}: dense_steps {n} must lie in (0, --steps {steps})")
        dense = _exchange(f"{label} [dense]", "none")
        rest = dataclasses.replace(method, dense_steps=0, label=f"{label} [compressed]", text=f"{label} [compressed]")
        return [Phase(f"{n} dense fp32 steps", dense, 0, n), Phase(f"{steps - n} steps of {method.name}", rest, n, steps)]
    h = int(method.local_steps)
    if h < 1:
        raise ConfigError(f"--methods {method.text!r}: local_steps must be >= 1, got {h}")
    exchange = dataclasses.replace(method, local_steps=None, outer={}, label=f"{label} [every {h}]",
                                   text=f"{label} [every {h}]")
    what = "the averaged change" if method.outer.get("optimizer", "sgd") == "sgd" else "the pseudo-gradient"
    return [Phase(f"{h} local steps, then {what} through {method.name if method.name != 'none' else 'fp32'}",
                  exchange, 0, steps, every=h)]


def _zero_one_phases(method: Method, steps: int, freeze: int, warmup: Method, onebit: Method, through: str
                     ) -> list[Phase]:
    cfg = method.config()
    kinds = zero_one_schedule(freeze, steps, cfg.var_update_scaler, cfg.local_step_scaler, cfg.local_step_clipper)
    out: list[Phase] = []
    start = 0
    while start < len(kinds):
        stage, interval = ("variance" if kinds[start][0] in ("variance", "gradient") else "local"), kinds[start][1]
        stop = start
        while stop < len(kinds) and kinds[stop][1] == interval and (
                (kinds[stop][0] in ("variance", "gradient")) == (stage == "variance")):
            stop += 1
        stretch = [kind for kind, _ in kinds[start:stop]]
        if stage == "variance":
            dense = stretch.count("variance")
            if dense:
                out.append(Phase(f"{dense} AdamW steps (variance interval {interval}), gradients through {through}",
                                 warmup, start, start + dense))
            if dense < len(stretch):
                out.append(Phase(f"{len(stretch) - dense} 1-bit gradient steps (variance interval {interval})",
                                 onebit, start + dense, stop))
        else:
            syncs = max(1, stretch.count("sync"))  # (none in the stretch: finish() syncs at the end, one counted)
            out.append(Phase(f"{len(stretch)} local steps, {syncs} syncs (interval {interval}), 1-bit, sharded",
                             onebit, start, stop, every=len(stretch) / syncs))
        start = stop
    return out


def check(methods: list[Method], steps: int | None) -> None:
    """Every phased method's phases built once, before anything is measured (ConfigError otherwise)."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"--steps must be a whole number >= 1, got {steps!r}")
    for m in methods:
        for phase in phases(m, steps) or []:
            if phase.method.name != "none":
                phase.method.config().build_compressors()  # unknown compressor or parameter: ConfigError now


def boundary(method: Method, steps: int | None) -> int:
    """The step from which a phased method's steps are its steady ones (0 for local steps and plain methods)."""
    found = phases(method, steps) if steps is not None else None
    return found[-1].start if found else 0


def for_pilot(method: Method, steps: int | None) -> Method:
    """What a method's pilot trains: 1-bit Adam or 0/1 Adam with the run's freeze step, not 15 % of the pilot's."""
    if method.optimizer in ("onebit_adam", "zero_one_adam") and steps is not None:
        return dataclasses.replace(method, freeze_step=freeze_step(method, steps))
    return method


def phased_name(method: Method) -> str:
    """A phased method's row name: never fp32's ``none``, which 1-bit Adam and DiLoCo have as their compressor, so
    that no report takes their row for fp32's."""
    kind = method.optimizer or ("local steps" if method.local_steps is not None else "dense steps")
    return f"{method.name} ({kind})"


def combine(method: Method, parts: list[tuple[Phase, object]], steps: int, row_type):
    """One PlanRow for a phased method from its phases' priced rows: per step, the run's mean."""
    def mean(attr: str) -> float:
        return sum((p.stop - p.start) * getattr(row, attr) / p.every for p, row in parts) / steps

    compute = parts[0][1].compute_s
    rows = [{"what": p.what, "start": p.start, "stop": p.stop, "every": p.every,
             "step_s": row.compute_s + (row.compress_s + row.communicate_s) / p.every,
             "bits_up": row.bits_up / p.every, "bits_down": row.bits_down / p.every} for p, row in parts]
    last_phase, last = parts[-1]
    calls = {op: n / last_phase.every for op, n in last.calls.items()}
    note = "; ".join(f"{r['what']}: {1e3 * r['step_s']:.1f} ms a step" for r in rows)
    return row_type(method.label, phased_name(method), compute, mean("compress_s"), mean("communicate_s"), mean("bits_up"),
                    mean("bits_down"), calls, note, mean("priced_s"), None, rows)
