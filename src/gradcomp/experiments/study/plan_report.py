"""The text and markdown report of a plan (the dict ``run_plan`` returns): the table and the lines under it."""

from __future__ import annotations

import os
from typing import Any

from gradcomp.experiments.study.plan_price import FP32


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


def title(plan: dict[str, Any]) -> str:
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
        if target.get("source") == "recorded":
            given = "given" if target["given"] else "the least good of fp32's recorded final values"
            lines.append(f"target: {target['metric']} {target['value']:.3f} ({given}); steps to it from recorded "
                         f"{target['recorded_steps']}-step runs ({target['recorded_used']} of the "
                         f"{target['recorded_read']} read match a planned method), each seed against fp32's run of "
                         f"the same seed, the mean over seeds; time = steps x the predicted step; '~': extrapolated "
                         f"by the slowdown against fp32; a method more than {target['tolerance']:g} behind fp32 at "
                         "its run's end on any seed does not keep up and is never recommended (docs/plan.md)")
        else:
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
    lines = [title(plan), ""]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines + [""] + _footer(plan))


def format_markdown(plan: dict[str, Any]) -> str:
    head = header(plan)
    lines = [f"**{title(plan)}**", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(plan)]
    return "\n".join(lines + [""] + [f"- {line}" for line in _footer(plan)])

