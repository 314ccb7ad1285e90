"""What `gradcomp plan` measures on this machine: each method's traffic and compression on simulated workers
(``measure_method``; torch's PowerSGD hook, ``measure_torch_powersgd``), the model's compute, both timed in
several processes at once where workers share the cores (``colocated``)."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradcomp.errors import ConfigError
from gradcomp.experiments.race.method import Method

WARMUP_STEPS = 2
TIMED_STEPS = 8  # a colocated timing of 3 steps was not repeatable between two plans of the same code
COMPUTE_REPEATS = 5


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
    from gradcomp.train.aggregator import GradientAggregator
    from gradcomp.train.ddp_hook import DEFAULT_MIN_COMPRESSION_RATE, sends_directly
    from gradcomp.train.exchange import GradientExchange
    from gradcomp.transport.sim import SimulatedCluster

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
                if direct:
                    return _hook_all_reduce_step(grads, buckets, exchange, transport)
                return _hook_exchange_step(grads, step, buckets, method.granularity, slots, exchange, transport, dev)

        return _recorded_steps(one_step, exchange, transport, shapes, dev, seed, warmup, timed)

    with SimulatedCluster(workers) as cluster:
        per_worker = cluster.run(worker)
    return {"workers": per_worker}


def _hook_all_reduce_step(grads: list[torch.Tensor], buckets: list[list[int]], exchange, transport) -> float:
    """One step of the DDP hook's own all-reduce of each bucket buffer (``CompressionHookState._direct``: ``none``,
    ``fp16``, ``bf16``, no exchange); returns the seconds it spends outside the all-reduces."""
    from gradcomp.train.ddp_hook import direct_message

    outside = 0.0
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


def _hook_exchange_step(grads: list[torch.Tensor], step: int, buckets: list[list[int]], granularity: str,
                        slots: list, exchange, transport, dev: torch.device) -> float:
    """One step of the DDP hook's exchange, bucket by bucket: the finiteness check, the exchange, the copy back,
    the scheme told the pass's slots and the ranks' ``settle``; returns the seconds it spends outside collectives
    (the exchange's own compression is counted by ``exchange.compress_s``)."""
    from gradcomp.compressors.base import Slot
    from gradcomp.finite import finite_flags
    from gradcomp.train.agreement import settle
    from gradcomp.wire.refusals import Refusals

    outside, seen = 0.0, []
    refusals = Refusals()
    for b, indices in enumerate(buckets):
        if granularity == "bucket":  # DDP's bucket buffer, one slot (made off the clock)
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


def _recorded_steps(one_step: Callable[[list[torch.Tensor], int], float], exchange, transport,
                    shapes: Sequence[tuple[int, ...]], dev: torch.device, seed: int, warmup: int,
                    timed: int) -> list[dict[str, Any]]:
    """``warmup + timed`` steps of one simulated worker on seeded random gradients; returns, per timed step, its
    ``compress_s`` (the exchange's, plus what ``one_step`` spent outside collectives) and its counted traffic."""
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

