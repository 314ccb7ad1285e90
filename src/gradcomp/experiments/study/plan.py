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
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradcomp.errors import ConfigError
from gradcomp.experiments.race import race
from gradcomp.experiments.race.method import Method, planned
from gradcomp.experiments.study import phases as phased
from gradcomp.experiments.study import pilot
from gradcomp.experiments.study.pilot import pilot_steps
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
FP32 = "none"
WARMUP_STEPS = 2
TIMED_STEPS = 8  # a colocated timing of 3 steps was not repeatable between two plans of the same code
COMPUTE_REPEATS = 5
CACHE_FORMAT = 7  # bump when a measure_* function below changes what it measures
SMALL_MARGIN = 0.05  # a recommendation that saves less than this fraction of fp32's step says so


# -- input ---------------------------------------------------------------------------------------------------


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
        phased.check(methods, self.steps)
        return network, methods


# -- measuring -----------------------------------------------------------------------------------------------


def machine_identity(device: str) -> dict[str, Any]:
    """What a cached measurement is only valid for: this processor (or GPU), the versions, the thread count."""
    import gradcomp
    from gradcomp.experiments.run.report import cpu_model

    return {
        "cpu": cpu_model() or platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "torch": torch.__version__,
        "gradcomp": gradcomp.__version__,
        "gradcomp_source": _source_digest(),
        "threads": torch.get_num_threads(),
    }


_SOURCE_DIGEST: str | None = None


def _source_digest() -> str:
    """A digest of gradcomp's Python source: an edited compressor is a new version for the cache."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        root = Path(__file__).resolve().parents[2]  # the gradcomp package
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            if path.name == "plan.py":
                continue  # the planner's own code: its measuring loop is versioned by CACHE_FORMAT instead
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _SOURCE_DIGEST = h.hexdigest()[:16]
    return _SOURCE_DIGEST


class Cache:
    """JSON files under ``~/.cache/gradcomp/plan`` (or ``GRADCOMP_CACHE_DIR``/plan), one per measurement."""

    def __init__(self, directory: str | None = None, enabled: bool = True):
        base = directory or os.environ.get("GRADCOMP_CACHE_DIR") or os.path.join(Path.home(), ".cache", "gradcomp")
        self.directory = Path(base) / "plan"
        self.enabled = enabled
        self.hits = 0
        self.misses = 0

    def _path(self, key: dict[str, Any]) -> Path:
        name = hashlib.sha256(json.dumps({"format": CACHE_FORMAT, **key}, sort_keys=True).encode()).hexdigest()
        return self.directory / f"{name[:32]}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The stored value (a hit), or None (a miss: the caller measures and ``put``s it)."""
        path = self._path(key)
        if self.enabled and path.is_file():
            try:
                stored = json.loads(path.read_text())
                if stored.get("key") == key:
                    self.hits += 1
                    return stored["value"]
            except (OSError, json.JSONDecodeError, AttributeError):
                pass  # unreadable: measured again and overwritten
        self.misses += 1
        return None

    def put(self, key: dict[str, Any], value: dict[str, Any]) -> None:
        if not self.enabled:
            return
        path = self._path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "value": value}))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: the plan still works, uncached

    def get_or_measure(self, key: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        value = self.get(key)
        if value is None:
            value = measure()
            self.put(key, value)
        return value


def ddp_buckets(shapes: Sequence[tuple[int, ...]], bucket_cap_mb: float | None = None) -> list[list[int]]:
    """The DDP buckets of parameters of these shapes, as indices, in the order the communication hook gets them.

    DDP puts every parameter in one bucket for its first iteration and then rebuilds the buckets from the order
    the gradients became ready (C++ ``Reducer``): a first bucket of at most ``dist._DEFAULT_FIRST_BUCKET_BYTES``
    (1 MiB), then buckets of at most ``bucket_cap_mb`` (25 MiB by default; with ``bucket_cap_mb`` given the first
    bucket takes that cap too). The ready order is taken as the reverse of the parameters' order (backward
    reaches the last layer first), and the assignment is torch's own ``_compute_bucket_assignment_by_size`` on
    meta tensors of these shapes, so no memory is allocated for a large model.
    """
    import torch.distributed as dist

    order = list(reversed(range(len(shapes))))
    cap = int((25.0 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    tensors = [torch.empty(shapes[i], device="meta") for i in order]
    assigned, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap])
    return [[order[j] for j in bucket] for bucket in assigned]


def random_gradients(shapes: Sequence[tuple[int, ...]], gen: torch.Generator,
                     device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """One step's gradients: standard normal times a per-tensor scale drawn from a log-normal (times 1e-3)."""
    grads = []
    for shape in shapes:
        scale = math.exp(float(torch.randn((), generator=gen)))
        grads.append((torch.randn(shape, generator=gen) * (1e-3 * scale)).to(device))
    return grads


def measure_method(
    method: Method, shapes: Sequence[tuple[int, ...]], workers: int, device: str = "cpu", seed: int = 0,
    warmup: int = WARMUP_STEPS, timed: int = TIMED_STEPS,
) -> dict[str, Any]:
    """Real steps of ``method`` on a simulated cluster of ``workers`` with these shapes and random gradients.

    Returns, for each timed step, each worker's counted traffic (the ByteCounter's bytes and per-collective
    ``ops``) and its ``compress_s``. Gradients are standard normal times a per-tensor scale drawn from a
    log-normal, seeded per worker and step, so workers differ as real workers' gradients do.

    The step runs the way the method would be run in training. With ``method.ddp`` (the default, and how
    ``gradcomp race`` runs every gradcomp method) it is the DDP communication hook's work, bucket by bucket
    (``ddp_buckets``): per bucket the hook's finiteness check, one ``GradientExchange.exchange`` of the
    bucket's slots with the hook's ``min_compression_rate`` (a small tensor that would not compress travels in a
    dense all-reduce), the copy of the averages back into the bucket, and the scheme told at the last bucket
    which slots the pass held, with the ranks' agreement on refused messages (``settle``: one 4-byte all-reduce per
    pass of a method that sends containers); for ``none``, ``fp16`` and ``bf16`` the hook's own all-reduce of the
    bucket buffer (in place, or of its cast; divided by W, its finiteness folded into the first entry and read
    back), with no exchange. A multi-round
    method (PowerSGD) then runs its rounds once per bucket, and a variable-size one (SBC) its size round once
    per bucket, as in the race. What the hook does on top, handing each bucket to its communication thread
    while backward runs, is not in this measurement. With
    ``ddp`` off it is ``GradientAggregator.aggregate``: one exchange of every parameter after backward.
    ``compress_s`` is everything the step does outside collectives.
    """
    from gradcomp.compressors.base import Slot
    from gradcomp.finite import finite_flags
    from gradcomp.train.aggregator import GradientAggregator
    from gradcomp.train.ddp_hook import DEFAULT_MIN_COMPRESSION_RATE, direct_message, sends_directly
    from gradcomp.train.exchange import GradientExchange, settle
    from gradcomp.transport.sim import SimulatedCluster
    from gradcomp.wire.refusals import Refusals

    dev = torch.device(device)
    cfg = method.config()
    buckets = ddp_buckets(shapes, method.bucket_cap_mb) if method.ddp else None

    def worker(transport) -> list[dict[str, Any]]:
        compressor, server = cfg.build_compressors()
        params = [torch.nn.Parameter(torch.zeros(shape, device=dev)) for shape in shapes]
        named = [(f"p{i}", p) for i, p in enumerate(params)]
        if buckets is None:
            aggregator = GradientAggregator(named, compressor, transport, granularity=method.granularity,
                                            topology=method.topology, server_compressor=server)
            exchange = aggregator.exchange

            def one_step(grads: list[torch.Tensor], step: int) -> float:
                aggregator.aggregate(grads)
                return 0.0
        else:
            exchange = GradientExchange(compressor, transport, topology=method.topology, server_compressor=server,
                                        min_compression_rate=DEFAULT_MIN_COMPRESSION_RATE)
            slots = GradientAggregator.slots_for(named, "layer")
            direct = sends_directly(exchange.scheme)

            def one_step(grads: list[torch.Tensor], step: int) -> float:
                outside, seen = 0.0, []
                if direct:  # the hook's own all-reduce of the bucket buffer (CompressionHookState._direct)
                    cast = exchange.scheme.compressor
                    for indices in buckets:
                        flat = torch.cat([grads[i].reshape(-1) for i in indices])  # DDP's bucket buffer
                        started, blocked = time.perf_counter(), transport.counter.seconds + transport.idle_seconds()
                        message, _ = direct_message(flat, cast, transport.world_size)
                        transport.all_reduce_sum(message, inplace=True)
                        math.isfinite(float(message[0]))
                        if message is not flat:
                            flat.copy_(message)
                        waited = transport.counter.seconds + transport.idle_seconds() - blocked
                        outside += time.perf_counter() - started - waited  # the all-reduce is communication
                    return outside
                refusals = Refusals()
                for b, indices in enumerate(buckets):
                    if method.granularity == "bucket":  # DDP's bucket buffer, one slot (made off the clock)
                        tensors = [torch.cat([grads[i].reshape(-1) for i in indices])]
                        names = ",".join(f"p{i}" for i in indices)
                        bucket_slots = [Slot(f"bucket{b}:{names}", b, tensors[0].numel())]
                    else:
                        tensors, bucket_slots = [grads[i] for i in indices], [slots[i] for i in indices]
                    started = time.perf_counter()
                    finite = all(finite_flags(tensors))
                    outside += time.perf_counter() - started
                    averages = exchange.exchange(bucket_slots, tensors, step, validate=False, finite=finite,
                                                 refusals=refusals)
                    started = time.perf_counter()
                    for target, average in zip(tensors, averages):
                        target.copy_(average.view_as(target))
                    seen += bucket_slots
                    if b == len(buckets) - 1:
                        exchange.scheme.retain(seen)
                        outside += time.perf_counter() - started
                        settle(transport, refusals, dev, step=step)  # (its all-reduce is communication)
                        started = time.perf_counter()
                    outside += time.perf_counter() - started
                return outside

        gen = torch.Generator().manual_seed(seed * 1_000_003 + transport.rank)
        steps = []
        for step in range(warmup + timed):
            grads = random_gradients(shapes, gen, dev)
            before, compress_before = transport.counter.snapshot(), exchange.compress_s
            outside = one_step(grads, step)
            if step >= warmup:
                after = transport.counter
                steps.append({
                    "compress_s": exchange.compress_s - compress_before + outside,
                    "bytes_up": after.bytes_up - before.bytes_up,
                    "bytes_down": after.bytes_down - before.bytes_down,
                    "ops": {op: [calls - before.ops.get(op, [0, 0])[0], nbytes - before.ops.get(op, [0, 0])[1]]
                            for op, (calls, nbytes) in after.ops.items()},
                })
        return steps

    with SimulatedCluster(workers) as cluster:
        per_worker = cluster.run(worker)
    return {"workers": per_worker}


def measure_torch_powersgd(method: Method, shapes: Sequence[tuple[int, ...]], workers: int, seed: int = 0,
                           warmup: int = WARMUP_STEPS, timed: int = TIMED_STEPS) -> dict[str, Any]:
    """torch's ``powerSGD_hook`` (``gradcomp race``'s ``torch-powersgd``), measured as ``measure_method`` measures
    a gradcomp method: DDP with the hook, one bucket as the race runs it, on a gloo group of this one process, and
    parameters of these shapes whose gradients are seeded random values. Every ``all_reduce`` the hook issues is
    recorded (calls and bytes: torch's messages, whatever its rules for which tensors it compresses and at what
    rank), in the timed steps after its ``start_iter`` (before it, the hook sends plain fp32). An all-reduce's
    sizes do not depend on the world size, so each of ``workers`` gets the same record. ``compress_s``: the
    backward with the hook less the same backward with DDP's own allreduce, the median over the timed steps
    (torch's hook is not timed apart). Run it in a process of its own (``colocated(..., spawn=True)``)."""
    import tempfile

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp.experiments.race.torch_baselines import torch_hook_registrar

    class Grads(torch.nn.Module):  # loss = sum(p * g): the gradient of p is g
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(shape)) for shape in shapes)

        def forward(self, gs):
            return sum((p * g).sum() for p, g in zip(self.ps, gs))

    numel = sum(math.prod(s) for s in shapes)
    cap = method.config(num_parameters=numel).bucket_cap_mb
    start = method.params["start_iter"]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            plain, hooked = (DistributedDataParallel(Grads(), bucket_cap_mb=cap) for _ in range(2))
            torch_hook_registrar(method.baseline, method.params)(hooked, None)
            gen = torch.Generator().manual_seed(seed)
            record: list[int] = []
            reduce = dist.all_reduce

            def recording(tensor, *args, **kwargs):
                record.append(tensor.numel() * tensor.element_size())
                return reduce(tensor, *args, **kwargs)

            dist.all_reduce = recording
            steps = []
            try:
                for step in range(start + warmup + timed):
                    gs = random_gradients(shapes, gen)
                    seconds = []
                    for model in (plain, hooked):
                        record.clear()
                        started = time.perf_counter()
                        model(gs).backward()
                        seconds.append(time.perf_counter() - started)
                    if step >= start + warmup:
                        nbytes = sum(record)
                        steps.append({"compress_s": max(0.0, seconds[1] - seconds[0]), "bytes_up": nbytes,
                                      "bytes_down": nbytes, "ops": {"all_reduce": [len(record), nbytes]}})
            finally:
                dist.all_reduce = reduce
        finally:
            dist.destroy_process_group()
    return {"workers": [steps] * workers}


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


def colocated(measure: Callable[..., dict[str, Any]], n: int, *args: Any,
              spawn: bool = False) -> list[dict[str, Any]]:
    """``measure(*args)`` in ``n`` processes at once: what it costs when ``n`` workers share this machine's cores.

    On a real cluster each worker has its machine to itself; where ``n`` workers share one (``gradcomp race``'s
    emulated hosts, several ranks per node) they compress at the same time on the same cores, and one worker's
    compression takes longer than the same work timed alone with every core. Each process gets the torch threads
    a spawned worker of ``n`` gets (``runner.worker_threads``), and a barrier releases them together, so the
    timings include exactly that contention. Returns the ``n`` results. ``spawn``: a process even for ``n`` = 1
    (a measurement that makes its own process group).
    """
    if n == 1 and not spawn:
        return [measure(*args)]
    import multiprocessing
    import queue

    from gradcomp.experiments.run.runner import worker_threads

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_colocated_worker, args=(barrier, results, worker_threads(n), measure, args),
                         daemon=True) for _ in range(n)]
    try:
        for proc in procs:
            proc.start()
        out: list[dict[str, Any]] = []
        waited_for_the_cause = []  # the others' failures at the barrier a failed process broke
        while len(out) + len(waited_for_the_cause) < n:
            try:
                ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a colocated measuring process died (exit code {dead[0]})") from None
                continue
            if not ok and "BrokenBarrierError" in value:
                waited_for_the_cause.append(value)  # the process that broke it reports why
            elif not ok:
                raise RuntimeError(f"a colocated measuring process failed:\n{value}")
            else:
                out.append(value)
        if waited_for_the_cause:
            raise RuntimeError(f"a colocated measuring process failed:\n{waited_for_the_cause[0]}")
        return out
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()


def _colocated_worker(barrier, results, threads: int, measure: Callable[..., dict[str, Any]], args: tuple) -> None:
    import traceback

    released = False
    try:
        torch.set_num_threads(threads)
        barrier.wait(timeout=600)
        released = True
        results.put((True, measure(*args)))
    except BaseException:  # the parent raises it with the traceback
        if not released:  # the others wait for this one at the barrier; once past it, they are on their way
            barrier.abort()
        results.put((False, traceback.format_exc()))


def merge_colocated(measurements: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``measure_method`` result from colocated copies: the traffic is the same in each (seeded), and each
    worker's per-step compression time is the median over the copies."""
    first = measurements[0]
    workers = []
    for rank, steps in enumerate(first["workers"]):
        workers.append([{**step, "compress_s": statistics.median(m["workers"][rank][i]["compress_s"]
                                                                  for m in measurements)}
                        for i, step in enumerate(steps)])
    return {**first, "workers": workers, "colocated": len(measurements)}


def measure_compute(model: str, dataset: str, data_root: str | None, batch_size: int, device: str,
                    seed: int = 0, repeats: int = COMPUTE_REPEATS) -> dict[str, Any]:
    """Forward + backward of ``model`` on one batch of ``dataset`` (median of ``repeats`` after one warm-up)."""
    from gradcomp.experiments.run.data import load_dataset
    from gradcomp.experiments.run.models import build_model
    from gradcomp.experiments.run.runner import compute_gradients

    data = load_dataset(dataset, data_root)
    net = build_model(model, data, seed).to(device)
    xb, yb = data.train_x[:batch_size].to(device), data.train_y[:batch_size].to(device)
    times = []
    for i in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        compute_gradients(net, xb, yb)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - started)
    return {"compute_s": statistics.median(times), "repeats": repeats, "threads": torch.get_num_threads()}


BYTES_PER_ENTRY_PER_WORKER = 24  # a simulated worker's parameter, gradient, residual, aggregate, message, decoding


def check_memory(numel: int, workers: int, device: str) -> None:
    """ConfigError before measuring when W simulated workers of this model would not fit in half the host's free
    memory (each holds about :data:`BYTES_PER_ENTRY_PER_WORKER` bytes per parameter)."""
    if device != "cpu":
        return
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return  # unknown: try
    need = numel * workers * BYTES_PER_ENTRY_PER_WORKER
    if need > available / 2:
        raise ConfigError(
            f"measuring {workers} simulated workers of {numel:,} parameters needs about {need / 1e9:.1f} GB, more "
            f"than half of the {available / 1e9:.1f} GB free here: plan fewer workers, or measure at two small W "
            "and extrapolate (scripts/plan_extrapolate.py, plan.fit_in_workers)"
        )


def model_shapes(model: str, dataset: str, data_root: str | None, seed: int = 0) -> list[tuple[int, ...]]:
    """The shapes of the trainable parameters of ``model`` built for ``dataset``; ConfigError for an unknown name."""
    from gradcomp.experiments.run.data import load_dataset
    from gradcomp.experiments.run.models import build_model

    net = build_model(model, load_dataset(dataset, data_root), seed)
    return [tuple(p.shape) for p in net.parameters() if p.requires_grad]


# -- pricing -------------------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """One method's measured step: what the slowest worker spends compressing, and every worker's collectives."""

    compress_s: float
    ops_by_worker: list[dict[str, list[float]]]  # per worker: op -> [calls, bytes] of one step
    bits_up: float  # per worker, mean over workers and steps
    bits_down: float

    @classmethod
    def from_measurement(cls, measured: dict[str, Any]) -> Traffic:
        workers = measured["workers"]
        compress = max(statistics.median(s["compress_s"] for s in steps) for steps in workers)
        ops_by_worker = []
        for steps in workers:
            ops: dict[str, list[float]] = {}
            for s in steps:
                for op, (calls, nbytes) in s["ops"].items():
                    acc = ops.setdefault(op, [0.0, 0.0])
                    acc[0] += calls / len(steps)
                    acc[1] += nbytes / len(steps)
            ops_by_worker.append(ops)
        every = [s for steps in workers for s in steps]
        return cls(
            compress_s=compress,
            ops_by_worker=ops_by_worker,
            bits_up=8 * statistics.fmean(s["bytes_up"] for s in every),
            bits_down=8 * statistics.fmean(s["bytes_down"] for s in every),
        )


def communication_seconds(traffic: Traffic, network: NetworkModel, workers: int) -> float:
    """The slowest worker's priced collectives of one step (the step waits for it), the link's burst credited."""
    return max(network.step_seconds(ops, workers) for ops in traffic.ops_by_worker)


@dataclass
class PlanRow:
    label: str
    method: str
    compute_s: float
    compress_s: float
    communicate_s: float
    bits_up: float
    bits_down: float
    calls: dict[str, float]
    note: str = ""
    priced_s: float = 0.0  # the network model's price of the step's collectives
    local_collectives_s: float | None = None  # the local race's time in collectives (measure_local), if measured
    phases: list[dict[str, Any]] | None = None  # a phased method's phases (study/phases.py): the step is their mean

    @property
    def step_s(self) -> float:
        return self.compute_s + self.compress_s + self.communicate_s

    def seconds_for(self, steps: float) -> float:
        """Predicted seconds of the run's first ``steps`` steps: phase by phase for a phased method (its last
        phase's step beyond the run), the step times ``steps`` for the others."""
        if not self.phases:
            return self.step_s * steps
        total = sum(max(0.0, min(steps, p["stop"]) - p["start"]) * p["step_s"] for p in self.phases)
        return total + max(0.0, steps - self.phases[-1]["stop"]) * self.phases[-1]["step_s"]

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "step_s": self.step_s,
                "communicate_share": self.communicate_s / self.step_s if self.step_s else 0.0,
                "compress_share": self.compress_s / self.step_s if self.step_s else 0.0}


def price(label: str, method: str, traffic: Traffic, network: NetworkModel, workers: int, compute_s: float,
          note: str = "", local: dict[str, float] | None = None) -> PlanRow:
    """The predicted step: compute + compression + communication, the collectives priced by the network model.

    With ``local`` (``measure_local``: the same method's step with every worker on this machine and an unshaped
    network) compression is the local race's, and communication the longer of the priced collectives and the
    local race's time in collectives (its step less compute and compression): where the workers share the cores,
    a collective waits for the last worker to arrive whatever the link, and that wait overlaps the wire time
    instead of adding to it."""
    calls = {op: n for op, (n, _) in traffic.ops_by_worker[0].items()}
    priced = communication_seconds(traffic, network, workers)
    if local is None:
        return PlanRow(label, method, compute_s, traffic.compress_s, priced, traffic.bits_up, traffic.bits_down,
                       calls, note, priced)
    waited = max(0.0, local["step_s"] - local["compute_s"] - local["compress_s"])
    return PlanRow(label, method, compute_s, local["compress_s"], max(priced, waited), traffic.bits_up,
                   traffic.bits_down, calls, note, priced, waited)


def recommend(rows: Sequence[PlanRow]) -> str:
    """One sentence: the fastest method, and how it compares with uncompressed fp32."""
    best = min(rows, key=lambda r: r.step_s)
    fp32 = next((r for r in rows if r.method == FP32), None)
    if fp32 is None:
        return f"fastest: {best.label} ({1e3 * best.step_s:.1f} ms per step; fp32 was not planned)"
    if best is fp32 or best.step_s >= fp32.step_s:
        runner_up = min((r for r in rows if r is not fp32), key=lambda r: r.step_s, default=None)
        behind = f"; the best compressed method, {runner_up.label}, takes {runner_up.step_s / fp32.step_s:.2f} x " \
                 "its step" if runner_up else ""
        return f"uncompressed fp32 is fastest here ({1e3 * fp32.step_s:.1f} ms per step){behind}"
    text = (f"use {best.label}: {1e3 * best.step_s:.1f} ms per step, {best.step_s / fp32.step_s:.2f} x "
            f"uncompressed fp32's {1e3 * fp32.step_s:.1f} ms")
    if best.step_s > (1 - SMALL_MARGIN) * fp32.step_s:
        text += (f"; a margin under {100 * SMALL_MARGIN:g} % of the step, less than timings move on a busy machine: "
                 "compression hardly pays here")
    return text


# -- beyond the measured W (scripts/plan_extrapolate.py) -----------------------------------------------------


@dataclass
class Fitted:
    """A method's step fitted over W from measurements at two world sizes: per collective the calls per step and
    bytes per call a + b / W (b = 0 for per-worker messages of a fixed size; a = 0 for shards of a fixed total),
    and compression time c + d · W (d > 0 where each worker decodes every worker's message)."""

    ops: dict[str, tuple[float, float, float]]  # op -> (calls, a, b)
    compress: tuple[float, float]  # (c, d)

    def bytes_per_call(self, op: str, workers: int) -> float:
        _, a, b = self.ops[op]
        return max(0.0, a + b / workers)

    def compress_s(self, workers: int) -> float:
        c, d = self.compress
        return max(0.0, c + d * workers)

    def communication_s(self, network: NetworkModel, workers: int) -> float:
        return sum(calls * network.call_seconds(op, self.bytes_per_call(op, workers), workers)
                   for op, (calls, _, _) in self.ops.items() if calls)


def fit_in_workers(traffic: dict[int, Traffic], scale: float = 1.0) -> Fitted:
    """Fit a method's measurements at two world sizes (``{W: Traffic}``); ``scale`` multiplies bytes and time
    (a model measured on a part of its tensors). The calls per step are the larger W's. Compression grows with W
    only for methods that gather every worker's whole message (each worker decodes W); for the others it is
    taken as constant, so that noise between two timings is not extrapolated to W = 256."""
    (w1, t1), (w2, t2) = sorted(traffic.items())
    ops = {}
    for op in set(t1.ops_by_worker[0]) | set(t2.ops_by_worker[0]):
        c1, n1 = t1.ops_by_worker[0].get(op, [0, 0])
        c2, n2 = t2.ops_by_worker[0].get(op, [0, 0])
        per1, per2 = (n1 / c1 if c1 else 0.0), (n2 / c2 if c2 else 0.0)
        b = (per1 - per2) / (1 / w1 - 1 / w2)
        ops[op] = (float(c2), (per1 - b / w1) * scale, b * scale)
    gathers = ops.get("all_gather", (0.0, 0.0, 0.0))
    if gathers[0] and gathers[1] > abs(gathers[2]):
        # every worker's message gathered whole (not a shard): each worker decodes W of them, a cost that grows
        # with W; fitted through both points
        d = max(0.0, (t2.compress_s - t1.compress_s) / (w2 - w1))
        c = t2.compress_s - d * w2
    else:
        # all-reduce, sharded, parameter server: the per-worker work does not grow with W; the smaller of the two
        # timings (the less disturbed by other work on the machine) stands for both
        d, c = 0.0, min(t1.compress_s, t2.compress_s)
    return Fitted(ops, (c * scale, d * scale))


# -- the planner ---------------------------------------------------------------------------------------------


def run_plan(opts: PlanOptions, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Check everything, measure (or read the cache), price; returns the plan as a dict (``--json``)."""
    network, methods = opts.checked()
    if opts.batch_size is None:
        from gradcomp.experiments.run.runner import TRANSFORMER_DEFAULTS

        text = race.text_model(opts.model or "")
        opts = dataclasses.replace(opts, batch_size=TRANSFORMER_DEFAULTS["batch_size"] if text else 32)
    if opts.model is not None:
        shapes = model_shapes(opts.model, opts.dataset, opts.data_root, opts.seed)  # unknown model: ConfigError
        source = f"model {opts.model} on {opts.dataset}"
    else:
        shapes = list(opts.shapes)  # type: ignore[arg-type]
        source = f"shapes from {opts.shapes_source or 'a list'}"
    check_memory(sum(math.prod(s) for s in shapes), opts.workers, opts.device)
    cache = Cache(opts.cache_dir, opts.cache)
    machine = machine_identity(opts.device)
    shape_key = [list(s) for s in shapes]
    # every worker on this machine (gradcomp race's emulated hosts): the local race measures each method's step
    local_race = opts.model is not None and opts.colocated > 1 and opts.colocated == opts.workers
    # what is measured: every plain method, and each phase's exchange of a phased one (study/phases.py)
    split = {m.label: phased.phases(m, opts.steps) for m in methods}
    units = [p.method for m in methods for p in (split[m.label] or [])] + [m for m in methods if not split[m.label]]
    sharing = opts.colocated if opts.colocated > 1 and not local_race else 1  # parts timed n processes at once
    local: dict[str, dict[str, float]] = {}
    if local_race:
        def local_key(m: Method) -> dict[str, Any]:
            return {"what": "local", "machine": machine, "model": opts.model, "dataset": opts.dataset,
                    "batch_size": opts.batch_size, "device": opts.device, "seed": opts.seed,
                    "workers": opts.workers, "method": m.key(), "steps": [LOCAL_STEPS, LOCAL_COMPUTE_STEPS]}

        local = {m.label: v for m in units if (v := cache.get(local_key(m))) is not None}
        todo = [m for m in units if m.label not in local]
        if todo:
            log(f"measuring {len(todo)} methods' steps with {opts.workers} workers on this machine, unshaped "
                f"(gradcomp race --link none, {LOCAL_STEPS} steps each)")
            measured = measure_local(opts, todo, log)
            for m in todo:
                cache.put(local_key(m), measured[m.label])
            local.update(measured)
    if opts.compute_ms is not None:
        compute_s, compute_from = opts.compute_ms / 1e3, "--compute-ms"
    elif local_race:
        compute_s = statistics.median(v["compute_s"] for v in local.values())
        compute_from = (f"measured per method in the local race: forward, backward and SGD, {opts.workers} workers "
                        f"at once, batch {opts.batch_size}; the median")
    elif opts.model is not None:
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
    else:
        compute_s, compute_from = 0.0, "not included (--shapes without --compute-ms)"
    if opts.pilots and opts.model is not None:
        pilot_steps(opts.model, opts.pilot_steps)  # a bad --pilot-steps: ConfigError before any measurement
    priced: dict[str, PlanRow] = {}
    for method in units:
        log(f"measuring {method.label} on {opts.workers} simulated workers")
        key = {"what": "method", "machine": machine, "shapes": shape_key, "workers": opts.workers,
               "device": opts.device, "seed": opts.seed, "method": method.key(),
               "steps": [WARMUP_STEPS, TIMED_STEPS]}
        if sharing > 1:
            key["colocated"] = sharing
        if method.baseline == "torch-powersgd":  # torch's own hook: its all-reduces recorded, in a process
            measured = cache.get_or_measure(key, lambda m=method: merge_colocated(colocated(
                measure_torch_powersgd, sharing, m, shapes, opts.workers, opts.seed, spawn=True)))
        else:
            measured = cache.get_or_measure(key, lambda m=method: merge_colocated(colocated(
                measure_method, sharing, m, shapes, opts.workers, opts.device, opts.seed)))
        traffic = Traffic.from_measurement(measured)
        mine = local.get(method.label)
        row_compute = compute_s if opts.compute_ms is not None or mine is None else mine["compute_s"]
        priced[method.label] = price(method.label, method.name, traffic, network, opts.workers, row_compute,
                                     method.note, mine)
    rows = [phased.combine(m, [(p, priced[p.method.label]) for p in split[m.label]], opts.steps, PlanRow)
            if split[m.label] else priced[m.label] for m in methods]
    target = None
    if opts.pilots and opts.model is not None:
        target = pilot.to_target(opts, methods, rows, cache, FP32, machine, compute_s, log)
    ordered = sorted(rows, key=lambda r: r.step_s)
    if target is not None:
        ordered = sorted(rows, key=lambda r: (target["rows"][r.label]["time_s"] is None,
                                             target["rows"][r.label]["time_s"] or r.step_s))
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


# -- output --------------------------------------------------------------------------------------------------


def _bits(b: float) -> str:
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} bit"


def _rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


HEADER = ["method", "step ms", "x fp32", "compute ms", "compress ms", "comm ms", "comm %", "compress %",
          "bits up/worker", "bits down/worker"]


TARGET_HEADER = ["time to target s", "range s", "steps to target"]


def header(plan: dict[str, Any]) -> list[str]:
    return ([HEADER[0], *TARGET_HEADER, *HEADER[1:]] if plan.get("target") else HEADER)


def _target_cells(r: dict[str, Any]) -> list[str]:
    if r.get("time_s") is None:
        return [r["status"], "-", "-"]
    mark = "" if r["status"] == "reached" else " ~"  # extrapolated beyond the pilot
    return [f"{r['time_s']:.0f}{mark}", f"{r['time_low_s']:.0f}-{r['time_high_s']:.0f}", f"{r['steps_to_target']:.0f}"]


def table_rows(plan: dict[str, Any]) -> list[list[str]]:
    fp32 = next((r for r in plan["rows"] if r["method"] == FP32), None)
    out = []
    for r in plan["rows"]:
        out.append([
            r["label"] + (" *" if r["note"] else ""),
            *(_target_cells(r) if plan.get("target") else []),
            f"{1e3 * r['step_s']:.2f}",
            f"{r['step_s'] / fp32['step_s']:.2f}" if fp32 else "-",
            f"{1e3 * r['compute_s']:.2f}",
            f"{1e3 * r['compress_s']:.2f}",
            f"{1e3 * r['communicate_s']:.2f}",
            f"{100 * r['communicate_share']:.0f}",
            f"{100 * r['compress_share']:.0f}",
            _bits(r["bits_up"]),
            _bits(r["bits_down"]),
        ])
    return out


def _title(plan: dict[str, Any]) -> str:
    net = plan["network"]
    return (f"plan: {plan['source']} ({plan['num_parameters']:,} parameters in {plan['tensors']} tensors), "
            f"{plan['workers']} workers, {_rate(net['bandwidth_bps'])}, latency {1e6 * net['latency_s']:g} us, "
            + (f"burst {net['burst_bytes'] / 1024:g} KiB, " if net.get("burst_bytes") else "")
            + f"device {plan['device']}")


def _sharing(plan: dict[str, Any]) -> str:
    n = plan.get("colocated", 1)
    if n == 1:
        return f"{plan['machine']['threads']} threads, one worker at a time"
    return f"{n} workers at once sharing its {os.cpu_count()} cores"


def _footer(plan: dict[str, Any]) -> list[str]:
    lines = [f"compute: {1e3 * plan['compute_s']:.2f} ms ({plan['compute_from']}); compression measured on "
             f"{plan['machine']['gpu'] or plan['machine']['cpu']} ({_sharing(plan)}); "
             "communication priced by the latency-bandwidth model on the collectives each method really issued"]
    if not plan.get("local_race"):
        lines.append("the exchange is timed as the DDP hook runs it, bucket by bucket (a method with ddp=off: as "
                     "GradientAggregator runs it, once after backward); the hook's hand-over of each bucket to its "
                     "communication thread is not in the model (docs/plan.md)")
    else:
        lines.append(f"compute and compression from the local race: each method's step with the {plan['workers']} "
                     "workers on this machine and an unshaped network (gradcomp race --link none: DDP, the hook's "
                     "thread and its overlap included); communication "
                     "is the longer of the priced collectives and that race's time in collectives")
    target = plan.get("target")
    if target:
        given = "given" if target["given"] else "fp32's value at the end of its pilot"
        lines.append(f"target: {target['metric']} {target['value']:.3f} ({given}); steps to it from a "
                     f"{target['pilot_steps']}-step pilot per method (gradcomp train's defaults for the model, "
                     f"simulated workers, the same seed); time = steps x the predicted step; '~': extrapolated "
                     f"beyond the pilot by the method's slowdown against fp32; a method more than "
                     f"{target['tolerance']:g} behind fp32 at the pilot's end does not keep up and is never "
                     "recommended (docs/plan.md)")
        for r in plan["rows"]:
            if r.get("status") not in (None, "reached"):
                lines.append(f"  {r['label']}: {r['status']}: {r['detail']}")
    notes = sorted({(r["label"], r["note"]) for r in plan["rows"] if r["note"]})
    lines += [f"* {label}: {note}" for label, note in notes]
    cache = plan["cache"]
    if cache["directory"]:
        lines.append(f"cache {cache['directory']}: {cache['hits']} measurements reused, {cache['misses']} taken")
    lines.append(f"recommendation: {plan['recommendation']}")
    return lines


def format_text(plan: dict[str, Any]) -> str:
    head = header(plan)
    rows = [head, *table_rows(plan)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [_title(plan), ""]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines + [""] + _footer(plan))


def format_markdown(plan: dict[str, Any]) -> str:
    head = header(plan)
    lines = [f"**{_title(plan)}**", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(plan)]
    return "\n".join(lines + [""] + [f"- {line}" for line in _footer(plan)])


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
        if pilot.plot_time_to_target(plan, path, _title(plan)):
            print(f"plot: {path}", file=sys.stderr)
        else:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0
