"""Steps to a target from recorded runs (``gradcomp plan --recorded``): a user's own trainings in place of pilots.

A pilot is short (60-100 steps) and cannot see what happens later: a dense warm-up, a method that starts slowly
and catches up, a target far beyond it. A user who has trained the methods to the length they care about (with
``gradcomp train --json`` or ``gradcomp race``) holds better evidence, the whole curve of each, and often
several seeds. With ``--recorded`` the planner reads those runs instead of piloting, and ranks by predicted step
time x the steps the recorded runs took.

What is read (``load``):

- a ``gradcomp train --json`` result: one JSON object with the run's configuration and its curve
  (``val_loss_curve`` for a language model, ``accuracy_curve`` for a classifier);
- a JSON-lines file of such results, or of records that hold one under ``"result"`` (what
  scripts/workloads_table.py writes; a record whose command failed is skipped);
- a ``gradcomp race`` result: its race.json, or the directory holding it; each method's curve with the race's
  settings. A timing race (``race --link A,B``'s later links, scripts/adam_race.py's windows) is refused: its
  curves are windows of steps, not whole runs.

**Matching.** A recorded run stands for a planned method when it is the same training: the configuration
``gradcomp train`` would run for the method (its defaults for the model, the plan's workers, the recorded
run's length) equals the recorded one on every field of ``IDENTITY``, those that change the arithmetic:
compressor and parameters, feedback, topology, server, optimizer and its settings, lr and schedule, batch,
local steps and the outer step, dense steps, model, dataset, workers and steps. The seed is not compared (it
pairs runs), nor DDP / simulated workers / FSDP (they average alike). torch's baselines match the gradcomp
method the planner prices them as (torch-fp32 as none, torch-fp16 as fp16, torch-powersgd as gradcomp's PowerSGD
of the same rank and start, as its pilot would). A method without a matching run is listed "no recorded run"
and never recommended; fp32 must have one, or the plan stops before measuring anything. Runs that match no
planned method are counted in the plan's note.

**The run's length** is ``--steps``, or fp32's recorded length when that is one length: runs of another length
follow another schedule and are not used.

**Target and steps.** The target is ``--target``, or the least good of fp32's recorded final values, so that
fp32 reaches it on every seed. Each recorded seed of a method is paired with fp32's run of the same seed and
read as a pilot is read (``pilot.predict``: where the curve crosses the target, with the evaluation interval
as its range; within the tolerance but short of it, fp32's steps times the method's slowdown; beyond the
tolerance, "does not keep up"). A method's steps are the mean over its paired seeds and their range the
smallest low to the largest high; a method that does not keep up on one seed does not keep up (every seed's gap
is in the detail), so one lucky seed is not enough. Seeds without an fp32 run of the same seed are not used.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gradcomp.errors import ConfigError
from gradcomp.experiments.run.config import EXCHANGING_OPTIMIZERS
from gradcomp.experiments.run.summary import ECHOED, config_record
from gradcomp.experiments.study import pilot

# the configuration fields a recorded run must share with a planned method's training (the module's docstring)
IDENTITY = (*(k for k in ECHOED if k not in ("seed", "simulate", "ddp", "fsdp")), "params", "server_params",
            "error_feedback", "betas", "eps", "freeze_step", "warmup_compressor", "outer_optimizer", "outer_lr",
            "outer_momentum", "dense_steps", "lr_step_size", "lr_gamma", "var_update_scaler", "local_step_scaler",
            "local_step_clipper", "workers", "steps")


@dataclass
class Run:
    """One recorded training of one method at one seed."""

    source: str  # the file, and the line or the race's method
    identity: dict[str, Any]
    seed: int
    curve: list[list[float]]  # [[step, value]]: validation bits per byte, or test accuracy in %
    diverged: bool = False

    @property
    def steps(self) -> int:
        return int(self.identity["steps"])

    @property
    def model(self) -> str:
        return str(self.identity["model"])


def _identity(record: dict[str, Any]) -> dict[str, Any]:
    found = {key: record.get(key) for key in IDENTITY}
    # fields results gained with later options, at the value that meant before them (0/1 Adam's schedule, not
    # recorded before, is left unknown: such a run matches no planned 0/1 Adam)
    if "dense_steps" not in record:
        found["dense_steps"] = 0
    if "warmup_compressor" not in record and record.get("optimizer") in EXCHANGING_OPTIMIZERS:
        found["warmup_compressor"] = "none"
    found["betas"] = list(found["betas"]) if found["betas"] is not None else None
    return found


def _curve(values: Sequence[Sequence[float]], text: bool) -> tuple[list[list[float]], bool]:
    """[[step, value]] in the pilot's units, and whether a value was not finite."""
    scale = 1.0 if text else 100.0
    out = [[int(s), float(v) * scale] for s, v in values if v is not None]
    finite = [c for c in out if math.isfinite(c[1])]
    return finite, len(finite) < len(out)


def _from_result(result: dict[str, Any], source: str) -> Run:
    if "model" not in result or "steps" not in result or "workers" not in result:
        raise ConfigError(f"--recorded {source}: not a gradcomp train --json result (no model, steps or workers)")
    text = pilot.is_text(result["model"])
    curve, bad = _curve(result.get("val_loss_curve" if text else "accuracy_curve") or [], text)
    final = result.get("final_loss")
    diverged = bad or (final is not None and not math.isfinite(float(final)))
    return Run(source, _identity(result), int(result.get("seed", 0)), curve, diverged)


def _from_race(race_json: dict[str, Any], source: str) -> list[Run]:
    from gradcomp.experiments.race import race
    from gradcomp.experiments.study.plan_options import parse_method

    stored = dict(race_json.get("options") or {})
    if stored.get("method_steps"):
        raise ConfigError(f"--recorded {source}: a timing race (each method a window of its steps, not a whole run): "
                          "give the race.json of the race that trained every method to the end")
    fields = {f.name for f in dataclasses.fields(race.Options)}
    opts = race.Options(methods=[], **{k: v for k, v in stored.items() if k in fields and k != "methods"})
    base = race.base_config(opts)
    text = race.is_text(opts)
    runs = []
    for record in race_json.get("methods") or []:
        error = record.get("error")
        if error and "non-finite" not in str(error).lower():
            continue  # a method that failed for another reason says nothing about its steps
        cfg = pilot.trained_as(parse_method(record["spec"])).config(base, record.get("num_parameters") or 0)
        if record.get("kind") == "gradcomp":
            cfg.hand_momentum_to_method()
        identity = _identity({**config_record(cfg), "workers": opts.hosts, "steps": opts.steps})
        curve, bad = _curve([[s, v] for s, _, v in record.get("curve") or []], text)
        runs.append(Run(f"{source}: {record['label']}", identity, opts.seed, curve, bool(error) or bad))
    return runs


def load(paths: Sequence[str]) -> list[Run]:
    """Every recorded run in ``paths`` (see the module's docstring); ConfigError for a path that holds none."""
    runs: list[Run] = []
    for path in paths:
        where = os.path.join(path, "race.json") if os.path.isdir(path) else path
        try:
            with open(where) as f:
                body = f.read()
        except OSError as exc:
            raise ConfigError(f"--recorded {path}: {exc.strerror or exc}") from None
        found = _parse(body, path)
        if not found:
            raise ConfigError(f"--recorded {path}: holds no recorded run (a gradcomp train --json result, lines of "
                              "them, or a gradcomp race race.json)")
        runs += found
    return runs


def _parse(body: str, path: str) -> list[Run]:
    try:
        whole = json.loads(body)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):
        if "methods" in whole and "options" in whole:
            return _from_race(whole, path)
        return [_from_result(whole, path)]
    runs = []
    for number, line in enumerate(body.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--recorded {path}: line {number} is not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"--recorded {path}: line {number} is not a JSON object")
        if "result" in record:
            if record.get("returncode", 0) != 0 or not isinstance(record["result"], dict):
                continue
            record = record["result"]
        runs.append(_from_result(record, f"{path}:{number}"))
    return runs


def run_length(opts, runs: Sequence[Run]) -> int:
    """The run's length the recorded runs are matched at: ``--steps``, or fp32's recorded one; ConfigError when
    there is no recorded fp32 run of that length to read the others against."""
    if opts.steps is not None:
        _fp32_runs(opts, runs, opts.steps)
        return opts.steps
    fp32 = planned_identity(opts, "none", None)
    lengths = sorted({r.steps for r in runs if _same(r.identity, fp32, ignore=("steps", "lr", "lr_schedule",
                                                                                "warmup_steps"))})
    if len(lengths) != 1:
        found = ", ".join(map(str, lengths)) or "none"
        raise ConfigError(f"--recorded: give --steps N, the run's length to plan for (fp32's recorded runs of "
                          f"{opts.model} on {opts.workers} workers have lengths: {found})")
    _fp32_runs(opts, runs, lengths[0])
    return lengths[0]


def _fp32_runs(opts, runs: Sequence[Run], steps: int) -> dict[int, Run]:
    """fp32's recorded runs by seed (gradcomp train's defaults, this length); ConfigError if none, or one diverged."""
    want = planned_identity(opts, "none", steps)
    found = {r.seed: r for r in runs if _same(r.identity, want)}
    if not found:
        raise ConfigError(f"--recorded: no recorded fp32 run of {opts.model} on {opts.workers} workers, {steps} steps, "
                          "with gradcomp train's defaults: nothing to read the others against (record one: gradcomp "
                          f"train --model {opts.model} --workers {opts.workers} --steps {steps} --json fp32.json)")
    bad = [r.source for r in found.values() if r.diverged or not r.curve]
    if bad:
        raise ConfigError(f"--recorded: fp32's recorded run diverged or has no evaluation: {', '.join(bad)}")
    return found


def planned_identity(opts, method, steps: int | None) -> dict[str, Any]:
    """The configuration gradcomp train runs for ``method`` (a Method, or a method's text) in this plan."""
    from gradcomp.experiments.study.plan_options import parse_method

    if isinstance(method, str):
        method = parse_method(method)
    base = pilot.base_config(opts.model, opts.dataset, opts.data_root, opts.batch_size, opts.workers,
                             steps or 1000, opts.seed)
    trained = pilot.trained_as(method)
    cfg = trained.config(base)
    if trained.is_gradcomp:
        cfg.hand_momentum_to_method()
    return _identity({**config_record(cfg), "workers": opts.workers, "steps": steps})


def _same(a: dict[str, Any], b: dict[str, Any], ignore: Sequence[str] = ()) -> bool:
    return all(a.get(k) == b.get(k) for k in IDENTITY if k not in ignore)


def to_target(opts, methods: Sequence[Any], rows: Sequence[Any], runs: Sequence[Run],
              log: Callable[[str], None]) -> dict[str, Any]:
    """As ``pilot.to_target``, from recorded runs: per row ``status``, ``detail``, ``steps_to_target``, ``gap``,
    ``time_s`` and its range; and the target, its source and the runs used."""
    steps = run_length(opts, runs)
    lower = pilot.is_text(opts.model)
    tolerance = pilot.TOLERANCE["text" if lower else "image"]
    matched: dict[str, dict[int, Run]] = {}
    used: set[int] = set()
    for m in methods:
        want = planned_identity(opts, m, steps)
        mine = [r for r in runs if _same(r.identity, want)]
        used.update(id(r) for r in mine)
        matched[m.label] = {r.seed: r for r in mine}  # a seed recorded twice: the later file's run
    fp32_runs = _fp32_runs(opts, runs, steps)
    target = opts.target
    if target is None:
        finals = [r.curve[-1][1] for r in fp32_runs.values()]
        target = max(finals) if lower else min(finals)
    else:
        for r in fp32_runs.values():
            pilot.check_target({"curve": r.curve}, target, lower, r.steps)
    log(f"recorded runs: {len(used)} of {len(runs)} match a planned method ({steps} steps, {opts.workers} workers); "
        f"fp32 on seeds {', '.join(map(str, sorted(fp32_runs)))}")
    by_label = {r.label: r for r in rows}
    out_rows = {m.label: pilot.timed(_combined(fp32_runs if pilot.is_fp32(m) else matched[m.label], fp32_runs, target,
                                               lower, tolerance), by_label[m.label]) for m in methods}
    curves = {f"{m.label} seed {s}": r.curve for m in methods for s, r in sorted(matched[m.label].items())}
    return {"value": target, "metric": "validation bits/byte" if lower else "test accuracy %",
            "lower_is_better": lower, "tolerance": tolerance, "pilot_steps": None, "source": "recorded",
            "recorded_steps": steps, "recorded_used": len(used), "recorded_read": len(runs),
            "fp32_steps": statistics.mean(pilot.crossing(r.curve, target, lower) for r in fp32_runs.values()),
            "given": opts.target is not None, "pilots": curves, "rows": out_rows}


def _combined(mine: dict[int, Run], fp32: dict[int, Run], target: float, lower: bool,
              tolerance: float) -> pilot.Prediction:
    """One prediction from a method's recorded seeds, each read against fp32's run of the same seed."""
    seeds = sorted(s for s in mine if s in fp32)
    if not seeds:
        unpaired = f" (seeds {', '.join(map(str, sorted(mine)))} have no fp32 run of the same seed)" if mine else ""
        return pilot.Prediction("no recorded run", detail="no recorded run of this training" + unpaired)
    each = {}
    for s in seeds:
        run, ref = mine[s], fp32[s]
        each[s] = pilot.predict({"curve": run.curve, "diverged": run.diverged}, {"curve": ref.curve}, target, lower,
                                tolerance, pilot.crossing(ref.curve, target, lower), what="run")
    named = "; ".join(f"seed {s}: {p.detail}" for s, p in each.items())
    failing = [p for p in each.values() if not p.keeps_up]
    gaps = [p.gap for p in each.values() if p.gap is not None]
    gap = statistics.mean(gaps) if gaps else None
    if failing:
        status = "diverged" if all(p.status == "diverged" for p in failing) else "does not keep up"
        return pilot.Prediction(status, gap=gap, detail=f"on {len(failing)} of {len(seeds)} recorded seeds: {named}")
    reached = all(p.status == "reached" for p in each.values())
    return pilot.Prediction("reached" if reached else "extrapolated",
                            statistics.mean(p.steps for p in each.values()),
                            min(p.steps_low for p in each.values()), max(p.steps_high for p in each.values()), gap,
                            f"{len(seeds)} recorded seed{'s' if len(seeds) > 1 else ''}: {named}")
