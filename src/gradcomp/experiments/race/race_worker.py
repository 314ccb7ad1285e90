"""One worker of ``gradcomp race``, started on its host.

``[ip netns exec NS] python -m gradcomp.experiments.race.race_worker JOB.json``: the environment carries
torch.distributed's usual variables (MASTER_ADDR = host 0's address, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK: the host's index, its GPU with CUDA), GLOO_SOCKET_IFNAME (the host's veth) and NCCL's settings that
keep NCCL on that veth (``race._nccl_over_the_link``). ``MASTER_PORT=0`` (plain local processes)
makes rank 0 bind a port the OS picks and publish it in ``<job dir>/port``.

What a worker does, in order:

1. joins the process group, gloo or (CUDA) NCCL (a TCP store at MASTER_ADDR, served by rank 0);
2. **warm-up and compute-only steps**: ``WARMUP_STEPS`` unreported steps, then ``compute_steps`` measured ones,
   of forward, backward and optimizer step on a private copy of the model with its own batches, no
   communication at all, all workers at once (so they contend for the CPU as in training); the median of the
   measured ones is the method's compute-only step time. The warm-up steps run whatever ``compute_steps`` is
   (0 included), so torch's first-call costs are never on any method's training clock;
2b. **a message's fixed cost**: ``LATENCY_ROUNDS`` all-reduces of one float over the link (``tiny_allreduce_seconds``),
   the latency the race reports for ``gradcomp plan --latency``;
3. trains with gradcomp's own loop, ``runner.run_worker`` (DDP with gradcomp's hook or torch's, or the
   aggregator), with an ``after_step`` that keeps the **training clock**: the end time of every step, minus
   the time spent evaluating. The clock starts, after a barrier, just before the first training step
   (run_worker's ``before_training``, in ``clocked_run_worker``): the model, the optimizer and DDP's
   constructor (which broadcasts the parameters from rank 0) are set-up, off the clock and out of the wire
   bytes, for every method alike. Every
   ``eval_every`` steps all workers evaluate the (identical) replicas on 1/W of the test set each and sum the
   counts, so the accuracy is that of the full test set; that time is off the clock. The last point is
   run_worker's own final evaluation of the full test set on rank 0;
4. writes ``result-<rank>.json``: step end times, accuracy curve, compute-only step times, the one-float
   all-reduces' times, peak resident set
   during training steps (evaluations excluded: the high-water mark is read before and reset after each one),
   bytes on its veth (namespaces only), and run_worker's statistics.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradcomp import allocator
from gradcomp.experiments.race.netns import read_wire_counters
from gradcomp.experiments.run import runner
from gradcomp.experiments.run.data import Dataset, TextDataset, evaluate, evaluate_text
from gradcomp.experiments.run.launch import die_with_parent
from gradcomp.experiments.run.models import build_model
from gradcomp.experiments.run.report import write_atomic
from gradcomp.experiments.run.config import EXCHANGING_OPTIMIZERS, TrainConfig
from gradcomp.experiments.run.runner import Batches, compute_gradients, make_optimizer
from gradcomp.transport.dist import DistTransport, bind_device

WARMUP_STEPS = 2  # unreported local steps before the compute-only ones: torch's first calls are slow
LATENCY_ROUNDS = 20  # tiny all-reduces timed for the per-message latency


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_bytes() -> int:
    """The resident set's high-water mark since the last ``reset_peak_rss`` (getrusage; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current resident set (Linux ``/proc/self/clear_refs``); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def file_backed_rss_bytes() -> int:
    """Resident pages backed by files or shared memory (mostly torch's libraries' code), from /proc/self/status."""
    total = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssFile:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


class MemoryPeaks:
    """Peak memory over training steps only: read before each evaluation, reset after it.

    ``rss`` is the high-water mark of the resident set (getrusage). ``anon`` is that minus the file-backed
    resident pages at the time of reading: library code that a method's code path happens to touch (torch's
    fp16 kernels, say) counts in the resident set but is not memory the method allocates; file-backed pages
    are hardly ever dropped, so the value at the end of a stretch is close to the value at its peak.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.resettable = reset_peak_rss()
        self.rss = 0
        self.anon = 0
        self.cuda = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def read(self) -> None:
        peak = peak_rss_bytes()
        self.rss = max(self.rss, peak)
        self.anon = max(self.anon, peak - file_backed_rss_bytes())
        if self.device.type == "cuda":
            self.cuda = max(self.cuda, torch.cuda.max_memory_allocated(self.device))

    def reset(self) -> None:
        if self.resettable:
            reset_peak_rss()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


class RaceClock:
    """The training clock of one worker, and the periodic evaluation it pauses for."""

    def __init__(self, data: Dataset, rank: int, world: int, total: int, eval_every: int, eval_batch: int,
                 device: torch.device, memory: MemoryPeaks, verbose: bool, label: str):
        self.data, self.rank, self.world, self.total = data, rank, world, total
        self.eval_every, self.eval_batch, self.device = eval_every, eval_batch, device
        self.memory, self.verbose, self.label = memory, verbose, label
        n = data.test_x.shape[0]
        self.test = slice(rank * n // world, (rank + 1) * n // world)  # this worker's share of the test set
        self.step_end: list[float] = []
        self.compress_end: list[float] = []  # the exchange's compression clock at each step's end
        self.curve: list[list[float]] = []  # [step, training seconds, accuracy]
        self.eval_s = 0.0
        self._t0 = 0.0
        self._paused = 0.0

    def start(self) -> None:
        _sync(self.device)
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0 - self._paused

    def after_step(self, step: int, model: torch.nn.Module, exchange: Any = None) -> None:
        _sync(self.device)
        now = self.now()
        self.step_end.append(now)
        self.compress_end.append(exchange.compress_s if exchange is not None else 0.0)
        if step + 1 >= self.total:
            self.memory.read()  # before run_worker's final evaluation
            if self.rank == 0:  # which rank 0 runs alone while the others wait: give it every core
                torch.set_num_threads(os.cpu_count() or 1)
            return
        if not self.eval_every or (step + 1) % self.eval_every:
            return
        began = time.perf_counter()
        self.memory.read()
        accuracy = self.evaluate(model)
        self.memory.reset()
        spent = time.perf_counter() - began
        self._paused += spent
        self.eval_s += spent
        self.curve.append([step + 1, now, accuracy])
        if self.verbose:
            print(f"  {self.label}: step {step + 1}/{self.total}  {now:7.1f} s  "
                  + (f"validation {accuracy:.4f} bits/byte" if isinstance(self.data, TextDataset)
                     else f"test accuracy {100 * accuracy:.2f} %")
                  + f"  (evaluation {spent:.1f} s, off the clock)", file=sys.stderr, flush=True)

    def evaluate(self, model: torch.nn.Module) -> float:
        """Accuracy of the full test set: each worker evaluates its share, the counts are summed. For a language
        model: the validation loss in bits per byte, each worker's share weighted by its byte count."""
        x, y = self.data.test_x[self.test], self.data.test_y[self.test]
        if isinstance(self.data, TextDataset):
            bits = evaluate_text(model, x, y, batch_size=self.eval_batch)[1] * y.numel() if x.shape[0] else 0.0
            sums = torch.tensor([bits, float(y.numel())], dtype=torch.float64, device=self.device)
            dist.all_reduce(sums)
            return float(sums[0] / sums[1])
        correct = round(evaluate(model, x, y, batch_size=self.eval_batch) * x.shape[0]) if x.shape[0] else 0
        counts = torch.tensor([correct, x.shape[0]], dtype=torch.int64, device=self.device)  # NCCL: on the GPU
        dist.all_reduce(counts)
        return int(counts[0]) / int(counts[1])


def compute_only(cfg: TrainConfig, data: Dataset, rank: int, device: torch.device, steps: int) -> list[float]:
    """Seconds of ``steps`` local steps (forward, backward, optimizer) on a private model, no communication,
    after ``WARMUP_STEPS`` unreported ones (which run even when ``steps`` is 0: they warm torch up for training).
    """
    model = build_model(cfg.model, data, cfg.seed).to(device)
    # 1-bit Adam and 0/1 Adam exchange inside their step(): their compute is AdamW's (the update's arithmetic)
    local = dataclasses.replace(cfg, optimizer="adamw", freeze_step=None) if cfg.optimizer in EXCHANGING_OPTIMIZERS \
        else cfg
    optimizer = make_optimizer(model, local)
    batches = Batches(data, cfg, rank)
    times = []
    dist.barrier()  # every worker computes at the same time, as in training
    for step in range(WARMUP_STEPS + max(steps, 0)):
        started = time.perf_counter()
        xb, yb = batches.get(step, device)
        compute_gradients(model, xb, yb)
        optimizer.step()
        _sync(device)
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - started)
    dist.barrier()
    return times


def tiny_allreduce_seconds(device: torch.device, rounds: int = LATENCY_ROUNDS) -> list[float]:
    """Seconds of ``rounds`` all-reduces of one float over the race's link, after one unreported: a message's
    fixed cost there (the link's and the collective library's latency), which ``gradcomp plan --latency`` takes."""
    one = torch.zeros(1, device=device)
    times = []
    dist.barrier()
    for i in range(rounds + 1):
        started = time.perf_counter()
        dist.all_reduce(one)
        _sync(device)
        if i:
            times.append(time.perf_counter() - started)
    return times


def clocked_run_worker(cfg: TrainConfig, device: torch.device, clock: RaceClock, register=None,
                       ifname: str | None = None) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """``runner.run_worker`` with ``clock`` started just before the first training step; returns its statistics
    and the (tx, rx) bytes on ``ifname`` between that start and the end (None without ``ifname``).

    What run_worker does before its first step (loading the data, building the model and the optimizer, DDP's
    constructor with its broadcast of rank 0's parameters, hook registration) is set-up, which a method with
    ``ddp=off`` does not pay the same way: the clock and the wire counters start after it, for every method, in
    run_worker's ``before_training`` (all workers together, after a barrier).
    """
    counted: dict[str, Any] = {}

    def start() -> None:
        dist.barrier()
        counted["before"] = read_wire_counters(ifname) if ifname else None
        clock.start()

    stats = runner.run_worker(
        cfg, DistTransport(), device, register_hook=register, before_training=start, after_step=clock.after_step
    )
    if "before" not in counted:
        raise RuntimeError("run_worker did not call before_training: the race's clock never started")
    after = read_wire_counters(ifname) if ifname else None
    before = counted["before"]
    wire = (after[0] - before[0], after[1] - before[1]) if before and after else None
    return stats, wire


def _join(job: dict[str, Any], rank: int, world: int, timeout_s: float, device: torch.device) -> None:
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    port_file = os.path.join(job["dir"], "port")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(addr, port, world, is_master=True, timeout=timeout, wait_for_workers=False)
        if port == 0:
            write_atomic(port_file, str(store.port))
    else:
        if port == 0:
            deadline = time.monotonic() + timeout_s
            while not os.path.exists(port_file):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0 did not publish its store's port within {timeout_s:.0f} s")
                time.sleep(0.05)
            with open(port_file) as f:
                port = int(f.read())
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    backend = "gloo" if device.type == "cpu" else "nccl"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            **bind_device(backend, device))


def work(job: dict[str, Any]) -> dict[str, Any]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(job["threads"])
    cfg = TrainConfig(**job["train"])
    cfg.progress = False
    if cfg.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    _join(job, rank, world, cfg.timeout_s, device)
    data = cfg.load_data()
    compute = compute_only(cfg, data, rank, device, job["compute_steps"])
    tiny = tiny_allreduce_seconds(device)
    total = Batches(data, cfg, rank).total_steps()
    memory = MemoryPeaks(device)
    clock = RaceClock(data, rank, world, total, job["eval_every"], job["eval_batch"], device, memory,
                      verbose=rank == 0 and job.get("verbose", True), label=job["label"])
    register = None
    if job.get("baseline"):
        from gradcomp.experiments.race.torch_baselines import torch_hook_registrar

        register = torch_hook_registrar(job["baseline"], job["baseline_params"])
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    dist.barrier()
    memory.reset()
    stats, wire = clocked_run_worker(cfg, device, clock, register, ifname if job["netns"] else None)
    curve = list(clock.curve)
    if rank == 0:
        final = stats["val_bits_per_byte"] if isinstance(data, TextDataset) else stats["test_accuracy"]
        curve.append([total, clock.step_end[-1], final])
    durations = [b - a for a, b in zip([0.0] + clock.step_end[:-1], clock.step_end)]
    compressing = [b - a for a, b in zip([0.0] + clock.compress_end[:-1], clock.compress_end)]
    return {
        "rank": rank,
        "host": os.environ.get("GLOO_SOCKET_IFNAME"),
        "steps": total,
        "step_end_s": clock.step_end,
        "median_step_s": statistics.median(durations) if durations else None,
        # a step's compression, as the median step is taken: the first steps' one-off costs (kernels compiled or
        # loaded, DDP's bucket rebuild) stay out of it, as they do not stay out of stats["compress_s"] / steps
        "median_compress_s": statistics.median(compressing) if compressing else None,
        "train_s": clock.step_end[-1] if clock.step_end else 0.0,
        "eval_s": clock.eval_s,
        "curve": curve,
        "compute_only_s": compute,
        "tiny_allreduce_s": tiny,
        "peak_rss_bytes": memory.rss,
        "peak_anon_bytes": memory.anon,
        "peak_rss_resettable": memory.resettable,
        "allocator": allocator.state(),
        "cuda_peak_bytes": memory.cuda if device.type == "cuda" else None,
        "wire_tx_bytes": wire[0] if wire else None,
        "wire_rx_bytes": wire[1] if wire else None,
        "stats": stats,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent(os.getppid())  # no worker outlives the race process, even one killed by SIGKILL
    allocator.keep_freed_memory()  # a process of gradcomp's own: unless GRADCOMP_KEEP_FREED_MEMORY=0 (allocator.py)
    code = 0
    try:
        with open(argv[0]) as f:
            job = json.load(f)
        result = work(job)
        path = os.path.join(job["dir"], f"result-{result['rank']}.json")
        write_atomic(path, json.dumps(result))  # complete or absent
        dist.barrier()  # every worker is done talking
    except BaseException:  # reported to the race through the exit status and the log
        traceback.print_exc()
        code = 1
    # leave without gloo's destructors (launch.py's reason: they have aborted a finished worker)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
