"""ScaleCom: cyclic local top-k (CLT-k) with a low-pass filtered error memory, as a gradcomp plugin scheme.

Paper: Chia-Yu Chen, Jiamin Ni, Songtao Lu, Xiaodong Cui, Pin-Yu Chen, Xiao Sun, Naigang Wang, Swagath
Venkataramani, Vijayalakshmi Srinivasan, Wei Zhang, Kailash Gopalakrishnan, "ScaleCom: Scalable Sparsified
Gradient Compression for Communication-Efficient Distributed Training", NeurIPS 2020.

Top-k at positions that every worker picks for itself is not summable: the union of W workers' positions grows
with W, so the messages are gathered (``topk``, ``local_topk``). ScaleCom has every worker send its values at the
SAME k positions, chosen by one worker in turn, so that they are summed by an allreduce whose size does not grow
with W. Choosing the positions is a round of its own: hence a scheme. Per exchange, per slot of d entries, with
k = ceil(density·d):

1. Every worker forms v = m + g (m: its error memory, zero at first). The leader, worker ``step mod W`` (cyclic:
   every worker's gradient chooses in turn), takes the positions P of its k largest |v| and broadcasts them, all
   slots in one wire container (a POSITIONS section per slot: sorted, bits_needed(d) bits each, checked on receipt).
2. Every worker sends v[P], all slots in one float32 sum-allreduce; the update is the mean Σ_i v_i[P] / W at P
   and 0 elsewhere, the same on every worker.
3. The paper's low-pass filtered memory: m ← (1 − β)·m + β·(v − C(v)), C(v) = v at P, 0 elsewhere. ``beta=1`` (the
   default) is plain error feedback, m = v with v[P] = 0; the paper lowers β for large batches.

Choices: the positions are a container message (checksummed; k fixed per slot, so no length round), booked as the
leader's upload (a peer broadcast); ties among the leader's |v| are broken by ``torch.topk`` (only the leader
picks, so workers need not agree on a rule); every slot is sparsified, however small (an empty slot sends nothing);
momentum stays in the optimizer. The memory is a ``SlotState`` (``gradcomp.compressors.state``): checkpointed,
restored by the exchange after a step the workers found non-finite, dropped for slots no longer exchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp import ConfigError, Slot
from gradcomp.compressors.base import kept_count
from gradcomp.compressors.state import SlotState
from gradcomp.schemes import Scheme
from gradcomp.transport.requests import AllReduce, Broadcast, Rounds
from gradcomp.wire import Codec, FieldSpec, decode, encode, encoded_size


def _fraction(name: str, value: object, meaning: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{name} ({meaning}) must be a number in (0, 1], got {value!r}")
    return float(value)


class ScaleCom(Scheme):
    name = "scalecom"

    def __init__(self, density: float = 0.01, beta: float = 1.0):
        self.density = _fraction("density", density, "the fraction of each slot's entries sent")
        self.beta = _fraction("beta", beta, "the memory's low-pass filter; 1 is plain error feedback")
        self.memory = SlotState(self.name, ("memory",))

    def params(self) -> dict:
        return {"density": self.density, "beta": self.beta}

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        flat = [t.reshape(-1).to(torch.float32) for t in tensors]
        memories = [self.memory.get("memory", s, like=g) for s, g in zip(slots, flat)]
        vs = [g.clone() if m is None else m + g for g, m in zip(flat, memories)]
        ks = [kept_count(self.density, s.numel) for s in slots]
        specs = [FieldSpec(Codec.POSITIONS, count=k, universe=s.numel) for s, k in zip(slots, ks)]

        leader = step % self.world_size  # round 1: the leader's top-k positions, to every worker
        if self.rank == leader:
            chosen = [torch.topk(v.abs(), k, sorted=False).indices.sort().values for v, k in zip(vs, ks)]
            message = encode(chosen, specs)
        else:
            message = torch.empty(encoded_size(specs), dtype=torch.uint8, device=flat[0].device)
        positions = decode((yield Broadcast(message, leader, peer=True)), specs)

        # round 2: every worker's values at those positions, summed
        summed = yield AllReduce(torch.cat([v[p] for v, p in zip(vs, positions)]), inplace=True)
        out = []
        for slot, v, m, p, total in zip(slots, vs, memories, positions, summed.split(ks)):
            update = torch.zeros_like(v)
            update[p] = total / self.world_size
            out.append(update)
            v[p] = 0  # v − C(v): what this worker did not send
            if self.beta != 1:  # (no memory yet: m = 0)
                v = v.mul_(self.beta) if m is None else m.mul_(1 - self.beta).add_(v, alpha=self.beta)
            self.memory.put("memory", slot, v)
        return out

    def state_dict(self) -> dict:
        return self.memory.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state)

    def restore_where(self, snapshot: dict, bad: Tensor) -> bool:
        return self.memory.restore_where(snapshot, bad)

    def retain(self, slots: Sequence[Slot]) -> None:
        self.memory.retain(slots)
