"""Where the time of encoding and decoding a message on a CUDA device goes (docs/gpu.md).

The container's checksum is a CRC pair computed on the host (gradcomp.wire.checksum), so a message on a GPU
crosses to the host once when encoded and once when decoded. For a 10M-element fp32 gradient on the current
device, per compressor: compress, encode and decode (median of 7, synchronised), and beside them the parts:
the device-to-host copy into pageable memory (what ``tensor.cpu()`` does), the same copy into pinned memory
(what ``wire.checksum.to_host`` does), and the CRC pair over the host bytes.

    python benchmarks/cuda_encode.py [--size N]
"""

from __future__ import annotations

import argparse
import time

import torch

from gradcomp import make, wire
from gradcomp.compressors.base import Slot
from gradcomp.wire.checksum import checksum64


def median_ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return sorted(times)[repeats // 2] * 1e3


def measure(name: str, x: torch.Tensor) -> str:
    """One compressor's line of the report."""
    slot = Slot(name="x", index=0, numel=x.numel())
    compressor = make(name)
    fields, specs = compressor.compress(x, slot, 0), compressor.specs(slot)
    buf = wire.encode(fields, specs)
    host = buf.cpu()
    pinned = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    return (
        f"{name:5s} {buf.numel() / 1e6:6.2f} MB  compress {median_ms(lambda: compressor.compress(x, slot, 1)):6.2f}"
        f"  encode {median_ms(lambda: wire.encode(fields, specs)):6.2f}"
        f"  decode {median_ms(lambda: wire.decode(buf, specs)):6.2f}"
        f"  | to pageable host memory {median_ms(lambda: buf.cpu()):6.2f}"
        f"  to pinned {median_ms(lambda: pinned.copy_(buf)):5.2f}"
        f"  CRC pair on the host {median_ms(lambda: checksum64(host)):5.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000_000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    x = torch.randn(args.size, device="cuda")
    print(f"{torch.cuda.get_device_name()}, {args.size} fp32 values; times in ms")
    for name in ("none", "fp16", "cnat", "topk"):
        print(measure(name, x))


if __name__ == "__main__":
    main()
