"""Beyond this machine: `gradcomp plan`'s prediction for W = 8 ... 256 workers and 1 ... 100 Gbit/s links.

Two models, given by their parameter shapes (benchmarks/shapes/, sizes only, written by ``--write-shapes``):

- ``resnet50``: ResNet-50's 161 tensors, 25.6M parameters (convolutions, batch-norm scales and shifts, fc);
- ``gpt2-medium``: GPT-2 medium's 292 tensors, 354.8M parameters (token and position embeddings, 24 blocks).

How (every figure but the extrapolation in W is measured, none is a formula of a method's size):

1. Each method runs real steps (``plan.measure_method``: its scheme on a simulated cluster, random gradients
   with the model's real shapes) at W = 2 and W = 4, on this machine's CPU. That gives, per collective, the
   calls and the bytes handed to them, and the slowest worker's compression time (compress, encode, decode,
   aggregate).
   ResNet-50 is measured on its own shapes. GPT-2 medium does not fit this machine's memory W times over,
   so it is measured on ``gpt2-medium-2blocks`` (two of its 24 blocks, its position embedding and final norm:
   26.2M parameters with the same tensor shapes as the blocks), and its bytes and compression time are
   scaled by the parameter count (x 13.5); the token embedding (a 50257 x 1024 matrix, 15 % of the model)
   is assumed to cost what a block's matrices cost per entry. The calls per step are the measured ones.
2. Extrapolation in W, checked on the measurements: bytes per call of each collective are fitted as a + b / W
   (constant per-worker messages of all-reduce / all-gather: b = 0; the sharded topology's shards: a = 0),
   compression time as c + d · W for methods that gather every worker's whole message (each worker decodes
   W of them), as a constant (the smaller of the two timings) for the others (``plan.fit_in_workers``).
3. Prices with ``gradcomp.netmodel`` at latency 10 us, and adds an assumed compute time per step (forward +
   backward on one accelerator: ``--compute-ms``, 100 ms for ResNet-50 and 400 ms for GPT-2 medium by
   default — assumptions, not measurements).

Compression times are this machine's CPU (one process, torch's threads): a GPU compresses far faster, so the
compressed methods look worse here than they would on GPUs. Read the tables as "with CPU-speed compression".

    PYTHONPATH=src python scripts/plan_extrapolate.py --out docs/plan          # tables (markdown) + plots
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from gradcomp.experiments.study import plan
from gradcomp.netmodel import NetworkModel

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "benchmarks" / "shapes"
METHODS = (
    "none",
    "fp16",
    "topk:density=0.01,feedback=momentum_masking",
    "cnat:topology=sharded,server=cnat",
    "sbc:density=0.01",
    "qsgd",
    "powersgd:rank=2",
    "signum",
    "efsignsgd",
)
FAMILY = {"none": "fp32", "fp16": "cast", "topk": "sparsification", "sbc": "sparsification", "cnat": "quantization",
          "qsgd": "quantization", "powersgd": "low rank", "signum": "sign", "efsignsgd": "sign"}
WORKERS = (8, 16, 32, 64, 128, 256)
RATES_GBIT = (1, 2.5, 5, 10, 25, 40, 100)
LATENCY_S = 10e-6
MEASURED_AT = (2, 4)
MODELS = {  # name: (shapes measured, scale of bytes and compression time, compute ms)
    "resnet50": ("resnet50", 1.0, 100.0),
    "gpt2-medium": ("gpt2-medium-2blocks", None, 400.0),  # scale: numel ratio, computed
}


# -- shapes --------------------------------------------------------------------------------------------------


def resnet50_shapes() -> list[list[int]]:
    shapes = [[64, 3, 7, 7], [64], [64]]
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [[width, inplanes, 1, 1], [width], [width], [width, width, 3, 3], [width], [width],
                       [4 * width, width, 1, 1], [4 * width], [4 * width]]
            if b == 0:
                shapes += [[4 * width, inplanes, 1, 1], [4 * width], [4 * width]]
            inplanes = 4 * width
    return shapes + [[1000, 2048], [1000]]


def gpt2_shapes(blocks: int = 24, d: int = 1024, vocab: int | None = 50257, context: int = 1024) -> list[list[int]]:
    shapes = ([[vocab, d]] if vocab else []) + [[context, d]]
    for _ in range(blocks):
        shapes += [[d], [d], [d, 3 * d], [3 * d], [d, d], [d], [d], [d], [d, 4 * d], [4 * d], [4 * d, d], [d]]
    return shapes + [[d], [d]]


def write_shapes() -> None:
    SHAPES.mkdir(parents=True, exist_ok=True)
    for name, shapes, about in (
        ("resnet50", resnet50_shapes(), "ResNet-50 (torchvision layout): conv, batch-norm weight and bias, fc"),
        ("gpt2-medium", gpt2_shapes(), "GPT-2 medium: wte, wpe, 24 blocks (ln_1, attn.c_attn, attn.c_proj, ln_2, "
         "mlp.c_fc, mlp.c_proj, weights and biases), ln_f; lm_head tied to wte"),
        ("gpt2-medium-2blocks", gpt2_shapes(blocks=2, vocab=None), "two GPT-2 medium blocks with wpe and ln_f, "
         "no token embedding: what scripts/plan_extrapolate.py measures GPT-2 medium on"),
    ):
        numel = sum(math.prod(s) for s in shapes)
        (SHAPES / f"{name}.json").write_text(json.dumps({"about": about, "parameters": numel, "shapes": shapes}) + "\n")
        print(f"{name}: {len(shapes)} tensors, {numel:,} parameters")


# -- measure, fit, price -------------------------------------------------------------------------------------


def measure(shapes_name: str, cache: plan.Cache) -> dict[str, dict[int, plan.Traffic]]:
    shapes = plan.load_shapes(str(SHAPES / f"{shapes_name}.json"))
    machine = plan.machine_identity("cpu")
    out: dict[str, dict[int, plan.Traffic]] = {}
    for text in METHODS:
        method = plan.parse_method(text)
        out[text] = {}
        for workers in MEASURED_AT:
            print(f"measuring {text} on {shapes_name}, W={workers}", file=sys.stderr, flush=True)
            key = {"what": "method", "machine": machine, "shapes": [list(s) for s in shapes], "workers": workers,
                   "device": "cpu", "seed": 0, "method": method.key(), "steps": [1, 2]}
            measured = cache.get_or_measure(key, lambda m=method, w=workers: plan.measure_method(
                m, shapes, w, warmup=1, timed=2))
            out[text][workers] = plan.Traffic.from_measurement(measured)
    return out


def predict(fitted: plan.Fitted, workers: int, network: NetworkModel, compute_s: float) -> tuple[float, float, float]:
    """(step, compression, communication) seconds at ``workers`` on ``network``."""
    compress, comm = fitted.compress_s(workers), fitted.communication_s(network, workers)
    return compute_s + compress + comm, compress, comm


def run(out: Path, compute_ms: dict[str, float]) -> dict:
    cache = plan.Cache()
    results = {}
    for model, (measured_on, scale, _) in MODELS.items():
        if scale is None:
            full = json.loads((SHAPES / f"{model}.json").read_text())["parameters"]
            part = json.loads((SHAPES / f"{measured_on}.json").read_text())["parameters"]
            scale = full / part
        traffic = measure(measured_on, cache)
        fitted = {m: plan.fit_in_workers(t, scale) for m, t in traffic.items()}
        compute_s = compute_ms[model] / 1e3
        grid = {}
        for workers in WORKERS:
            for rate in RATES_GBIT:
                network = NetworkModel(rate * 1e9, LATENCY_S)
                grid[f"{workers}@{rate}"] = {m: predict(f, workers, network, compute_s) for m, f in fitted.items()}
        results[model] = {"measured_on": measured_on, "scale": scale, "compute_ms": compute_ms[model],
                          "bits_up_per_step_at_4": {m: t[4].bits_up * scale for m, t in traffic.items()},
                          "compress_s_at_8": {m: predict(f, 8, NetworkModel(1e9), 0)[1] for m, f in fitted.items()},
                          "grid": grid}
    out.mkdir(parents=True, exist_ok=True)
    (out / "extrapolation.json").write_text(json.dumps(results, indent=1))
    return results


# -- output --------------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    lines = []
    for model, r in results.items():
        lines += [f"### {model} (compute {r['compute_ms']:g} ms per step assumed; measured on {r['measured_on']}"
                  + (f", scaled x {r['scale']:.2f}" if r["scale"] != 1 else "") + ")", "",
                  "Fastest method per cell, and its step time as a multiple of uncompressed fp32's (< 1: faster):", "",
                  "| W \\ link | " + " | ".join(f"{g:g} Gbit/s" for g in RATES_GBIT) + " |",
                  "|---|" + "---|" * len(RATES_GBIT)]
        for workers in WORKERS:
            cells = []
            for rate in RATES_GBIT:
                cell = r["grid"][f"{workers}@{rate}"]
                best = min(cell, key=lambda m: cell[m][0])
                cells.append(f"{best.split(':')[0]} {cell[best][0] / cell['none'][0]:.2f}")
            lines.append(f"| {workers} | " + " | ".join(cells) + " |")
        lines += ["", "Where each family stops paying for itself: the fastest link (of those above) at which its "
                  "best method still beats fp32, per W (`-`: never; `all`: at every link):", "",
                  "| family | " + " | ".join(f"W={w}" for w in WORKERS) + " |", "|---|" + "---|" * len(WORKERS)]
        for family in ("cast", "sparsification", "quantization", "low rank", "sign"):
            members = [m for m in METHODS if FAMILY[m.split(":")[0]] == family]
            cells = []
            for workers in WORKERS:
                paying = [rate for rate in RATES_GBIT
                          if min(r["grid"][f"{workers}@{rate}"][m][0] for m in members)
                          < r["grid"][f"{workers}@{rate}"]["none"][0]]
                cells.append("all" if len(paying) == len(RATES_GBIT) else (f"{max(paying):g} Gbit/s" if paying else "-"))
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
        lines += ["", "Compression per step at W = 8 (this CPU, s): " + ", ".join(
            f"{m.split(':')[0]} {s:.3g}" for m, s in r["compress_s_at_8"].items()), ""]
    return "\n".join(lines)


def plot(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for model, r in results.items():
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, workers in zip(axes, (8, 256)):
            for m in METHODS:
                ys = [r["grid"][f"{workers}@{rate}"][m][0] / r["grid"][f"{workers}@{rate}"]["none"][0]
                      for rate in RATES_GBIT]
                ax.plot(RATES_GBIT, ys, marker="o", label=m.split(":")[0] + (" (sharded)" if "sharded" in m else ""))
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("link, Gbit/s per worker")
            ax.set_ylabel("predicted step / fp32's step")
            ax.set_title(f"{model}, W = {workers}")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"gradcomp plan, extrapolated: {model} (compute {r['compute_ms']:g} ms assumed, "
                     "compression timed on a CPU)")
        fig.tight_layout()
        path = out / f"{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write-shapes", action="store_true", help="(re)write benchmarks/shapes/*.json first")
    p.add_argument("--out", default=str(ROOT / "docs" / "plan"))
    p.add_argument("--compute-ms", nargs=2, type=float, default=[MODELS["resnet50"][2], MODELS["gpt2-medium"][2]],
                   metavar=("RESNET50", "GPT2_MEDIUM"))
    args = p.parse_args()
    if args.write_shapes or not (SHAPES / "gpt2-medium-2blocks.json").exists():
        write_shapes()
    out = Path(args.out)
    results = run(out, {"resnet50": args.compute_ms[0], "gpt2-medium": args.compute_ms[1]})
    text = markdown(results)
    (out / "extrapolation.md").write_text(text + "\n")
    print(text)
    for path in plot(results, out):
        print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
