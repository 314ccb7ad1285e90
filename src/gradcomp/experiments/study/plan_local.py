"""The local race of `gradcomp plan --colocated W`: every worker on this machine, joined by an unshaped network,
each method's step measured by `gradcomp race`."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from gradcomp.experiments.race import race
from gradcomp.experiments.race.method import Method
from gradcomp.experiments.study.plan_cache import Cache
from gradcomp.experiments.study.plan_options import PlanOptions

LOCAL_STEPS = 20  # training steps of each method in the local race (its median step is taken)
LOCAL_COMPUTE_STEPS = 8  # the race's compute-only steps before each method


def measure_local(opts: PlanOptions, methods: Sequence[Method], log: Callable[[str], None]) -> dict[str, Any]:
    """Each method's training step with its ``opts.workers`` workers all on this machine, joined by an unshaped
    network: ``gradcomp race --link none`` (network namespaces where it can make them, as the shaped race does;
    plain local processes otherwise), ``LOCAL_STEPS`` steps of SGD per method, the model and batch of the plan.

    What the race measures per method is what a plan of colocated workers cannot price from parts: the median
    step, the compute-only step (forward, backward, optimizer, every worker at once), the compression the
    workers' own clocks count, and so the rest of the step, the time spent in collectives when moving the bytes
    costs next to nothing: waiting for the worker the scheduler ran last, at every one of the method's rounds.
    Returns ``{label: {"step_s", "compute_s", "compress_s"}}``.
    """
    from gradcomp.errors import GradcompError
    from gradcomp.experiments.race import race as racing

    ro = racing.Options(
        methods=list(methods), hosts=opts.workers, link="none", steps=LOCAL_STEPS, batch_size=opts.batch_size,
        dataset=opts.dataset, data_root=opts.data_root, model=opts.model or "", seed=opts.seed, device=opts.device,
        target_loss=1.0 if race.text_model(opts.model or "") else None, eval_every=LOCAL_STEPS,
        compute_steps=LOCAL_COMPUTE_STEPS, out=None, verbose=False)  # no target is used: only step times are read
    result = racing.race(ro, log=log)
    local = {}
    for m in result["methods"]:
        if m.get("error"):
            raise GradcompError(f"the local race of {m['label']} failed: {m['error']}")
        compress = [c for c in m.get("median_compress_s") or [] if c is not None]
        local[m["label"]] = {"step_s": m["median_step_s"], "compute_s": m["compute_only_step_s"],
                             "compress_s": statistics.median(compress) if compress else 0.0}
    return local



def cached_local_race(opts: PlanOptions, methods: Sequence[Method], cache: Cache, machine: dict[str, Any],
                      log: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """``measure_local``'s result for each of ``methods``: the cached ones read, the others raced together in one
    local race and cached, each under its own key."""

    def local_key(m: Method) -> dict[str, Any]:
        return {"what": "local", "machine": machine, "model": opts.model, "dataset": opts.dataset,
                "batch_size": opts.batch_size, "device": opts.device, "seed": opts.seed,
                "workers": opts.workers, "method": m.key(), "steps": [LOCAL_STEPS, LOCAL_COMPUTE_STEPS]}

    local = {m.label: v for m in methods if (v := cache.get(local_key(m))) is not None}
    todo = [m for m in methods if m.label not in local]
    if todo:
        log(f"measuring {len(todo)} methods' steps with {opts.workers} workers on this machine, unshaped "
            f"(gradcomp race --link none, {LOCAL_STEPS} steps each)")
        measured = measure_local(opts, todo, log)
        for m in todo:
            cache.put(local_key(m), measured[m.label])
        local.update(measured)
    return local
