"""`gradcomp race`: time to accuracy of several methods, each over W emulated hosts behind shaped links.

Every method runs the same training (model, data, seed, steps, batches) on the same emulated network, one
method after the other, and is timed by a training clock that stops while the model is evaluated. See
docs/race.md for what is measured and how to read it.

Methods: ``--method``, repeated, as :mod:`gradcomp.experiments.race.method` parses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from gradcomp.errors import ConfigError, GradcompError
from gradcomp.experiments.race import netns
from gradcomp.experiments.race.netns import link_rate
from gradcomp.experiments.race.report import (  # noqa: F401 (render_plot, _secs: for the tests and the seeds)
    EXTRA_MEMORY, MEMORY_FLAG, _secs, code_version, machine, render_plot, render_table, write_outputs,
)
from gradcomp.experiments.race.method import DEFAULT_METHODS, RUN_KEYS, Method, parse_method  # noqa: F401
from gradcomp.experiments.run.report import make_output_dir

MASTER_PORT = 29500  # inside host 0's own namespace: no other process can hold it
BURST_FACTOR = 20  # warn when a host sends less than this many tbf bursts over a method's whole run
with open(os.path.join(os.path.dirname(__file__), "race_targets.json")) as _f:
    TARGETS: dict[str, Any] = json.load(_f)  # the figures of check_targets, as data
TARGET_RATE_BPS = float(TARGETS["rate_bps"])  # the link the targets are set for


class WorkerFailedError(GradcompError):
    """A race worker exited with an error; the message carries its last line."""


class Interrupted(BaseException):
    """SIGTERM / SIGHUP, raised in the main thread so that every ``finally`` tears down."""


# -- running -------------------------------------------------------------------------------------------------


@dataclass
class Options:
    methods: list[Method]
    hosts: int = 4
    link: str = "100mbit"
    netns_mode: str = "auto"  # "auto", "off" (plain local processes; only with link none)
    steps: int = 500
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    dataset: str = "mnist"
    data_root: str | None = None
    model: str = "convnet"
    seed: int = 0
    device: str = "cpu"
    target: float = 0.98
    # a language model is raced to a validation loss instead (bits per byte; lower is better)
    target_loss: float | None = None
    # further TrainConfig fields (optimizer, schedule, context) from the shared training options
    train_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    eval_every: int = 50
    compute_steps: int = 20
    timeout_s: float = 900.0
    out: str | None = "race"
    verbose: bool = True
    # a timing race (race/links.py): each method's own number of steps, by label (None: ``steps`` for all)
    method_steps: dict[str, int] | None = None
    window: int = 50  # with several links: steady steps timed at the links after the first (race/links.py)


def make_network(opts: Options, log=print):
    """The emulated hosts; EmulationError (nothing created) when a shaped link cannot be had here."""
    rate = link_rate(opts.link)
    if rate is not None:
        if opts.netns_mode == "off":
            raise ConfigError("--no-netns runs plain local processes, which cannot be shaped: use --link none")
        netns.require_emulation(shaped=True)
        return netns.NamespaceNetwork(opts.hosts, rate)
    if opts.netns_mode == "off":
        return netns.LocalHosts(opts.hosts)
    reason = netns.missing_tools(shaped=False)
    if reason is not None:
        log(f"gradcomp race: --link none without namespaces ({reason}): {opts.hosts} local processes on 127.0.0.1")
        return netns.LocalHosts(opts.hosts)
    return netns.NamespaceNetwork(opts.hosts, None)


def base_config(opts: Options):
    from gradcomp.experiments.run.config import TrainConfig

    return TrainConfig(
        workers=opts.hosts, steps=opts.steps, batch_size=opts.batch_size, lr=opts.lr, momentum=opts.momentum,
        weight_decay=opts.weight_decay, dataset=opts.dataset, data_root=opts.data_root, model=opts.model,
        seed=opts.seed, device=opts.device, progress=False, timeout_s=opts.timeout_s, eval_every=0,
        **opts.train_extra,
    )


def is_text(opts: Options) -> bool:
    return text_model(opts.model)


def goal(opts: Options) -> float:
    """What the race is timed to: the target accuracy, or for a language model the target loss."""
    return opts.target_loss if is_text(opts) else opts.target


def plan(opts: Options, log=print) -> tuple[list[Any], int]:
    """Every method's TrainConfig, checked before anything starts; and the model's parameter count."""
    from gradcomp.experiments.run.models import build_model

    if not opts.methods:
        raise ConfigError("no method to race")
    if not 1 <= opts.hosts <= netns.MAX_HOSTS:
        raise ConfigError(f"--hosts must be between 1 and {netns.MAX_HOSTS}, got {opts.hosts}")
    link_rate(opts.link)
    if not 0 < opts.target <= 1:
        raise ConfigError(f"--target is an accuracy in (0, 1], got {opts.target}")
    if is_text(opts):
        if opts.target_loss is None:
            raise ConfigError(f"--model {opts.model} is raced to a validation loss: give --target-loss BITS "
                              "(bits per byte, e.g. 2.5)")
        if not (math.isfinite(opts.target_loss) and opts.target_loss > 0):
            raise ConfigError(f"--target-loss is a loss in bits per byte, > 0; got {opts.target_loss}")
    elif opts.target_loss is not None:
        raise ConfigError(f"--target-loss applies to a language model (--model transformer), not {opts.model}: "
                          "use --target (an accuracy)")
    if opts.eval_every < 0 or opts.compute_steps < 0:
        raise ConfigError("--eval-every and --compute-steps must be >= 0")
    if opts.device == "cuda" and torch_cuda_count() < opts.hosts:
        raise ConfigError(
            f"--hosts {opts.hosts} with --device cuda needs one GPU per emulated host (NCCL refuses two ranks on "
            f"one GPU), but torch sees {torch_cuda_count()}; to fix: --hosts {torch_cuda_count()} or fewer, or "
            "--device cpu"
        )
    labels = [m.label for m in opts.methods]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"two methods have the same label: {labels}; give one label=...")
    base = base_config(opts)
    data = base.load_data()
    num_parameters = sum(p.numel() for p in build_model(opts.model, data, opts.seed).parameters())
    configs = []
    for method in opts.methods:
        cfg = method.config(base, num_parameters)
        note = cfg.hand_momentum_to_method() if method.is_gradcomp else None
        if note:
            log(f"gradcomp race: {method.label}: {note}")
        try:
            cfg.validate()
        except ConfigError as exc:
            raise ConfigError(f"--method {method.text!r}: {exc}") from None
        if method.baseline and not cfg.ddp:
            raise ConfigError(f"--method {method.text!r}: torch's baselines need DDP")
        if opts.method_steps is not None:
            # a timing window: fewer steps, the freeze step the full run resolved kept (its default is a
            # fraction of the steps)
            cfg = dataclasses.replace(cfg, steps=opts.method_steps[method.label],
                                      freeze_step=cfg.resolved_freeze_step())
        configs.append(cfg)
    return configs, num_parameters


def torch_cuda_count() -> int:
    """GPUs torch can use here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_over_the_link(ifname: str) -> dict[str, str]:
    """NCCL's settings that make its traffic cross the host's shaped veth like gloo's.

    The emulated hosts share one machine, so NCCL would otherwise move data between their GPUs over
    NVLink/PCIe (P2P) or shared memory and never touch the link being measured. Sockets on the host's
    interface only, as between machines without InfiniBand.
    """
    return {
        "NCCL_NET": "Socket",  # not a network plugin's transport, if one is installed
        "NCCL_SOCKET_IFNAME": "=" + ifname,  # exactly this interface, not a prefix
        "NCCL_COLLNET_ENABLE": "0",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0",
    }


def _stop(procs: list[subprocess.Popen]) -> None:
    """End the workers this race started (by their PIDs): SIGTERM, then SIGKILL after a grace period."""
    for p in procs:
        if p.poll() is None:
            try:
                p.terminate()
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 3.0
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return "(no output)"
    return lines[-1] if lines else "(no output)"


def run_method(network, method: Method, cfg, opts: Options, workdir: str, index: int, log=print) -> dict[str, Any]:
    """Start one worker per host, relay rank 0's progress lines, collect the W result files."""
    from gradcomp.experiments.run.runner import worker_threads

    jobdir = os.path.join(workdir, f"{index:02d}")
    os.makedirs(jobdir)
    threads = worker_threads(len(network.hosts))
    in_netns = isinstance(network, netns.NamespaceNetwork)
    job = {
        "train": dataclasses.asdict(cfg),
        "baseline": method.baseline,
        "baseline_params": method.params if method.baseline else {},
        "eval_every": opts.eval_every,
        "eval_batch": opts.batch_size,
        "compute_steps": opts.compute_steps,
        "threads": threads,
        "dir": jobdir,
        "netns": in_netns,
        "label": method.label,
        "verbose": opts.verbose,
    }
    job_path = os.path.join(jobdir, "job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    hosts = network.hosts
    procs: list[subprocess.Popen] = []
    logs = [os.path.join(jobdir, f"worker-{h.index}.log") for h in hosts]
    started = time.perf_counter()
    try:
        for host, log_path in zip(hosts, logs):
            env = dict(
                os.environ,
                MASTER_ADDR=hosts[0].address,
                MASTER_PORT=str(MASTER_PORT if in_netns else 0),
                RANK=str(host.index),
                WORLD_SIZE=str(len(hosts)),
                LOCAL_RANK=str(host.index),  # every emulated host runs on this machine: with CUDA, its own GPU
                GLOO_SOCKET_IFNAME=host.ifname,
                OMP_NUM_THREADS=str(threads),
                **_nccl_over_the_link(host.ifname),
            )
            argv = host.command([sys.executable, "-m", "gradcomp.experiments.race.race_worker", job_path])
            with open(log_path, "w") as out:
                # own session: Ctrl-C reaches the race, which stops its workers itself
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        relayed = 0
        while True:
            codes = [p.poll() for p in procs]
            relayed = _relay(logs[0], relayed, log if opts.verbose else None)
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # the first to fail is usually the cause; the others then lose their peer
                i = min(failed, key=lambda j: os.path.getmtime(logs[j]))
                kept = logs[i]
                if opts.out:  # the job directory is temporary: keep the failed worker's log beside the results
                    os.makedirs(opts.out, exist_ok=True)
                    kept = os.path.join(opts.out, f"failed-{index:02d}-worker-{i}.log")
                    shutil.copyfile(logs[i], kept)
                raise WorkerFailedError(
                    f"{method.label}: worker {i} failed (exit {codes[i]}): {_last_line(logs[i])} (log: {kept})"
                )
            if all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    finally:
        with netns.signals_held():  # a second Ctrl-C or SIGTERM does not leave a worker running
            _stop(procs)
    wall_s = time.perf_counter() - started
    results = []
    for host in hosts:
        with open(os.path.join(jobdir, f"result-{host.index}.json")) as f:
            results.append(json.load(f))
    return {"wall_s": wall_s, "workers": results}


def _relay(path: str, offset: int, log) -> int:
    """Print the lines rank 0 added to its log since ``offset`` (its progress lines); returns the new offset."""
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            text = f.read()
    except OSError:
        return offset
    end = text.rfind("\n") + 1
    if log is not None:
        for line in text[:end].splitlines():
            if line.startswith("  "):  # the worker's progress lines; tracebacks are reported on failure
                log(line)
    return offset + len(text[:end].encode())


# -- results -------------------------------------------------------------------------------------------------


def first_reaching(curve: list[list[float]], target: float, lower: bool = False) -> tuple[int, float] | None:
    """(step, seconds) of the first point reaching ``target``: an accuracy at least it, or (``lower``) a loss at
    most it."""
    for step, seconds, value in curve:
        if value is not None and (value <= target if lower else value >= target):
            return int(step), float(seconds)
    return None


def text_model(name: str) -> bool:
    """Whether ``name`` is a language model (raced to a validation loss; the planner's batch default too)."""
    from gradcomp.experiments.run.models import TEXT_MODELS

    return name.strip().lower() in TEXT_MODELS


def method_record(method: Method, cfg, raw: dict[str, Any], num_parameters: int) -> dict[str, Any]:
    workers = raw["workers"]
    lead = workers[0]
    compute = [t for w in workers for t in w["compute_only_s"]]  # the workers' warm-up steps are not in it
    tiny = [t for w in workers for t in w.get("tiny_allreduce_s") or []]
    steps = lead["steps"]
    wire_tx = [w["wire_tx_bytes"] for w in workers if w["wire_tx_bytes"] is not None]
    stats = lead["stats"]
    counter = stats.get("counter") or {}
    cuda = [w["cuda_peak_bytes"] for w in workers if w.get("cuda_peak_bytes") is not None]
    return {
        **failed_record(method, None), "compressor": cfg.compressor, "params": method.params,
        "feedback": cfg.feedback, "topology": cfg.topology, "server_compressor": cfg.server_compressor,
        "ddp": cfg.ddp, "bucket_cap_mb": cfg.bucket_cap_mb, "lr": cfg.lr, "momentum": cfg.momentum, "steps": steps,
        "curve": lead["curve"],
        "final_accuracy": lead["curve"][-1][2] if lead["curve"] else None,
        # the curve holds validation bits per byte for a language model: its best is the lowest
        "best_accuracy": (min if text_model(cfg.model) else max)((a for _, _, a in lead["curve"]),
                                                                          default=None),
        "metric": "bits_per_byte" if text_model(cfg.model) else "accuracy",
        "train_s": lead["train_s"], "eval_s": lead["eval_s"], "wall_s": raw["wall_s"],
        "median_step_s": lead["median_step_s"],
        "step_end_s": lead["step_end_s"],  # rank 0's training clock at every step's end (race/links.py reads it)
        "compute_only_step_s": statistics.median(compute) if compute else None,
        "tiny_allreduce_s": statistics.median(tiny) if tiny else None,
        "peak_rss_bytes": [w["peak_rss_bytes"] for w in workers],
        "peak_anon_bytes": [w["peak_anon_bytes"] for w in workers],
        "peak_rss_training_only": all(w["peak_rss_resettable"] for w in workers),
        "allocator": sorted({w.get("allocator") or "not recorded" for w in workers}),
        "cuda_peak_bytes": max(cuda) if cuda else None,
        "wire_tx_bytes_per_step": statistics.mean(wire_tx) / steps if wire_tx else None,
        # what gradcomp's transport was handed (payload + control, no padding), as `gradcomp train` reports it
        "payload_up_bytes_per_step": (counter.get("up_payload", 0) + counter.get("up_control", 0)) / steps
        if method.is_gradcomp and counter else None,
        "replicas_identical": len({w["stats"]["digest"] for w in workers}) == 1,
        "num_parameters": num_parameters,
        # each worker's own clock of its exchange, per step (the mean over the run): compression is everything
        # outside collectives, communication the time inside them (waits for the other workers included); what
        # `gradcomp plan` predicts beside what the race's workers spent (docs/plan.md)
        "compress_s_per_step": [w["stats"].get("compress_s", 0.0) / steps for w in workers] if steps else None,
        "median_compress_s": [w.get("median_compress_s") for w in workers],  # per worker, in its median step
        "communicate_s_per_step": [w["stats"].get("communicate_s", 0.0) / steps for w in workers] if steps else None,
    }


def failed_record(method: Method, error: str | None) -> dict[str, Any]:
    return {"label": method.label, "spec": method.text, "kind": "torch" if method.baseline else "gradcomp",
            "name": method.name, "error": error, "curve": []}


def summarize(records: list[dict[str, Any]], target: float, num_parameters: int, rate_bps: float | None = None,
              setting: str = "", lower: bool = False) -> dict[str, Any]:
    """Time to target, ratios to fp32 DDP and to its communication-free ideal, memory flags; and, on a 100 Mbit/s
    link only (``rate_bps``), the targets at 100 Mbit/s, judged on ``setting`` (model, data, hosts, link)."""
    ok = [r for r in records if not r.get("error")]
    ref = next((r for r in ok if r["name"] == "torch-fp32"), None)
    notes: list[str] = []
    effective = target
    if ref is not None and first_reaching(ref["curve"], target, lower) is None and ref["best_accuracy"] is not None:
        effective = ref["best_accuracy"]
        what = (lambda v: f"{v:.4f} bits/byte") if lower else (lambda v: f"{100 * v:.2f} %")
        notes.append(
            f"fp32 DDP did not reach {what(target)} in {ref['steps']} steps; the race is timed to the best "
            f"{'loss' if lower else 'accuracy'} it reached, {what(effective)}"
        )
    for r in ok:
        reached = first_reaching(r["curve"], effective, lower)
        r["steps_to_target"], r["time_to_target_s"] = reached if reached else (None, None)
    grad_bytes = 4 * num_parameters
    ideal = None
    if ref is not None and ref["steps_to_target"] is not None and ref["compute_only_step_s"]:
        ideal = ref["steps_to_target"] * ref["compute_only_step_s"]
    for r in ok:
        t = r["time_to_target_s"]
        r["vs_fp32_ideal"] = t / ideal if t is not None and ideal else None
        r["vs_fp32_time"] = ref["time_to_target_s"] / t if ref and t and ref["time_to_target_s"] else None
        r["step_vs_fp32"] = r["median_step_s"] / ref["median_step_s"] if ref and ref["median_step_s"] else None
        # the resident set less library code (race_worker.MemoryPeaks), median over the workers: a worker's
        # peak varies by a few MB from run to run, which is about a gradient of the 1.2M-parameter model
        peak = statistics.median(r["peak_anon_bytes"])
        r["extra_memory_vs_ddp_grads"] = (
            (peak - statistics.median(ref["peak_anon_bytes"])) / grad_bytes if ref else None
        )
        # on CUDA the GPU's memory counts too: torch's allocator peak (the host's resident set then also holds
        # the CUDA context and pinned staging buffers)
        cuda, cuda_ref = r.get("cuda_peak_bytes"), ref.get("cuda_peak_bytes") if ref else None
        r["extra_cuda_vs_ddp_grads"] = (cuda - cuda_ref) / grad_bytes if cuda is not None and cuda_ref else None
        r["memory_flag"] = any((r[key] or 0) > MEMORY_FLAG for key in EXTRA_MEMORY)
    tiny = [r["tiny_allreduce_s"] for r in ok if r.get("tiny_allreduce_s")]
    hosts = len(ok[0]["peak_anon_bytes"]) if ok else 0  # one entry per worker
    return {
        "target": target, "lower_is_better": lower, "effective_target": effective, "fp32_ideal_s": ideal,
        # a ring all-reduce of one float is 2(W-1) messages in turn: the latency per message that gradcomp plan's
        # network model (--latency) takes, measured on this link
        "tiny_allreduce_s": statistics.median(tiny) if tiny else None,
        "message_latency_s": statistics.median(tiny) / (2 * (hosts - 1)) if tiny and hosts > 1 else None,
        "gradient_bytes": grad_bytes,
        "targets": check_targets(ok, ref, ideal, rate_bps) if rate_bps == TARGET_RATE_BPS else [],
        "targets_judged_on": setting if rate_bps == TARGET_RATE_BPS else None,
        "notes": notes,
    }


def _time_or_bound(r: dict[str, Any]) -> tuple[float, bool]:
    """Time to target, or (training time of the whole run, True) as a lower bound when it never got there."""
    if r["time_to_target_s"] is not None:
        return r["time_to_target_s"], False
    return r["train_s"], True


def check_targets(ok: list[dict[str, Any]], ref: dict[str, Any] | None, ideal: float | None,
                  rate_bps: float = TARGET_RATE_BPS) -> list[dict[str, Any]]:
    """The targets at 100 Mbit/s (``rate_bps``: the link's rate, which prices C_nat's bytes), evaluated on this
    race (each says met / not met / not measurable)."""
    out: list[dict[str, Any]] = []
    ours = [r for r in ok if r["kind"] == "gradcomp" and r["time_to_target_s"] is not None]
    best = min(ours, key=lambda r: r["time_to_target_s"]) if ours else None

    def add(goal: str, met: bool | None, detail: str) -> None:
        out.append({"goal": goal, "met": met, "detail": detail})

    if best is None:
        add("best gradcomp method reaches the target", False, "no gradcomp method reached the target")
        return out
    bt = best["time_to_target_s"]
    bound = TARGETS["vs_free_communication"]
    goal = f"best gradcomp ≤ {bound:g} × fp32 with free communication"
    if ideal:
        ratio = bt / ideal
        add(goal, ratio <= bound, f"{best['label']}: {_secs(bt)} s = {ratio:.2f} × ({ref['steps_to_target']} steps × "
            f"{_secs(ref['compute_only_step_s'])} s = {_secs(ideal)} s)")
    else:
        add(goal, None, "fp32 DDP did not run or did not reach the target")
    for name, aim in TARGETS["faster_than"].items():
        factor, goal = aim["factor"], f"≥ {aim['factor']:g} × faster than {aim['called']}"
        other = next((r for r in ok if r["name"] == name), None)
        if other is None:
            add(goal, None, f"{name} was not in the race")
            continue
        t, unfinished = _time_or_bound(other)
        speedup = t / bt
        if unfinished:
            met = True if speedup >= factor else None
            detail = (f"{name} did not reach the target in {_secs(t)} s of training: speed-up ≥ {speedup:.2f}"
                      + ("" if met else " (not enough to decide)"))
        else:
            met = speedup >= factor
            detail = f"{name} {_secs(t)} s / {best['label']} {_secs(bt)} s = {speedup:.2f}"
        add(goal, met, detail)
    # C_nat's step against its own limit in the same race: its compute-only step plus the bytes its host sent per
    # step (the interface's count) at the link's rate; the row sharded both ways if the race has it
    cnats = [r for r in ok if r["compressor"] == "cnat" and r["kind"] == "gradcomp"]
    cnat = next((r for r in cnats if r.get("topology") == "sharded" and r.get("server_compressor") == "cnat"),
                cnats[0] if cnats else None)
    bound = TARGETS["cnat_step_vs_limit"]
    goal = f"cnat step ≤ {bound:g} × its limit (compute-only step + wire bytes ÷ link rate)"
    if cnat is None:
        add(goal, None, "cnat was not in the race")
    elif not cnat.get("compute_only_step_s") or not cnat.get("wire_tx_bytes_per_step"):
        add(goal, None, f"{cnat['label']}: no compute-only step or no byte count of the interface (unshaped link?)")
    else:
        wire_s = 8 * cnat["wire_tx_bytes_per_step"] / rate_bps
        limit = cnat["compute_only_step_s"] + wire_s
        ratio = cnat["median_step_s"] / limit
        versus = f"; {cnat['median_step_s'] / ref['median_step_s']:.2f} × fp32 DDP's step" if ref else ""
        add(goal, ratio <= bound,
            f"{cnat['label']}: {_secs(cnat['median_step_s'])} s / ({_secs(cnat['compute_only_step_s'])} s + "
            f"{cnat['wire_tx_bytes_per_step'] / 1e6:.3g} MB at {rate_bps / 1e6:g} Mbit/s = {_secs(wire_s)} s; "
            f"limit {_secs(limit)} s) = {ratio:.2f}{versus}")
    return out


# -- the command ---------------------------------------------------------------------------------------------


def setting(opts: Options) -> str:
    """What a race ran: model, data, hosts, link, steps (the plot's title; what the targets were judged on)."""
    return (f"{opts.model} on {opts.dataset}, {opts.hosts} hosts, link {opts.link}, "
            f"{opts.steps} steps × {opts.batch_size}/host")


def burst_warning(record: dict[str, Any], rate_bps: float | None) -> str | None:
    """A warning when a method sent so little per host that tbf's burst (refilled while the clock is paused for
    evaluations, and full at the start) is a large part of it: its times are then shorter than the rate allows."""
    per_step = record.get("wire_tx_bytes_per_step")
    if rate_bps is None or per_step is None:
        return None
    total = per_step * record["steps"]
    if total >= BURST_FACTOR * netns.TBF_BURST_BYTES:
        return None
    return (f"{record['label']}: each host sent {total / 1e6:.3g} MB in the whole run, less than {BURST_FACTOR} × "
            f"tbf's burst ({netns.TBF_BURST}), which refills while the clock is paused for evaluations; at so few "
            "bytes the link looks faster than its rate (more steps, or fewer evaluations, docs/race.md)")


def remove_workdirs(tag: str) -> list[str]:
    """The work directories (``<tmp>/gradcomp-race-<tag>-*``) that run ``tag``, or every run (``all``), left."""
    pattern = "gc*" if tag == "all" else tag
    found = glob.glob(os.path.join(tempfile.gettempdir(), f"gradcomp-race-{pattern}-*"))
    removed = []
    for path in sorted(found):
        name = os.path.basename(path)
        if os.path.isdir(path) and re.match(r"^gradcomp-race-gc\d+-", name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@dataclass
class _RaceSoFar:
    """A race's finished methods (their records and warnings) and what its result says around them: written after
    every method, so that an interrupted race keeps its finished rows, and once more at the end."""

    opts: Options
    network: Any
    num_parameters: int
    rate: float | None  # the link's rate in bit/s; None unshaped
    title: str
    started: float
    machine: dict[str, Any]  # at the start; the load average is read again at each write
    code_start: Any  # each worker imports the source when it starts: the end's version notes a change meanwhile
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def result(self, complete: bool) -> dict[str, Any]:
        """The result dict; ``complete`` False: written after a method, the race not finished (or interrupted)."""
        opts, network = self.opts, self.network
        summary = summarize(self.records, goal(opts), self.num_parameters, self.rate, self.title, lower=is_text(opts))
        summary["notes"] += self.warnings
        result = {
            "command": "gradcomp race",
            "complete": complete,
            "options": {**{k: v for k, v in dataclasses.asdict(opts).items() if k != "methods"},
                        "methods": [m.text for m in opts.methods]},
            "methods": self.records,
            "summary": summary,
            "network": {"kind": network.kind, "hosts": len(network.hosts), "link": opts.link,
                        "rate_bps": self.rate, "tbf_burst": netns.TBF_BURST,
                        "tbf_latency": netns.TBF_LATENCY, "tag": network.tag},
            "machine": {**self.machine, "load_average_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
            "code": {"start": self.code_start, "end": code_version() if complete else None},
            "started": self.started,
            "wall_s": time.time() - self.started,
        }
        result["table"] = render_table(self.records, summary)
        return result

    def save(self, log, state: dict[str, Any]) -> None:
        """race.json and race.md of the methods finished so far, with ``--out``; ``state["saved"]``: how many.

        A failed write is logged, not raised: the race goes on, and the end's write says it again.
        """
        if not self.opts.out:
            return
        try:
            write_outputs(self.opts.out, self.result(False), self.title, log, plot=False)
            state["saved"] = len(self.records)
        except OSError as exc:
            log(f"gradcomp race: could not save the finished methods in {self.opts.out}: {exc}")


@contextlib.contextmanager
def _interrupted_by_signals():
    """SIGTERM and SIGHUP raise ``Interrupted`` in the main thread while the race runs, so that every ``finally``
    (the network taken down, the work folder removed) runs; the previous handlers are back afterwards."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def interrupted(signum, frame):
        raise Interrupted(f"signal {signum}")

    for sig in previous:
        signal.signal(sig, interrupted)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _announce(network, opts: Options, workdir: str, log) -> None:
    """Where the race runs, and how to remove what a hard kill leaves of its namespaces."""
    if network.tag:
        where = f"{len(network.hosts)} hosts in namespaces (run {network.tag}), link {opts.link}"
    else:
        where = f"{len(network.hosts)} local processes, unshaped"
    log(f"gradcomp race: {where}; {len(opts.methods)} methods × {opts.steps} steps")
    if network.tag:
        log(f"gradcomp race: if this process is killed hard, remove what is left (namespaces and "
            f"{workdir}) with `gradcomp race --cleanup {network.tag}`")


def _run_methods(so_far: _RaceSoFar, configs: list[Any], workdir: str, log, state: dict[str, Any]) -> None:
    """Every method in turn on the network that is up, its record kept (a failed one where a worker failed) and
    the files saved after each."""
    opts = so_far.opts
    for i, (method, cfg) in enumerate(zip(opts.methods, configs)):
        log(f"[{i + 1}/{len(configs)}] {method.label}")
        try:
            raw = run_method(so_far.network, method, cfg, opts, workdir, i, log)
        except WorkerFailedError as exc:
            log(f"gradcomp race: {exc}")
            so_far.records.append(failed_record(method, str(exc)))
            so_far.save(log, state)
            continue
        record = method_record(method, cfg, raw, so_far.num_parameters)
        so_far.records.append(record)
        warning = _report_method(record, opts, so_far.rate, log)
        if warning:
            so_far.warnings.append(warning)
        so_far.save(log, state)


def _report_method(record: dict[str, Any], opts: Options, rate: float | None, log) -> str | None:
    """One finished method's line (its step times, final accuracy or loss, when it reached the target); returns
    the warning of a link it sent too few bursts over to be shaped as set (logged too), or None."""
    reached = first_reaching(record["curve"], goal(opts), is_text(opts))
    text = is_text(opts)
    what = (lambda v: f"{v:.4f} bits/byte") if text else (lambda v: f"{100 * v:.2f} %")
    log(f"    median step {record['median_step_s']:.3f} s, compute-only "
        f"{record['compute_only_step_s'] or float('nan'):.3f} s, final "
        f"{'validation loss' if text else 'accuracy'} {what(record['final_accuracy'] or 0)}, "
        + (f"{what(goal(opts))} at step {reached[0]} ({reached[1]:.1f} s)" if reached
           else f"{what(goal(opts))} not reached"))
    warning = burst_warning(record, rate)
    if warning:
        log(f"gradcomp race: warning: {warning}")
    return warning


def race(opts: Options, log=print, show=None, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every method; returns the result dict (also written to ``opts.out``).

    ``--out`` is checked (a file written there) before the network is made. race.json and race.md are written
    after every finished method, so an interrupted race keeps its finished rows; ``show(table)``, if given, is
    called before the final files are written. ``state`` receives ``network`` (once made) and ``saved`` (how
    many methods the files hold), for the caller's message on an interruption.
    """
    state = {} if state is None else state
    configs, num_parameters = plan(opts, log)
    network = make_network(opts, log)  # creates nothing yet; refuses a shaped link it cannot have here
    if opts.out:
        make_output_dir(opts.out, "--out", "; nothing was started")
    state["network"] = network
    rate = link_rate(opts.link)
    title = setting(opts)
    started = time.time()
    so_far = _RaceSoFar(opts, network, num_parameters, rate, title, started, machine(), code_version())
    with _interrupted_by_signals():
        with tempfile.TemporaryDirectory(prefix=f"gradcomp-race-{network.tag or 'local'}-") as workdir:
            try:
                network.up()
                _announce(network, opts, workdir, log)
                _run_methods(so_far, configs, workdir, log, state)
            finally:
                network.down()  # SIGINT, SIGTERM and SIGHUP wait until it is done (netns.signals_held)
    result = so_far.result(True)
    if show is not None:
        show(result["table"])  # before the files: a failed write loses nothing printed
    if opts.out:
        try:
            write_outputs(opts.out, result, title, log)
        except OSError as exc:
            raise GradcompError(f"--out {opts.out}: could not write the results ({exc})"
                                + ("; the table was printed above" if show is not None else "")) from None
    return result
