"""Pilots for `gradcomp plan`: how many steps each method needs to reach a target, measured on the user's model.

A step time alone answers "which step is shortest"; a user asks "which method reaches my target first". A method
that needs three times the steps, or never gets there, is not faster. So the planner trains each method for a
short **pilot** on the user's model and data, with ``gradcomp train``'s defaults for that model (dataset,
optimizer, lr, schedule, batch), as the first steps of the run planned for (``run_length``: its warm-up and
learning-rate schedule are that run's, ``TrainConfig.schedule_steps``; a schedule squeezed into the pilot would
be another experiment, whose early steps favour other methods than the run's), W simulated workers (the real
training loop on an in-process transport: the same arithmetic as gloo), evaluated ``PILOT_EVALS`` times, and an
fp32 pilot on the same seed beside it. The pilots run one per core, each in a process of its own
(``parallel_pilots``); fp32's runs first and alone when a ``--target`` is given, so that an unreachable one is
refused before the others start.

From the curves (validation bits per byte for a language model, test accuracy for a classifier):

- **The target** is ``--target``, or by default fp32's own value at the pilot's end: "what fp32 reaches in the
  pilot". A target fp32's pilot does not reach is refused in one line before the other pilots start (the pilot
  cannot say when fp32 would reach it; give a longer ``--pilot-steps`` or an easier target).
- **Steps to the target**: where the method's curve crosses it, linearly between evaluations (``crossing``); its
  uncertainty is the evaluation interval around that point. A method whose curve ends short of it is
  extrapolated by its **slowdown** against fp32 (``slowdown``): at each of its evaluations in the pilot's second
  half, its value is one fp32 reached at some earlier step s (interpolated on fp32's curve), and t / s is how many
  times fp32's steps it needs for that value; steps to the target are fp32's steps times the median of those
  ratios, with their smallest and largest as the range. This assumes the ratio holds beyond the pilot, which is
  the extrapolation's honest weak point: it is said beside every such row.
- **Does not keep up**: a method whose pilot ends further behind fp32 than ``TOLERANCE`` (0.05 bits per byte, or
  half an accuracy point: about the spread of fp32 between seeds in docs/workloads.md), or that never reaches a
  value fp32 had in the pilot, is reported with its measured gap and never recommended; so is one that diverged
  (a non-finite loss: the pilot stops, the plan goes on).

Pilots are cached like the planner's other measurements, keyed by the model, dataset, batch, workers, seed, pilot
length, the method, and gradcomp's version and source digest: a pilot of another model, dataset or gradcomp
version is never reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gradcomp.errors import ConfigError

PILOT_STEPS = {"text": 60, "image": 100}  # default pilot lengths: about 10 minutes of plan for the Transformer
PILOT_EVALS = 6
TOLERANCE = {"text": 0.05, "image": 0.5}  # "behind beyond the noise": bits per byte; accuracy points
PILOT_FORMAT = 2  # bump when what a pilot measures changes (2: a pilot is the first steps of the planned run)


def is_text(model: str | None) -> bool:
    from gradcomp.experiments.race.race import text_model

    return isinstance(model, str) and text_model(model)


def pilot_steps(model: str | None, given: int | None) -> int:
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < PILOT_EVALS:
            raise ConfigError(f"--pilot-steps must be a whole number >= {PILOT_EVALS} (the pilot evaluates "
                              f"{PILOT_EVALS} times), got {given!r}")
        return given
    return PILOT_STEPS["text" if is_text(model) else "image"]


def base_config(model: str, dataset: str, data_root: str | None, batch_size: int | None, workers: int, steps: int,
                seed: int, run_steps: int | None = None):
    """``gradcomp train``'s configuration for ``model`` (its per-model defaults: optimizer, lr, schedule, batch),
    for ``steps`` steps on W simulated workers, evaluated PILOT_EVALS times. ``run_steps``: the length of the run
    these steps begin (a pilot: its warm-up and schedule are that run's, as ``train --steps run_steps`` sets them);
    None: a run of ``steps``."""
    from gradcomp.experiments.run.config import TrainConfig
    from gradcomp.experiments.run.options import add_training_options, resolve_training_defaults

    parser = argparse.ArgumentParser()
    add_training_options(parser)
    prefix = run_steps is not None and run_steps > steps
    argv = ["--model", model, "--dataset", dataset, "--steps", str(run_steps if prefix else steps)]
    if data_root:
        argv += ["--data", data_root]
    if batch_size is not None:
        argv += ["--batch-size", str(batch_size)]
    kwargs = {**resolve_training_defaults(parser.parse_args(argv)), "steps": steps}
    return TrainConfig(**kwargs, workers=workers, seed=seed, simulate=True, progress=False,
                       eval_every=max(1, steps // PILOT_EVALS), schedule_steps=run_steps if prefix else None)


def run_length(opts) -> int | None:
    """The length of the run a plan is for: ``--steps``, else ``gradcomp train``'s default for the model (300 steps
    for a language model; None for a classifier, whose default is an epoch at a constant learning rate)."""
    from gradcomp.experiments.run.options import TRANSFORMER_DEFAULTS

    if getattr(opts, "steps", None):
        return int(opts.steps)
    return TRANSFORMER_DEFAULTS["steps"] if is_text(opts.model) else None


def run_pilot(cfg) -> dict[str, Any]:
    """One pilot: the curve ``[[step, value], ...]`` (bits per byte, or accuracy in %), and whether it diverged."""
    from gradcomp.experiments.run.runner import run_simulated

    started = time.perf_counter()
    try:
        result = run_simulated(cfg)
    except Exception as exc:  # noqa: BLE001 - a pilot that fails marks its method; the plan goes on
        from gradcomp.errors import NonFiniteGradientError

        if isinstance(exc, NonFiniteGradientError) or "non-finite" in str(exc).lower():
            return {"curve": [], "diverged": True, "error": str(exc).split(";")[0][:200],
                    "seconds": time.perf_counter() - started}
        raise
    text = is_text(cfg.model)
    raw = result.get("val_loss_curve" if text else "accuracy_curve") or []
    scale = 1.0 if text else 100.0
    curve = [[int(s), float(v) * scale] for s, v in raw]
    diverged = any(not math.isfinite(v) for _, v in curve) or not math.isfinite(float(result.get("final_loss", 0.0)))
    return {"curve": [c for c in curve if math.isfinite(c[1])], "diverged": diverged,
            "seconds": time.perf_counter() - started}


# -- reading the curves ----------------------------------------------------------------------------------------


def _better(a: float, b: float, lower: bool) -> bool:
    """a is at least as good as b."""
    return a <= b if lower else a >= b


def crossing(curve: Sequence[Sequence[float]], target: float, lower: bool) -> float | None:
    """The step at which ``curve`` first reaches ``target``, linear between evaluations (from step 0 at the first
    evaluation's value); None if it never does."""
    prev_s, prev_v = None, None
    for s, v in curve:
        if _better(v, target, lower):
            if prev_s is None or v == prev_v:
                return float(s)
            return prev_s + (s - prev_s) * (prev_v - target) / (prev_v - v)
        prev_s, prev_v = s, v
    return None


def slowdown(curve: Sequence[Sequence[float]], reference: Sequence[Sequence[float]], lower: bool
             ) -> tuple[float, float, float] | None:
    """How many times fp32's (``reference``'s) steps ``curve`` needs for the values it reached, at its evaluations in
    the pilot's second half: (median, smallest, largest); None where it never reached a value fp32 had."""
    if not curve or not reference:
        return None
    half = curve[-1][0] / 2
    ratios = []
    for s, v in curve:
        if s < half:
            continue
        at = crossing(reference, v, lower)
        if at is None or at <= 0:
            continue  # better than fp32 ever was in the pilot (ratio < 1 at most) or not comparable
        ratios.append(s / at)
    if not ratios:
        return None
    return statistics.median(ratios), min(ratios), max(ratios)


@dataclass
class Prediction:
    """A method's predicted steps to the target and what the prediction rests on."""

    status: str  # "reached" (in the pilot), "extrapolated", "does not keep up", "diverged", "not piloted"
    steps: float | None = None
    steps_low: float | None = None
    steps_high: float | None = None
    gap: float | None = None  # the method's value at the pilot's end minus fp32's (signed: positive = behind)
    detail: str = ""

    @property
    def keeps_up(self) -> bool:
        return self.status in ("reached", "extrapolated")


def predict(pilot: dict[str, Any], fp32: dict[str, Any], target: float, lower: bool, tolerance: float,
            fp32_steps: float, what: str = "pilot") -> Prediction:
    """Steps to ``target`` from a method's pilot and fp32's (see the module docstring); ``what`` names the curves
    in the details ("pilot", or "run" for a recorded one)."""
    if pilot.get("diverged"):
        return Prediction("diverged", detail=f"diverged in its {what} ({pilot.get('error') or 'a non-finite value'})")
    curve, ref = pilot["curve"], fp32["curve"]
    if not curve:
        return Prediction("does not keep up", detail=f"no evaluation in its {what}")
    gap = (curve[-1][1] - ref[-1][1]) * (1 if lower else -1)
    unit = "bits/byte" if lower else "points"
    interval = curve[1][0] - curve[0][0] if len(curve) > 1 else curve[0][0]
    at = crossing(curve, target, lower)
    if at is not None and gap <= tolerance:
        return Prediction("reached", at, max(0.0, at - interval / 2), at + interval / 2, gap,
                          f"reaches it in the {what} at step {at:.0f}")
    if gap > tolerance:
        return Prediction("does not keep up", gap=gap,
                          detail=f"{gap:.3f} {unit} behind fp32 at the {what}'s end (step {curve[-1][0]}), beyond the "
                                 f"noise ({tolerance:g})")
    ratio = slowdown(curve, ref, lower)
    if ratio is None:
        return Prediction("does not keep up", gap=gap, detail=f"never reaches a value fp32 had in its {what}")
    k, low, high = ratio
    return Prediction("extrapolated", k * fp32_steps, low * fp32_steps, high * fp32_steps, gap,
                      f"{k:.2f} x fp32's steps (from {low:.2f} to {high:.2f} over the {what}'s second half), "
                      f"assumed to hold beyond the {what}")


# -- the pilots of one plan -------------------------------------------------------------------------------------


def pilot_key(machine: dict[str, Any], cfg, method_key: dict[str, Any]) -> dict[str, Any]:
    return {"what": "pilot", "format": PILOT_FORMAT, "gradcomp": machine["gradcomp"],
            "gradcomp_source": machine["gradcomp_source"], "torch": machine["torch"],
            "model": cfg.model, "dataset": cfg.dataset, "batch_size": cfg.batch_size, "workers": cfg.workers,
            "seed": cfg.seed, "steps": cfg.steps, "schedule_steps": cfg.schedule_steps, "optimizer": cfg.optimizer,
            "lr": cfg.lr, "method": method_key}


def run_pilots(methods: Sequence[Any], base, cache, machine: dict[str, Any], log: Callable[[str], None],
               target: float | None, skip: dict[str, str]) -> dict[str, Any]:
    """fp32's pilot first (the target is checked against it before any other pilot), then each method's; returns
    {"target", "lower", "fp32_steps", "pilots": {label: pilot}, "predictions": {label: Prediction}}."""
    from gradcomp.experiments.race.method import parse_method

    lower = is_text(base.model)
    tolerance = TOLERANCE["text" if lower else "image"]
    runs = [("fp32", parse_method("none"))] + [(m.label, trained_as(m)) for m in methods
                                               if m.label not in skip and not is_fp32(m)]
    pilots: dict[str, dict[str, Any]] = {}
    pending = []  # (i, label, cfg, key) of the pilots not in the cache, run one per core
    for i, (label, method) in enumerate(runs, start=1):
        # (the hook's slots and arithmetic are the aggregator's: a pilot on simulated workers runs the aggregator)
        cfg = dataclasses.replace(method.config(base), ddp=False)
        key = pilot_key(machine, cfg, method.key())
        cached = cache.get(key)
        if cached is not None:
            log(f"pilot {i}/{len(runs)}: {label} (cached)")
            pilots[label] = cached
        elif label == "fp32" and target is not None:  # a given target is checked before any other pilot starts
            log(f"pilot {i}/{len(runs)}: {label}, {cfg.steps} steps on {cfg.workers} simulated workers ...")
            pilots[label] = run_pilot(cfg)
            cache.put(key, pilots[label])
            log(f"pilot {i}/{len(runs)}: {label} done in {pilots[label]['seconds']:.0f} s")
        else:  # (fp32's too when the target is its own end: nothing to check before the others)
            pending.append((i, label, cfg, key))
        if label == "fp32" and label in pilots:
            target = check_target(pilots[label], target, lower, cfg.steps)
    for i, label, result in _run_in_parallel(pending, len(runs), log):
        cache.put(next(key for j, _, _, key in pending if j == i), result)
        pilots[label] = result
    if any(label == "fp32" for _, label, _, _ in pending):
        target = check_target(pilots["fp32"], target, lower, base.steps)
    fp32 = pilots["fp32"]
    fp32_steps = crossing(fp32["curve"], target, lower)
    predictions = {}
    for m in methods:
        if m.label in skip:
            predictions[m.label] = Prediction("not piloted", detail=skip[m.label])
        elif is_fp32(m):
            predictions[m.label] = predict(fp32, fp32, target, lower, tolerance, fp32_steps)
        else:
            predictions[m.label] = predict(pilots[m.label], fp32, target, lower, tolerance, fp32_steps)
    return {"target": target, "lower": lower, "tolerance": tolerance, "fp32_steps": fp32_steps,
            "pilot_steps": base.steps, "pilots": pilots, "predictions": predictions}


def parallel_pilots(count: int) -> int:
    """How many pilots run at once: one per core, at most ``count``. A pilot's simulated workers take turns (one
    runs at a time), so a pilot keeps about one core busy whatever torch's thread count."""
    return max(1, min(count, os.cpu_count() or 1))


def _pilot_process(cfg, threads: int) -> dict[str, Any]:
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the planner's to handle: it stops these processes
    torch.set_num_threads(threads)
    return run_pilot(cfg)


def _run_in_parallel(pending: list, total: int, log: Callable[[str], None]):
    """Yields (i, label, pilot) for each pending (i, label, cfg, key) as it finishes, ``parallel_pilots`` at once,
    each in a process of its own (spawned: this process holds threads) with cores / parallel torch threads."""
    if not pending:
        return
    at_once = parallel_pilots(len(pending))
    if at_once == 1:
        for i, label, cfg, _ in pending:
            log(f"pilot {i}/{total}: {label}, {cfg.steps} steps on {cfg.workers} simulated workers ...")
            result = run_pilot(cfg)
            log(f"pilot {i}/{total}: {label} done in {result['seconds']:.0f} s")
            yield i, label, result
        return
    import concurrent.futures
    import multiprocessing

    threads = max(1, (os.cpu_count() or 1) // at_once)
    pool = concurrent.futures.ProcessPoolExecutor(at_once, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {}
        for i, label, cfg, _ in pending:
            futures[pool.submit(_pilot_process, cfg, threads)] = (i, label)
        log(f"pilots {', '.join(str(i) for i, _, _, _ in pending)} of {total}: {at_once} at a time, "
            f"{pending[0][2].steps} steps on {pending[0][2].workers} simulated workers each ...")
        done, seconds = 0, 0.0
        for future in concurrent.futures.as_completed(futures):
            i, label = futures[future]
            result = future.result()
            done += 1
            seconds += result["seconds"]
            left = math.ceil((len(pending) - done) / at_once) * seconds / done  # rounds left x a pilot's mean
            log(f"pilot {i}/{total}: {label} done in {result['seconds']:.0f} s"
                + (f" (about {left / 60:.1f} min of pilots left)" if done < len(pending) else ""))
            yield i, label, result
    except BaseException:  # Ctrl-C or a pilot's error: no pilot process is left running
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()


def trained_as(method):
    """What a method's pilot trains: itself, or for torch's PowerSGD hook gradcomp's PowerSGD of the same rank and
    start (the same algorithm; its messages differ in layout, not in what is averaged)."""
    if method.baseline != "torch-powersgd":
        return method
    from gradcomp.experiments.race.method import parse_method

    rank, start = method.params.get("rank", 2), method.params.get("start_iter", 2)
    return parse_method(f"powersgd:rank={rank},start_iter={start}")


def is_fp32(method) -> bool:
    """The methods whose training is fp32's to the bit (the same average): fp32's pilot stands for them."""
    return (method.name == "none" and not method.params and method.local_steps is None and not method.dense_steps
            and method.optimizer is None)


def check_target(fp32: dict[str, Any], target: float | None, lower: bool, steps: int) -> float:
    """The target: the one given, or fp32's value at the pilot's end; ConfigError if fp32's pilot does not reach it."""
    if fp32.get("diverged") or not fp32["curve"]:
        raise ConfigError("fp32's pilot diverged or made no evaluation: nothing to plan against (check --lr or the "
                          "model's defaults with gradcomp train)")
    end = fp32["curve"][-1][1]
    if target is None:
        return end
    best = min(v for _, v in fp32["curve"]) if lower else max(v for _, v in fp32["curve"])
    if not _better(best, target, lower):
        what = "bits/byte" if lower else "% accuracy"
        raise ConfigError(f"--target {target:g} is not reached by fp32 in its {steps}-step pilot (best {best:.3f} "
                          f"{what}): give a target fp32 reaches ({'>=' if lower else '<='} {best:.3f}) or a longer "
                          "--pilot-steps")
    return target


# -- the plan's ranking by time to the target -------------------------------------------------------------


def to_target(opts, methods: Sequence[Any], rows: Sequence[Any], cache, fp32_name: str,
              machine: dict[str, Any], compute_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Each method's predicted steps and time to the target, from pilots (study/pilot.py): per row ``steps``,
    ``time_s`` (step time x steps, None for a method that does not keep up), ``time_low_s`` / ``time_high_s``,
    ``status`` and ``detail``."""
    steps = pilot_steps(opts.model, opts.pilot_steps)
    base = pilot_base(opts, steps)
    by_label = {r.label: r for r in rows}
    fp32 = next((r for r in rows if r.method == fp32_name), None)
    skip = {}
    if fp32 is not None:  # a step no shorter than fp32's cannot reach the target sooner (it needs no fewer steps)
        skip = {r.label: f"its step ({1e3 * r.step_s:.1f} ms) is no shorter than fp32's ({1e3 * fp32.step_s:.1f} ms): "
                         "not piloted" for r in rows if r is not fp32 and r.step_s >= fp32.step_s}
    from gradcomp.experiments.study import phases

    for m in methods:  # a pilot must reach a phased method's steady phase, and read its second half there
        start = phases.boundary(m, getattr(opts, "steps", None))
        if m.label not in skip and m.optimizer is not None and base.optimizer != "adamw":
            skip[m.label] = (f"{m.optimizer} is an Adam, and gradcomp train trains {opts.model} with "
                             f"{base.optimizer}: not piloted")
        elif m.label not in skip and start > steps // 2:
            skip[m.label] = (f"its steady phase starts at step {start}, past the middle of a {steps}-step pilot: "
                             f"not piloted (give --pilot-steps {2 * start} or more, or race it: gradcomp race --link)")
    methods = [phases.for_pilot(m, getattr(opts, "steps", None)) for m in methods]
    count = 1 + sum(1 for m in methods if m.label not in skip and not is_fp32(m))
    per_step = 1.3 * opts.workers * compute_s  # simulated workers take turns on this machine's cores
    alone = 1 if opts.target is not None else 0  # fp32's first and alone when a given target is to be checked
    at_once = parallel_pilots(count - alone)
    rounds = alone + math.ceil((count - alone) / at_once)
    after = " after fp32's" if alone else ""
    log(f"pilots: {count} of {steps} steps each ({opts.workers} simulated workers, gradcomp train's defaults for "
        f"{opts.model}; {at_once} at a time{after}); about "
        f"{max(1, round(rounds * steps * per_step / 60))} min unless cached")
    result = run_pilots(methods, base, cache, machine, log, opts.target, skip)
    out_rows = {m.label: timed(result["predictions"][m.label], by_label[m.label]) for m in methods}
    return {"value": result["target"], "metric": "validation bits/byte" if result["lower"] else "test accuracy %",
            "lower_is_better": result["lower"], "tolerance": result["tolerance"], "pilot_steps": steps,
            "fp32_steps": result["fp32_steps"], "given": opts.target is not None,
            "pilots": result["pilots"], "rows": out_rows}


def timed(p: Prediction, row) -> dict[str, Any]:
    """A plan row's target columns: the prediction, and its time (step time x steps, phase by phase) with its range;
    no time for a method that does not keep up."""
    time_s = row.seconds_for(p.steps) if p.keeps_up and p.steps is not None else None
    return {
        "status": p.status, "detail": p.detail, "steps_to_target": p.steps, "gap": p.gap, "time_s": time_s,
        "time_low_s": row.seconds_for(p.steps_low) if time_s is not None and p.steps_low is not None else None,
        "time_high_s": row.seconds_for(p.steps_high) if time_s is not None and p.steps_high is not None else None,
    }


def pilot_base(opts, steps: int):
    """The pilot's configuration: the first ``steps`` steps of the run planned for (``run_length``)."""
    return base_config(opts.model, opts.dataset, opts.data_root, opts.batch_size, opts.workers, steps,
                       opts.seed, run_steps=run_length(opts))


def recommend_by_target(rows: Sequence[Any], target: dict[str, Any], fp32_name: str) -> str:
    """One sentence: the method predicted to reach the target first, among those that keep up with fp32."""
    info = target["rows"]
    able = [r for r in rows if info[r.label]["time_s"] is not None]
    what = f"{target['metric']} {target['value']:.3f}"
    if not able:
        where = "recorded runs" if target.get("source") == "recorded" else "pilots"
        return f"no method keeps up with fp32 to {what} in the {where}: nothing to recommend"
    best = min(able, key=lambda r: info[r.label]["time_s"])
    fp32 = next((r for r in rows if r.method == fp32_name), None)
    t = info[best.label]
    text = (f"use {best.label}: predicted {t['time_s']:.0f} s to {what} ({t['time_low_s']:.0f}-{t['time_high_s']:.0f} "
            f"s; {t['steps_to_target']:.0f} steps of {1e3 * best.step_s:.1f} ms)")
    if fp32 is not None and fp32 is not best and info[fp32.label]["time_s"]:
        text += f", {info[fp32.label]['time_s'] / t['time_s']:.2f} x sooner than uncompressed fp32"
    elif fp32 is best:
        text = f"uncompressed fp32 is predicted to reach {what} first ({t['time_s']:.0f} s)"
    return text


def plot_time_to_target(plan: dict[str, Any], path: str, title: str) -> bool:
    """Bars of each method's predicted time to the target, with its range; the methods that do not keep up
    listed, not drawn. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    able = [r for r in plan["rows"] if r.get("time_s") is not None]
    others = [r["label"] for r in plan["rows"] if r.get("time_s") is None]
    fig, ax = plt.subplots(figsize=(7, 0.45 * max(3, len(able)) + 1.2))
    labels = [r["label"] for r in able][::-1]
    times = [r["time_s"] for r in able][::-1]
    low = [r["time_s"] - (r["time_low_s"] if r["time_low_s"] is not None else r["time_s"]) for r in able][::-1]
    high = [(r["time_high_s"] if r["time_high_s"] is not None else r["time_s"]) - r["time_s"] for r in able][::-1]
    ax.barh(labels, times, xerr=[low, high], color="#4a7fb5", capsize=3)
    target = plan["target"]
    ax.set_xlabel(f"predicted seconds to {target['metric']} {target['value']:.3f}")
    ax.set_title(title, fontsize=7)
    if others:
        fig.text(0.01, 0.01, "not drawn (do not keep up, diverged or not piloted): " + ", ".join(others), fontsize=6)
    fig.tight_layout(rect=(0, 0.04 if others else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
