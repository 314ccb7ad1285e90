"""Bytes a worker uploads per step, payload and control, for the methods whose message size varies.

Simulated cluster of 4 workers, ``GradientAggregator`` with one slot per parameter tensor (one exchange per step),
each worker's real gradient on its own batch of 8 samples, the third step counted. Models: the default job's CNN on
MNIST and the byte-level Transformer on the ``pystdlib`` corpus. On the device path (``--device-path``,
the GPU's code on CPU tensors) a size exchange also carries each message's layout values (docs/wire.md, "The size
exchange of a message whose layout varies"); the host path sends lengths only. Prints a markdown table:

    GRADCOMP_KERNELS=0 .venv/bin/python scripts/size_exchange_bytes.py --device-path
    .venv/bin/python scripts/size_exchange_bytes.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gradcomp
from gradcomp.experiments.run.data import load_dataset
from gradcomp.experiments.run.models import build_model

WORKLOADS = (("cnn", "mnist"), ("transformer", "pystdlib"))
METHODS = (
    ("threshold", {"threshold": 0.01}),
    ("sbc", {"density": 0.01}),
    ("stc", {"density": 0.01}),
    ("dgc", {"density": 0.01}),
    ("topk", {"density": 0.01, "positions": "golomb"}),
)
BATCH = 8


def _worker(transport, model_name: str, data_name: str, name: str, params: dict) -> tuple[int, int]:
    data = load_dataset(data_name)
    model = build_model(model_name, data, seed=0)
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make(name, **params), transport)
    for step in range(3):
        model.zero_grad()
        at = 4 * BATCH * step + BATCH * transport.rank
        x, y = data.train_x[at : at + BATCH], data.train_y[at : at + BATCH]
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        if step == 2:
            transport.counter.reset()
        aggregator.step()
    return transport.counter.up_payload, transport.counter.up_control


def main() -> None:
    import sys

    from gradcomp.wire.bits import set_device_path_on_cpu

    set_device_path_on_cpu("--device-path" in sys.argv[1:])
    torch.set_num_threads(1)
    print("| model | method | payload | control |")
    print("|---|---|---:|---:|")
    for model_name, data_name in WORKLOADS:
        for name, params in METHODS:
            with gradcomp.SimulatedCluster(4) as cluster:
                payload, control = cluster.run(lambda t: _worker(t, model_name, data_name, name, params))[0]
            print(f"| {model_name} | {name} {params} | {payload:,} | {control:,} |")


if __name__ == "__main__":
    main()
