"""50-step parameter digests of every compressor and topology, on the simulated cluster and on 4 gloo workers.

Recorded before the exchange was rebuilt on schemes (tests/data/exchange_digests.json, written by ``python
tests/exchange_digests.py``); ``test_exchange_digests.py`` recomputes them and demands the same bytes. Re-recorded
once since, when fixed-size messages stopped exchanging their sizes: every parameter digest stayed the same and each
byte count fell by exactly the size rounds' control bytes (8 up and 8·(W−1) down per step for an all-gather, 8 up and
8·W down for a parameter server, over 50 steps). Re-recorded again when C_nat's random numbers moved from torch's
mt19937 to a counter-based SplitMix64 (for the compiled kernel): only the parameter digests of the cases that use cnat
changed (cnat, cnat-ps-both, topk+cnat), no byte count. Re-recorded on 2026-11-24 on another machine (an AVX-512
FP16 Xeon), whose float kernels round differently: every parameter digest changed there, every byte count stayed
the same (the variable-size ones too); the file now also holds ``arithmetic_fingerprint()`` of the recording
machine, and the parameter digests are compared only on a machine with the same fingerprint. Byte counts re-recorded
on 2026-12-05: every configuration that encodes a container message sends 4 bytes more up and receives 4 more down
per step (200 over 50 steps), the all-reduced flag by which the workers agree that no rank refused a message
(train.agreement.settle); the summed-only ones (none, none-model, fp16, bf16, random-k, random block) are unchanged,
and so is every parameter digest. That change went unseen for a week because the byte counts were compared only
with the parameters, on the recording machine; they are now compared on every machine.

A digest is the SHA-256 of the flat parameters after the last step, plus the bytes each worker sent up and received
down, so a changed trajectory or a changed wire format both show.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import gradcomp
from gradcomp.experiments.run.data import load_dataset, shard_indices
from gradcomp.experiments.run.models import build_model

STEPS = 50
WORLD = 4
DIGEST_FILE = Path(__file__).parent / "data" / "exchange_digests.json"

# label → (compressor, params, error feedback, topology, (server compressor, params) or None, granularity)
CONFIGS: dict[str, tuple] = {
    "none": ("none", {}, False, "auto", None, "layer"),
    "none-model": ("none", {}, False, "auto", None, "model"),
    "none-allgather": ("none", {}, False, "allgather", None, "layer"),
    "none-ps": ("none", {}, False, "ps", None, "layer"),
    "fp16": ("fp16", {}, False, "auto", None, "layer"),
    "bf16": ("bf16", {}, False, "auto", None, "layer"),
    "topk-ef": ("topk", {"density": 0.05}, True, "auto", None, "layer"),
    "topk-golomb-model": ("topk", {"density": 0.02, "positions": "golomb"}, True, "auto", None, "model"),
    "topk-ps": ("topk", {"density": 0.05}, True, "ps", ("topk", {"density": 0.1}), "layer"),
    "topk-ps-dense-down": ("topk", {"density": 0.05}, True, "ps", None, "layer"),
    "randomk-ef": ("randomk", {"density": 0.05}, True, "auto", None, "layer"),
    "randomk-scaled": ("randomk", {"density": 0.2, "scale": True}, False, "auto", None, "layer"),
    "randomk-allgather": ("randomk", {"density": 0.05}, True, "allgather", None, "layer"),
    "randomblock-ef": ("randomblock", {"density": 0.05}, True, "auto", None, "model"),
    "threshold": ("threshold", {"threshold": 0.005}, False, "auto", None, "layer"),
    "threshold-golomb": ("threshold", {"threshold": 0.005, "positions": "golomb"}, True, "auto", None, "layer"),
    "sbc": ("sbc", {"density": 0.05}, None, "auto", None, "layer"),
    "sbc-ps-both": ("sbc", {"density": 0.05}, True, "ps", ("sbc", {"density": 0.1}), "layer"),
    "stc": ("stc", {"density": 0.05}, True, "auto", None, "layer"),
    "cnat": ("cnat", {}, False, "auto", None, "layer"),
    "cnat-ps-both": ("cnat", {}, False, "ps", ("cnat", {}), "layer"),
    "natural_dithering": ("natural_dithering", {"levels": 4}, False, "auto", None, "layer"),
    "random_dithering-inf": ("random_dithering", {"levels": 8, "norm": "inf"}, False, "auto", None, "model"),
    "terngrad": ("terngrad", {}, False, "auto", None, "layer"),
    "topk+fp16": ("topk+fp16", {"density": 0.05}, True, "auto", None, "layer"),
    "topk+cnat": ("topk+cnat", {"density": 0.05}, True, "auto", None, "layer"),
}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:20]


def arithmetic_fingerprint(steps: int = 5) -> str:
    """A digest of this machine's float arithmetic for the runs below, without any exchange: the synthetic data,
    the MLP's initialisation and a few SGD steps on one process, one thread.

    torch picks its CPU kernels by instruction set (AVX2, AVX-512, AVX-512 FP16, …) and MKL / oneDNN pick theirs
    by processor, and the kernels round differently in the last bits (seen: the same torch 2.13.0 wheel gave other
    data, gradients and 50-step parameters on an AVX-512 FP16 Xeon than on the machine the digests were first
    recorded on). Where this fingerprint differs from the recorded one, the recorded parameters cannot be
    reproduced and the comparison is skipped, saying so.
    """
    torch.set_num_threads(1)
    data = load_dataset("synthetic")
    model = build_model("mlp", data, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        batch = slice(16 * step, 16 * step + 16)
        F.cross_entropy(model(data.train_x[batch]), data.train_y[batch]).backward()
        optimizer.step()
    return digest(torch.cat([data.train_x.reshape(-1), *(p.detach().reshape(-1) for p in model.parameters())]))


def run(transport, label: str, steps: int = STEPS) -> dict:
    """Train the synthetic MLP for ``steps`` steps over ``transport`` with config ``label``."""
    name, params, ef, topology, server, granularity = CONFIGS[label]
    data = load_dataset("synthetic")
    model = build_model("mlp", data, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    server_compressor = gradcomp.make(server[0], error_feedback=True, **server[1]) if server else None
    transport.counter.reset()
    aggregator = gradcomp.GradientAggregator(
        model, gradcomp.make(name, error_feedback=ef, **params), transport,
        topology=topology, server_compressor=server_compressor, granularity=granularity,
    )
    rows = shard_indices(data.num_train, transport.rank, transport.world_size, epoch=0, seed=0)
    for step in range(steps):
        batch = rows[(step * 16) % (len(rows) - 16):][:16]
        optimizer.zero_grad()
        F.cross_entropy(model(data.train_x[batch]), data.train_y[batch]).backward()
        aggregator.step()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": digest(flat), "bytes_up": transport.counter.bytes_up, "bytes_down": transport.counter.bytes_down}


def simulated(labels=None) -> dict[str, dict]:
    torch.set_num_threads(1)
    out = {}
    for label in labels or CONFIGS:
        with gradcomp.SimulatedCluster(WORLD, timeout=120) as cluster:
            per_rank = cluster.run(lambda t, label=label: run(t, label))
        out[label] = _merge(label, per_rank, "simulated")
    return out


def real_worker(rank: int, world_size: int, labels) -> dict:
    from gradcomp.transport.dist import DistTransport

    transport = DistTransport()
    return {label: run(transport, label) for label in labels}


def real(labels=None) -> dict[str, dict]:
    sys.path.insert(0, str(Path(__file__).parent))
    from distributed import run_workers

    labels = list(labels or CONFIGS)
    per_rank = run_workers(real_worker, WORLD, labels, timeout=500)
    return {label: _merge(label, [r[label] for r in per_rank], "gloo") for label in labels}


def _merge(label: str, per_rank: list[dict], where: str) -> dict:
    """One parameter digest (replicas must agree) and every rank's byte counts (messages may differ in size)."""
    assert all(r["params"] == per_rank[0]["params"] for r in per_rank), f"{label}: {where} replicas differ"
    return {
        "params": per_rank[0]["params"],
        "bytes_up": [r["bytes_up"] for r in per_rank],
        "bytes_down": [r["bytes_down"] for r in per_rank],
    }


if __name__ == "__main__":
    record = {
        "steps": STEPS,
        "world": WORLD,
        "torch": torch.__version__,
        "arithmetic": arithmetic_fingerprint(),
        "simulated": simulated(),
        "gloo": real(),
    }
    DIGEST_FILE.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DIGEST_FILE}")
