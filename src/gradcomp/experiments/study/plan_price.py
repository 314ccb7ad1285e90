"""How `gradcomp plan` prices a measured step on a network (the latency-bandwidth model), recommends a method, and
fits a step over the world size beyond the measured ones."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradcomp.netmodel import NetworkModel

FP32 = "none"
SMALL_MARGIN = 0.05  # a recommendation that saves less than this fraction of fp32's step says so


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

