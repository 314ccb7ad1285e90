"""`gradcomp plan`: which method gives the shortest training step on a given network, predicted before training.

For a model (``--model NAME``, any name ``experiments/run/models.py`` builds) or a list of parameter shapes
(``--shapes FILE``, a JSON list such as ``[[1024, 3072], [3072]]``), W workers and a link, the planner

1. **measures the exact traffic** of every method: it runs real steps of the method's scheme (its compressor,
   topology, server compressor, its own rounds) on a ``SimulatedCluster`` of W workers with the model's real
   parameter shapes and seeded random gradients, and reads each worker's ``ByteCounter``: bytes up and down,
   and per collective (all-reduce, all-gather, all-to-all, gather, broadcast) the number of calls and the
   bytes handed to them. No formula for any method's size is involved;
2. **measures the cost of compressing** on this machine: the same steps' ``compress_s`` (everything the
   exchange does outside collectives: compress, encode, decode, decompress, aggregate, a parameter server's
   work on rank 0), the slowest worker's median over the timed steps, after warm-up steps. Both 1 and 2 run
   the step as training runs it: bucket by bucket as the DDP hook does (DDP's rebuilt buckets), or with
   ``ddp=off`` once after backward as ``GradientAggregator`` does (``measure_method``);
3. **measures compute**: forward + backward of the model on one batch (median of a few), or ``--compute-ms``;
4. **prices the communication** with the latency-bandwidth model (:mod:`gradcomp.netmodel`: ring all-reduce,
   ring all-gather, pairwise all-to-all, gather to a root, binomial broadcast) on the recorded collectives, with
   a token-bucket link's burst credited once per step (``--burst``);
5. predicts a step as compute + compression + communication (no overlap of communication with backward is
   assumed) and recommends the fastest method, saying so when uncompressed fp32 is the fastest.

Where every worker shares this machine's cores (``--colocated W`` with ``--model``: ``gradcomp race``'s emulated
hosts), 2 and 3 are taken from a **local race** instead (``measure_local``): each method trains a few steps with
its W workers on this machine joined by an unshaped network, and the race's clocks give its compute, its
compression and the rest of its step, the time its collectives take when the bytes cost next to nothing. That
rest is waiting: a collective ends when the last worker reaches it, and with two workers to a core some worker
is always descheduled, at each of the method's rounds; a synthetic round of equal work on every worker
underestimated it several times over for the methods with most rounds (docs/plan.md). On a shaped link the same
wait overlaps the wire time, so the prediction's communication is the longer of the two. With ``--colocated N``
below W (or ``--shapes``), compute and compression are timed in N processes at once and priced as above.

Measurements (1, 2, 3 and the local race) are cached under ``~/.cache/gradcomp/plan/`` (``GRADCOMP_CACHE_DIR``
moves it), keyed by the CPU model or GPU name, the torch and gradcomp versions (with a digest of gradcomp's source,
so an edited compressor is measured again), the thread count, the shapes (for a local race: the model, dataset
and batch), W and the method; ``--no-cache`` measures again.

torch's DDP baselines of ``gradcomp race`` are planned as the gradcomp method that sends the same messages:
``torch-fp32`` as ``none`` (one fp32 all-reduce), ``torch-fp16`` as ``fp16`` (an fp16 all-reduce).
``torch-powersgd`` has no gradcomp counterpart with identical messages: torch's hook itself runs, on a gloo group
of one process, and its all-reduces are recorded (``measure_torch_powersgd``; CPU only).

The parts: ``plan_options`` (the methods, the shapes, every option checked), ``plan_cache`` (what a measurement is
valid for, and the cache), ``plan_measure`` (1, 2 and 3 on simulated workers, ``colocated``), ``plan_local`` (the
local race), ``plan_price`` (4 and 5, and the fit over W of scripts/plan_extrapolate.py), ``plan_report`` (the
table); this module runs them, is the command, and re-exports their names (the tests and
scripts/plan_extrapolate.py import them from here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from gradcomp.experiments.race import race
from gradcomp.experiments.race.method import Method
from gradcomp.experiments.study import phases as phased
from gradcomp.experiments.study import pilot, recorded
from gradcomp.experiments.study.pilot import pilot_steps
from gradcomp.experiments.study.plan_cache import CACHE_FORMAT, Cache, machine_identity  # noqa: F401 (re-exported)
from gradcomp.experiments.study.plan_local import (  # noqa: F401 (re-exported)
    LOCAL_COMPUTE_STEPS,
    LOCAL_STEPS,
    cached_local_race,
    measure_local,
)
from gradcomp.experiments.study.plan_measure import (  # noqa: F401 (re-exported)
    BYTES_PER_ENTRY_PER_WORKER,
    COMPUTE_REPEATS,
    TIMED_STEPS,
    WARMUP_STEPS,
    check_memory,
    colocated,
    ddp_buckets,
    measure_compute,
    measure_method,
    measure_torch_powersgd,
    merge_colocated,
    model_shapes,
    random_gradients,
)
from gradcomp.experiments.study.plan_options import (  # noqa: F401 (re-exported)
    BASELINE_EQUIVALENTS,
    DEFAULT_METHODS,
    PlanOptions,
    check_shapes,
    load_shapes,
    parse_method,
)
from gradcomp.experiments.study.plan_price import (  # noqa: F401 (re-exported)
    FP32,
    SMALL_MARGIN,
    Fitted,
    PlanRow,
    Traffic,
    communication_seconds,
    fit_in_workers,
    price,
    recommend,
)
from gradcomp.experiments.study.plan_report import (  # noqa: F401 (re-exported)
    HEADER,
    TARGET_HEADER,
    format_markdown,
    format_text,
    header,
    table_rows,
    title,
)

# -- the planner ---------------------------------------------------------------------------------------------


def run_plan(opts: PlanOptions, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Check everything, measure (or read the cache), price; returns the plan as a dict (``--json``)."""
    opts = _with_batch_size(opts)
    runs = None
    if opts.recorded and opts.model is not None:  # read, and the run's length taken, before anything is measured
        runs = recorded.load(opts.recorded)
        opts = dataclasses.replace(opts, steps=recorded.run_length(opts, runs))
    network, methods = opts.checked()
    shapes, source = _shapes(opts)
    check_memory(sum(math.prod(s) for s in shapes), opts.workers, opts.device)
    cache = Cache(opts.cache_dir, opts.cache)
    machine = machine_identity(opts.device)
    # every worker on this machine (gradcomp race's emulated hosts): the local race measures each method's step
    local_race = opts.model is not None and opts.colocated > 1 and opts.colocated == opts.workers
    # what is measured: every plain method, and each phase's exchange of a phased one (study/phases.py)
    split = {m.label: phased.phases(m, opts.steps) for m in methods}
    units = [p.method for m in methods for p in (split[m.label] or [])] + [m for m in methods if not split[m.label]]
    units = list({u.label: u for u in units}.values())  # (0/1 Adam's phases share two exchanges: each measured once)
    sharing = opts.colocated if opts.colocated > 1 and not local_race else 1  # parts timed n processes at once
    local = cached_local_race(opts, units, cache, machine, log) if local_race else {}
    compute_s, compute_from = _compute(opts, local_race, local, sharing, cache, machine, log)
    if opts.pilots and opts.model is not None and runs is None:
        pilot_steps(opts.model, opts.pilot_steps)  # a bad --pilot-steps: ConfigError before any measurement
    priced: dict[str, PlanRow] = {}
    for method in units:
        traffic = _traffic(method, opts, shapes, sharing, cache, machine, log)
        mine = local.get(method.label)
        row_compute = compute_s if opts.compute_ms is not None or mine is None else mine["compute_s"]
        priced[method.label] = price(method.label, method.name, traffic, network, opts.workers, row_compute,
                                     method.note, mine)
    rows = [phased.combine(m, [(p, priced[p.method.label]) for p in split[m.label]], opts.steps, PlanRow)
            if split[m.label] else priced[m.label] for m in methods]
    target = None
    if runs is not None:
        target = recorded.to_target(opts, methods, rows, runs, log)
    elif opts.pilots and opts.model is not None:
        target = pilot.to_target(opts, methods, rows, cache, FP32, machine, compute_s, log)
    ordered = _ranked(rows, target)
    return {
        "source": source,
        "num_parameters": sum(math.prod(s) for s in shapes),
        "tensors": len(shapes),
        "workers": opts.workers,
        "network": {"bandwidth_bps": network.bandwidth_bps, "latency_s": network.latency_s,
                    "burst_bytes": network.burst_bytes},
        "device": opts.device,
        "colocated": opts.colocated,
        "local_race": local_race,
        "machine": machine,
        "compute_s": compute_s,
        "compute_from": compute_from,
        "cache": {"directory": str(cache.directory) if cache.enabled else None, "hits": cache.hits,
                  "misses": cache.misses},
        "rows": [{**r.as_dict(), **(target["rows"][r.label] if target else {})} for r in ordered],
        "target": {k: v for k, v in target.items() if k != "rows"} if target else None,
        "recommendation": pilot.recommend_by_target(ordered, target, FP32) if target else recommend(rows),
    }


def _with_batch_size(opts: PlanOptions) -> PlanOptions:
    """``opts`` with the batch size gradcomp train would use where none is given: the Transformer's for a language
    model, else 32."""
    if opts.batch_size is not None:
        return opts
    from gradcomp.experiments.run.options import TRANSFORMER_DEFAULTS

    text = race.text_model(opts.model or "")
    return dataclasses.replace(opts, batch_size=TRANSFORMER_DEFAULTS["batch_size"] if text else 32)


def _shapes(opts: PlanOptions) -> tuple[list[tuple[int, ...]], str]:
    """The parameter shapes planned (the model's, or ``--shapes``) and the plan's words for where they come from."""
    if opts.model is not None:
        shapes = model_shapes(opts.model, opts.dataset, opts.data_root, opts.seed)  # unknown model: ConfigError
        return shapes, f"model {opts.model} on {opts.dataset}"
    return list(opts.shapes), f"shapes from {opts.shapes_source or 'a list'}"  # type: ignore[arg-type]


def _compute(opts: PlanOptions, local_race: bool, local: dict[str, dict[str, float]], sharing: int, cache: Cache,
             machine: dict[str, Any], log: Callable[[str], None]) -> tuple[float, str]:
    """The step's compute in seconds and where it comes from: ``--compute-ms``, the local race's median, the
    model's forward + backward measured (in ``sharing`` processes at once; cached), or none for bare shapes."""
    if opts.compute_ms is not None:
        return opts.compute_ms / 1e3, "--compute-ms"
    if local_race:
        compute_s = statistics.median(v["compute_s"] for v in local.values())
        return compute_s, (f"measured per method in the local race: forward, backward and SGD, {opts.workers} "
                           f"workers at once, batch {opts.batch_size}; the median")
    if opts.model is None:
        return 0.0, "not included (--shapes without --compute-ms)"
    log(f"measuring forward + backward of {opts.model} (batch {opts.batch_size})")
    key = {"what": "compute", "machine": machine, "model": opts.model, "dataset": opts.dataset,
           "batch_size": opts.batch_size, "device": opts.device, "seed": opts.seed}
    if sharing > 1:
        key["colocated"] = sharing
    compute_s = cache.get_or_measure(key, lambda: {"compute_s": statistics.median(
        m["compute_s"] for m in colocated(measure_compute, sharing, opts.model, opts.dataset,
                                          opts.data_root, opts.batch_size, opts.device, opts.seed))})["compute_s"]
    compute_from = f"measured: forward + backward, batch {opts.batch_size}"
    if sharing > 1:
        compute_from += f", {sharing} at once"
    return compute_s, compute_from


def _traffic(method: Method, opts: PlanOptions, shapes: Sequence[tuple[int, ...]], sharing: int, cache: Cache,
             machine: dict[str, Any], log: Callable[[str], None]) -> Traffic:
    """One method's traffic and compression on ``opts.workers`` simulated workers (in ``sharing`` processes at
    once), from the cache or measured: ``measure_method``, or for torch's PowerSGD hook ``measure_torch_powersgd``."""
    log(f"measuring {method.label} on {opts.workers} simulated workers")
    key = {"what": "method", "machine": machine, "shapes": [list(s) for s in shapes], "workers": opts.workers,
           "device": opts.device, "seed": opts.seed, "method": method.key(),
           "steps": [WARMUP_STEPS, TIMED_STEPS]}
    if sharing > 1:
        key["colocated"] = sharing
    if method.baseline == "torch-powersgd":  # torch's own hook: its all-reduces recorded, in a process
        measured = cache.get_or_measure(key, lambda: merge_colocated(colocated(
            measure_torch_powersgd, sharing, method, shapes, opts.workers, opts.seed, spawn=True)))
    else:
        measured = cache.get_or_measure(key, lambda: merge_colocated(colocated(
            measure_method, sharing, method, shapes, opts.workers, opts.device, opts.seed)))
    return Traffic.from_measurement(measured)


def _ranked(rows: list[PlanRow], target: dict[str, Any] | None) -> list[PlanRow]:
    """The rows fastest first: by predicted time to the target where the pilots gave one (the methods that never
    reach it last), else by predicted step."""
    ordered = sorted(rows, key=lambda r: r.step_s)
    if target is not None:
        ordered = sorted(rows, key=lambda r: (target["rows"][r.label]["time_s"] is None,
                                             target["rows"][r.label]["time_s"] or r.step_s))
    return ordered


# -- command line --------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", default=None, help="a model gradcomp train takes (default: convnet)")
    what.add_argument("--shapes", default=None, metavar="FILE", help="JSON list of parameter shapes instead")
    p.add_argument("--workers", type=int, default=4, help="number of workers, >= 2")
    p.add_argument("--link", required=True, help="per-worker link rate, e.g. 100mbit, 1Gbit/s, 10gbit")
    p.add_argument("--latency", default="0", help="per-message latency, e.g. 50us, 1ms")
    p.add_argument("--burst", default="0", help="the link's token-bucket burst, e.g. 256kb (tc's KiB): the first "
                   "bytes of each step pass at line rate (gradcomp race's emulated links: 256kb; default 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help="methods as gradcomp race --method takes them (default: the race's set plus bf16, "
                        "terngrad)")
    p.add_argument("--dataset", default=None, help="the dataset the model is built for and timed on (default: "
                   "gradcomp train's for the model: pystdlib for a language model, else mnist)")
    p.add_argument("--data", default=None, metavar="DIR", help="directory with MNIST-format IDX files")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per worker, for the measured compute (default: gradcomp train's, 32; 16 for a language model)")
    p.add_argument("--compute-ms", type=float, default=None, help="forward + backward per step instead of measuring")
    p.add_argument("--colocated", type=int, default=1, metavar="N",
                   help="workers that share this machine's cores, as gradcomp race's emulated hosts do (N = --workers "
                        "with --model: a local race measures each method's step, docs/plan.md); compute and "
                        "compression are timed in N processes at once (default 1: each worker has a machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="the run's length: needed to plan a method whose steps are not all alike (dense_steps, "
                        "onebit_adam's freeze, local_steps), planned phase by phase (docs/plan.md)")
    p.add_argument("--target", type=float, default=None,
                   help="rank by predicted time to this validation bits/byte (language models) or test accuracy in %% "
                        "(classifiers); default: fp32's value at the end of its pilot")
    p.add_argument("--pilot-steps", type=int, default=None, metavar="N",
                   help=f"steps of each method's pilot (default {pilot.PILOT_STEPS['image']} for a classifier, "
                        f"{pilot.PILOT_STEPS['text']} for a language model)")
    p.add_argument("--recorded", nargs="+", default=None, metavar="PATH",
                   help="steps to the target from these recorded runs instead of pilots: gradcomp train --json "
                        "results, JSON lines of them, or a gradcomp race race.json (or its directory); docs/plan.md")
    p.add_argument("--no-pilot", action="store_true",
                   help="rank by predicted step time only (no pilots; the plan of earlier versions)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw the predicted time to target per method with its range (default with pilots: "
                        "gradcomp-plan.png; needs matplotlib)")
    p.add_argument("--no-plot", action="store_true", help="draw nothing")
    p.add_argument("--no-cache", action="store_true", help="measure again instead of reusing cached measurements")
    p.add_argument("--json", default=None, metavar="PATH", help="write the plan as JSON")
    p.add_argument("--markdown", action="store_true", help="print a markdown table instead of plain text")


def _default_dataset(model: str | None) -> str:
    """gradcomp train's default dataset for ``model``: the text corpus for a language model, else MNIST."""
    from gradcomp.experiments.run.models import TEXT_MODELS

    return "pystdlib" if isinstance(model, str) and model.strip().lower() in TEXT_MODELS else "mnist"


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    shapes = load_shapes(args.shapes) if args.shapes else None
    return PlanOptions(
        model=None if shapes is not None else (args.model or "convnet"),
        shapes=shapes, shapes_source=args.shapes, dataset=args.dataset or _default_dataset(args.model),
        data_root=args.data,
        batch_size=args.batch_size, workers=args.workers, link=args.link, latency=args.latency, burst=args.burst,
        device=args.device, methods=args.methods or DEFAULT_METHODS, compute_ms=args.compute_ms,
        colocated=args.colocated, cache=not args.no_cache, seed=args.seed,
        pilots=not args.no_pilot, pilot_steps=args.pilot_steps, target=args.target, steps=args.steps,
        recorded=tuple(getattr(args, "recorded", None) or ()),
    )


def main(args: argparse.Namespace) -> int:
    import sys

    if args.json:
        from gradcomp.experiments.run.report import check_output_file

        check_output_file(args.json, "--json")
    opts = options_from_args(args)
    plan = run_plan(opts, log=lambda s: print(s, file=sys.stderr))
    print(format_markdown(plan) if args.markdown else format_text(plan))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan, f, indent=2)
    if plan.get("target") and not args.no_plot:
        path = args.plot or "gradcomp-plan.png"
        if pilot.plot_time_to_target(plan, path, title(plan)):
            print(f"plot: {path}", file=sys.stderr)
        else:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0
