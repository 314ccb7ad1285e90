"""Human-readable reports of run results."""

from __future__ import annotations

import os
from typing import Any

from gradcomp.errors import ConfigError


def check_output_file(path: str, option: str) -> None:
    """ConfigError now, naming ``option``, if a file could not be written at ``path`` later (after a long run).

    The folder must exist and be writable, and ``path`` must not be a folder. Tried by doing it, as
    ``make_output_dir`` does (permission bits do not tell: root ignores them, and /proc or a read-only mount do
    not show in them): a probe file is created in the folder and removed, an existing file is opened for
    appending and closed unchanged; nothing is left behind.
    """
    folder = os.path.dirname(os.path.abspath(path)) or os.sep
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ConfigError(f"{option} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        raise ConfigError(f"{option} {path}: the folder {folder} does not exist")
    probe = os.path.join(folder, f".gradcomp-probe-{os.getpid()}")
    try:
        if os.path.exists(path):
            open(path, "ab").close()
        open(probe, "wb").close()
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: not writable ({exc.strerror or exc})") from None


def make_output_dir(path: str | os.PathLike[str], option: str, note: str = "") -> None:
    """Create the folder ``path`` (and its parents) now and write a probe file there (removed again), or a
    ConfigError naming ``option`` (``note`` appended). By doing it: permission bits alone do not tell (root
    ignores them; a read-only mount or a path under a file does not show in them)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{option} {path}: is a file, not a folder{note}")
    probe = os.path.join(path, f".gradcomp-probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        open(probe, "wb").close()
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot be written ({exc.strerror or exc}){note}") from None


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """``data`` at ``path``, complete or not at all: a temporary name (``.<name>.tmp``), fsync, ``os.replace``,
    fsync of the folder, so that a reader (or a power cut) sees the old file or the new one, whole."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def cpu_model() -> str | None:
    """The processor's model name (``/proc/cpuinfo``), or None where there is none: what a result was run on."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def human_bits(bits: float) -> str:
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.2f} {unit}"
    return f"{bits:.0f} bit"


def against_fp32(sent: float, dense: float) -> str:
    """``sent`` against what fp32 would send: "x12.3 fewer than fp32", or "x2.5 more than fp32" when larger."""
    if not sent:
        return "nothing sent"
    if not dense:
        return "fp32 would send nothing"
    if abs(sent - dense) <= 0.005 * dense:
        return "as much as fp32"
    if sent < dense:
        return f"x{dense / sent:,.1f} fewer than fp32"
    return f"x{sent / dense:,.1f} more than fp32"


def format_summary(r: dict[str, Any]) -> str:
    params = ", ".join(f"{k}={v}" for k, v in r["params"].items())
    name = f"{r['compressor']}({params})" if params else r["compressor"]
    if r.get("feedback") not in (None, "none"):
        name += " + " + r["feedback"].replace("_", " ")
    elif r["error_feedback"]:
        name += " + error feedback"
    up, down, dense = r["bits_up_per_worker"], r["bits_down_per_worker"], r["dense_bits_per_worker"]
    ratio = lambda x: against_fp32(x, dense)  # noqa: E731
    rows = [
        ("compressor", name),
        ("workers / steps", f"{r['workers']} ({r['backend']}) / {r['steps']} ({r['epochs']:.2f} epochs)"),
        ("test accuracy", f"{100 * r['test_accuracy']:.2f} %"
         + (" (next byte, validation)" if r.get("val_bits_per_byte") is not None else "")),
        ("bits up / worker", f"{human_bits(up)}  ({ratio(up)})"),
        ("bits down / worker", f"{human_bits(down)}  ({ratio(down)})"),
        ("fp32 would send", f"{human_bits(dense)} up per worker"
         + (" (FSDP's fp32 reduce-scatter: (W-1)/W of the gradient leaves a rank)" if r.get("fsdp") else "")),
        ("padding", human_bits(r["padding_bits"]) + " per worker (not in the counts above)"),
        ("set-up", human_bits(r.get("setup_bits", 0)) + " per worker, once (the slot check; not in the counts above)"),
        (
            "time",
            (f"training loop {r['compute_s']:.1f} s (forward, backward with the hook's exchanges and the wait for "
             f"them, optimizer); the hook's thread compressed {r['compress_s']:.1f} s and communicated "
             f"{r['communicate_s']:.1f} s of it, overlapping backward (not to be added)"
             if r.get("time_overlapped") else
             f"compute {r['compute_s']:.1f} s, compress {r['compress_s']:.1f} s, "
             f"communicate {r['communicate_s']:.1f} s")
            + f" per worker (mean); wall {r['wall_time_s']:.1f} s"
            + (f" for all {r['workers']} in one process" if r.get("backend") == "simulated" else ""),
        ),
        ("replicas identical", "n/a (FSDP: one sharded copy)" if r["replicas_identical"] is None
         else "yes" if r["replicas_identical"] else "NO"),
    ]
    if "modelled_communicate_s" in r:
        net = r["network"]
        rows.insert(-1, (
            "modelled network",
            f"{r['modelled_communicate_s']:.3g} s of communication at {human_bits(net['bandwidth_bps'])}/s, "
            f"{1e6 * net['latency_s']:g} us latency (alpha-beta model of the measured collectives)",
        ))
    if r.get("val_bits_per_byte") is not None:
        corpus = r.get("corpus") or {}
        rows.insert(3, ("validation loss", f"{r['val_bits_per_byte']:.4f} bits/byte (perplexity "
                                           f"{r['val_perplexity']:.3f} per byte)"))
        if corpus:
            rows.insert(4, ("corpus", f"{corpus['corpus']} (Python {corpus['python_version']}): "
                                      f"{corpus['train_bytes']:,} training / {corpus['validation_bytes']:,} validation "
                                      f"bytes, sha256 {corpus['corpus_sha256'][:12]}…"))
    if r.get("num_buffer_elements"):
        rows.insert(-1, ("buffers / worker", f"{human_bits(r['buffer_bits_up_per_worker'])} up, "
                                             f"{human_bits(r['buffer_bits_down_per_worker'])} down "
                                             f"({r['num_buffer_elements']:,} BatchNorm buffer values broadcast from "
                                             "rank 0 each step; not in the gradient bits above)"))
    if r.get("paper_compression"):
        factor = f"x{r['paper_compression']:,.1f} (as the method's paper counts it; see its docs)"
        rows.insert(5, ("paper's factor", factor))
    lgc = r.get("method_report") or {}
    if "autoencoder_seconds" in lgc:
        share = 100 * lgc["autoencoder_seconds"] / r["wall_time_s"] if r["wall_time_s"] else 0.0
        text = f"trained {lgc['autoencoder_seconds']:.1f} s ({share:.0f} % of wall, rank 0)"
        for lay in lgc["layouts"]:
            if lay["held_out_error"] is not None:
                text += (
                    f"; held-out relative error {lay['held_out_error']:.3f} against "
                    f"{lay['topk_same_bits_error']:.3f} for top-k values of the same bits "
                    f"({lay['held_out_steps']} steps)"
                )
        rows.insert(-1, ("autoencoder", text))
    if r.get("server_bits_out"):
        rows.insert(5, ("server in / out", f"{human_bits(r['server_bits_in'])} / {human_bits(r['server_bits_out'])}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


# -- several seeds -----------------------------------------------------------------------------------------------

# the per-run numbers that --seeds reports as mean ± std (when every run has them)
SEED_METRICS: tuple[str, ...] = (
    "test_accuracy", "val_bits_per_byte", "final_loss", "bits_up_per_worker", "bits_down_per_worker",
    "buffer_bits_up_per_worker", "buffer_bits_down_per_worker", "wall_time_s",
)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n − 1 in the denominator; 0.0 for a single value)."""
    if not values:
        raise ConfigError("mean_std needs at least one value")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5


def aggregate_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result for the same training over several seeds: the first run's fields, plus ``seeds``, ``per_seed``
    (each run's metric values) and ``mean`` / ``std`` (sample standard deviation) of every metric."""
    if not runs:
        raise ConfigError("no runs to aggregate")
    seeds = [r["seed"] for r in runs]
    out = dict(runs[0])
    out["seeds"] = seeds
    out["per_seed"] = {}
    out["mean"], out["std"] = {}, {}
    for key in SEED_METRICS:
        values = [r.get(key) for r in runs]
        if any(v is None for v in values):
            continue
        out["per_seed"][key] = values
        out["mean"][key], out["std"][key] = mean_std([float(v) for v in values])
    checked = [r["replicas_identical"] for r in runs]
    out["replicas_identical"] = None if any(v is None for v in checked) else all(checked)  # None: FSDP, not checked
    out["runs"] = runs
    return out


def format_seeds(r: dict[str, Any]) -> str:
    """The first seed's summary, then every metric as mean ± std with the per-seed values."""
    first = {**r["runs"][0]}
    lines = [format_summary(first), "", f"  over seeds {', '.join(str(s) for s in r['seeds'])} "
             "(mean ± sample std; per-seed values in brackets):"]
    fmt = {"test_accuracy": ("test accuracy %", 100, ".2f"), "val_bits_per_byte": ("validation bits/byte", 1, ".4f"),
           "final_loss": ("final training loss", 1, ".4f"), "bits_up_per_worker": ("Mbit up / worker", 1e-6, ".3f"),
           "bits_down_per_worker": ("Mbit down / worker", 1e-6, ".3f"),
           "buffer_bits_up_per_worker": ("buffer Mbit up / worker", 1e-6, ".3f"),
           "buffer_bits_down_per_worker": ("buffer Mbit down / worker", 1e-6, ".3f"),
           "wall_time_s": ("wall s", 1, ".1f")}
    for key, (label, scale, spec) in fmt.items():
        if key not in r["mean"] or (key.startswith("buffer") and not r["mean"][key]):
            continue
        per = ", ".join(format(scale * v, spec) for v in r["per_seed"][key])
        lines.append(f"    {label}: {format(scale * r['mean'][key], spec)} ± {format(scale * r['std'][key], spec)}"
                     f"  [{per}]")
    same = r["replicas_identical"]
    lines.append(f"    replicas identical in every run: {'n/a (FSDP)' if same is None else 'yes' if same else 'NO'}")
    return "\n".join(lines)


def parse_seeds(text: str, option: str = "--seeds") -> list[int]:
    """A comma-separated list of distinct seeds (integers in [0, 2**64)); ConfigError otherwise."""
    seeds = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            seed = int(part)
        except ValueError:
            raise ConfigError(f"{option} takes comma-separated whole numbers, e.g. 0,1,2; got {part!r}") from None
        if not 0 <= seed < 2**64:
            raise ConfigError(f"{option}: a seed must be in [0, 2**64), got {seed}")
        if seed in seeds:
            raise ConfigError(f"{option}: seed {seed} is given twice; each seed runs once")
        seeds.append(seed)
    if not seeds:
        raise ConfigError(f"{option} needs at least one seed, got {text!r}")
    return seeds
