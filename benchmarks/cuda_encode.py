"""Encoding and decoding a message on a CUDA device, against a device copy of the same tensor (docs/gpu.md).

Since the device checksum (gradcomp.wire.checksum.checksum64_tensor) a message built on a GPU stays there: encode
computes the checksum on the device and decode reads back one small summary (docs/wire.md). For a 10M-entry fp32
gradient on the current device, per registered compressor (the methods that own their rounds send no framed
message and are skipped): compress, encode and decode (median of 7, synchronised around each), the message size,
and a device-to-device copy of the 40 MB input (``clone``) to compare with; for threshold, STC and DGC, their
selection with its own reads of the counts against the device path's (``sized_line``). Then, for ``none`` (a 40 MB fp32
message): encode + decode against the copy (target <= 3x), in wall time and in the GPU's busy time (the device time
of the kernels and copies they run, torch.profiler), the device checksum alone (each kernel at 1 KB, 1 MB and 40
MB, and the busy time per call of both Triton kernels at 40 MB), and what the host path costs (a copy to pinned
memory and the CRC pair of the wheels). Then, for fp16 and bf16: compress + encode against a cast of the same tensor
plus the wire's checksum of the cast's bytes (the reference of ``gradcomp bench``'s target for them, <= 1.25 x,
timed in the same run: :func:`cast_line`), and encode + decode against the same reference, in wall time and in the
GPU's busy time.

    python benchmarks/cuda_encode.py [--size N] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from gradcomp import available, make, wire
from gradcomp.compressors.base import Compressor, Slot, compress_slots, select_sized
from gradcomp.wire.bits import host_path
from gradcomp.wire.checksum import _triton_kernel, checksum64, checksum64_tensor

CPU = os.environ.get("GRADCOMP_BENCH_CPU") == "1"  # a smoke run of this script on the CPU (tiny; not a measurement)
CAST_TARGET = 1.25  # fp16 / bf16: compress + encode at most this many times (a cast + the wire's checksum of it)
CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def median_ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        began = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - began)
    return sorted(times)[repeats // 2] * 1e3


def busy_ms(fn, calls: int = 10) -> float:
    """The GPU's busy time per call of ``fn`` (ms): the sum of the device times of every kernel and copy that
    ``calls`` calls ran (torch.profiler), divided by ``calls``. Unlike a wall time it leaves out the host's launch
    overhead, which on a fast GPU is most of a small operation's wall time; it is the time the calls take from
    training's kernels on the same device."""
    fn()
    _sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def measure(name: str, x: torch.Tensor, copy_ms: float) -> str:
    """One compressor's line of the report."""
    slot = Slot(name="x", index=0, numel=x.numel())
    compressor = make(name)
    fields, specs = compressor.compress(x, slot, 0), compressor.specs(slot)
    buf = wire.encode(fields, specs)
    encode = median_ms(lambda: wire.encode(fields, specs))
    decode = median_ms(lambda: wire.decode(buf, specs))
    return (
        f"{name:18s} {buf.numel() / 1e6:7.2f} MB  compress {median_ms(lambda: compressor.compress(x, slot, 1)):7.3f}"
        f"  encode {encode:7.3f}  decode {decode:7.3f}  (encode + decode) / copy {(encode + decode) / copy_ms:7.1f}"
    )


def wire_checksum(buf: torch.Tensor) -> None:
    """The checksum wire.encode computes for a message where ``buf`` is: the device kernel (checksum64_tensor) off
    the host path, the host wheels on it."""
    if host_path(buf):
        checksum64(buf)
    else:
        checksum64_tensor(buf)


def cast_line(name: str, x: torch.Tensor) -> str:
    """fp16 / bf16: compress + encode, and encode + decode, against a cast of ``x`` plus the wire's checksum of the
    cast's bytes (``gradcomp bench``'s reference for these rows), all timed here, in wall time (median of 7,
    synchronised around each) and, on a GPU, in busy time (torch.profiler); met / MISSED against CAST_TARGET."""
    dtype, slot = CASTS[name], Slot(name="x", index=0, numel=x.numel())
    compressor = make(name)
    specs = compressor.specs(slot)
    fields = compressor.compress(x, slot, 0)
    buf = wire.encode(fields, specs)

    def reference() -> None:
        wire_checksum(x.to(dtype).view(torch.uint8))

    def sender() -> None:
        wire.encode(compressor.compress(x, slot, 1), specs)

    def both() -> None:
        wire.decode(wire.encode(fields, specs), specs)

    ref, ce = median_ms(reference), median_ms(sender)
    ed = median_ms(lambda: wire.encode(fields, specs)) + median_ms(lambda: wire.decode(buf, specs))
    ratio = ce / ref
    line = (f"{name}: compress + encode {ce:.3f} = {ratio:.2f} x (cast + checksum {ref:.3f}) (target <= "
            f"{CAST_TARGET:g}: {'met' if ratio <= CAST_TARGET else 'MISSED'}); encode + decode {ed:.3f} = "
            f"{ed / ref:.2f} x")
    if not CPU:
        busy_ref = busy_ms(reference)
        line += (f"; GPU busy time: compress + encode {busy_ms(sender) / busy_ref:.2f} x, encode + decode "
                 f"{busy_ms(both) / busy_ref:.2f} x (cast + checksum {busy_ref:.4f})")
    return line


def sized_line(name: str, x: torch.Tensor) -> str:
    """A variable-size method's selection both ways: ``compress_slots`` (its counts read by the compressor itself;
    DGC's sampled threshold) against ``select_sized`` with its counts and stream lengths read once, as the size
    exchange reads them, then ``finish`` (DGC: torch.topk over the slot). Each of two compressors runs its own way
    every time (DGC's momentum moves as in training)."""
    slot = Slot(name="x", index=0, numel=x.numel())
    classic, sized = make(name), make(name)

    def two_halves() -> None:
        selection = select_sized(sized, [x], [slot], 1)
        counts = selection.device_counts()
        read = torch.cat([torch.stack(counts).reshape(-1)] + ([selection.stream_bits] if selection.stream_bits
                                                               is not None else [])).tolist()  # fmt: skip
        selection.finish(read[: len(counts)])

    return (
        f"{name:18s} selection: compress_slots {median_ms(lambda: compress_slots(classic, [x], [slot], 1)):7.3f}"
        f"  select_sized + one read + finish {median_ms(two_halves):7.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000 if CPU else 10_000_000)
    parser.add_argument("--only", nargs="*", help="these compressors only")
    parser.add_argument("--profile", action="store_true", help="a torch.profiler table of encode + decode of none")
    args = parser.parse_args()
    if not CPU and not torch.cuda.is_available():
        print("benchmarks/cuda_encode.py: skipped, no CUDA device")
        return
    device = torch.device("cpu") if CPU else torch.device("cuda")
    if CPU:
        from gradcomp.wire.bits import set_device_path_on_cpu

        set_device_path_on_cpu(True)
    x = torch.randn(args.size, device=device)
    copy_ms = median_ms(lambda: x.clone())
    name = "CPU (smoke run)" if CPU else torch.cuda.get_device_name()
    print(f"{name}, {args.size} fp32 values ({4 * args.size / 1e6:.0f} MB); times in ms; device copy {copy_ms:.3f}")
    names = args.only or [n for n in available() if isinstance(make(n), Compressor)]
    for n in names:
        try:
            print(measure(n, x, copy_ms), flush=True)
        except Exception as exc:  # noqa: BLE001 - report it and go on
            print(f"{n:18s} error {type(exc).__name__}: {exc}", flush=True)
    for n in ("threshold", "stc", "dgc"):
        if n in names:
            try:
                print(sized_line(n, x), flush=True)
            except Exception as exc:  # noqa: BLE001 - report it and go on
                print(f"{n:18s} selection: error {type(exc).__name__}: {exc}", flush=True)
    slot = Slot(name="x", index=0, numel=x.numel())
    specs = make("none").specs(slot)
    buf = wire.encode([x], specs)
    both = median_ms(lambda: wire.encode([x], specs)) + median_ms(lambda: wire.decode(buf, specs))
    body = buf[wire.HEADER_BYTES :]
    pinned = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=not CPU)
    host = buf.cpu()
    print(
        f"none, {buf.numel() / 1e6:.1f} MB: encode + decode {both:.3f} = {both / copy_ms:.2f} x the device copy "
        f"(target <= 3); device checksum alone {median_ms(lambda: checksum64_tensor(body)):.3f} (default kernel)"
        f"; host path: to pinned memory {median_ms(lambda: pinned.copy_(buf)):.3f} + CRC pair on the host "
        f"{median_ms(lambda: checksum64(host)):.3f}"
    )
    if not CPU:
        copy_busy = busy_ms(lambda: x.clone())
        both_busy = busy_ms(lambda: wire.decode(wire.encode([x], specs), specs))
        print(f"none, GPU busy time (kernels and copies, torch.profiler): encode + decode {both_busy:.4f} = "
              f"{both_busy / copy_busy:.2f} x the device copy's {copy_busy:.4f}")
    for n in CASTS:
        try:
            print(cast_line(n, x), flush=True)
        except Exception as exc:  # noqa: BLE001 - report it and go on
            print(f"{n}: cast + checksum: error {type(exc).__name__}: {exc}", flush=True)
    gpu_times = []
    for kernel in ("torch", "triton", "triton-fast"):
        if kernel.startswith("triton") and _triton_kernel() is None:
            print(f"device checksum, {kernel} kernel: skipped (Triton cannot be imported)")
            continue
        try:
            line = "  ".join(
                f"{mb} MB {median_ms(lambda: checksum64_tensor(body[: int(mb * 10**6)], kernel=kernel)):.3f}"
                for mb in (0.001, 1, 40) if mb * 10**6 <= body.numel()
            )
            print(f"device checksum, {kernel} kernel (ms): {line}")
            if kernel.startswith("triton") and not CPU:
                gpu_times.append(f"{kernel} {busy_ms(lambda: checksum64_tensor(body, kernel=kernel)):.4f}")
        except Exception as exc:  # noqa: BLE001 - Triton may be missing
            print(f"device checksum, {kernel} kernel: {type(exc).__name__}: {exc}")
    if gpu_times:
        print(f"device checksum of {body.numel() / 1e6:.1f} MB, GPU busy time per call (ms, torch.profiler): "
              f"{'  '.join(gpu_times)}  device copy {busy_ms(lambda: body.clone()):.4f}")
    if args.profile:
        with torch.profiler.profile() as prof:
            for _ in range(5):
                wire.decode(wire.encode([x], specs), specs)
            _sync()
        print("profile of 5 encode + decode of none (self CPU time, top 15):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48))


if __name__ == "__main__":
    main()
