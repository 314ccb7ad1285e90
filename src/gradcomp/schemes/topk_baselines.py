"""The two baselines of the sketched-SGD paper: local top-k and true top-k, on worker momentum + accumulation.

Ivkin et al. (NeurIPS 2019) compare sketched SGD (``gradcomp.schemes.sketch``) with two ways of sending k
coordinates of the same worker state (u ← ρ·u + g, v ← v + u; ``gradcomp.schemes.accumulation``):

``local_topk``
    Every worker sends its own k largest |v| as (32-bit coordinate, float32 value) pairs in one container
    message (``gradcomp.wire``: checksummed and checked on receipt, coordinates against their slot's size); one
    allgather of one fixed-size buffer per step (every worker's k is the same, so no size exchange and no
    padding); every worker sums the W sparse vectors in rank order and divides by W. A worker zeroes u and v
    at the coordinates *it* sent. Up per worker: 8·Σk (+ 4·dense) bytes, plus 40 of framing; down: (W − 1)
    times that — the union of the workers' selections grows with W, which is what sketched SGD avoids.

``true_topk``
    The k largest coordinates of Σ_workers v, i.e. what sketched SGD approximates. It is an **oracle**: it
    needs the dense sum, so it allreduces every worker's full v (d floats), and its bits up and down are
    those of an uncompressed fp32 allreduce. It shows the accuracy that a perfect selection of k coordinates
    would reach; it saves no communication. Every worker zeroes u and v at the same k coordinates.

Both: ``k`` or ``density`` (default 0.01), ``momentum`` (0.9, applied by the method: ``owns_momentum``),
``min_size`` (1000: smaller slots go dense, see ``gradcomp.schemes.accumulation``). Ties are broken by the
lower coordinate. Dense slots travel in the same collective: in local top-k's allgather (so their bytes down
grow with W as well) and in true top-k's allreduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp.compressors.base import Slot
from gradcomp.protocols import allgather_buffers
from gradcomp.schemes.accumulation import (
    AccumulatingScheme,
    floats_spec,
    indices_spec,
    largest,
    offsets_of,
    split_indices,
)
from gradcomp.transport.requests import AllReduce, Rounds
from gradcomp.wire import decode, encode, encoded_size
from gradcomp.wire.device import DeviceChecks, hold_for_the_pass


class LocalTopK(AccumulatingScheme):
    name = "local_topk"

    def defers_verdict(self, slots: Sequence[Slot]) -> bool:
        return True  # k per slot follows from the slot: every message's size is fixed

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        ks = [self.kept(s) for s in slots]  # raises before anything is sent
        us, vs = self.accumulate(slots, tensors, ks)
        device = us[0].device
        squeezed = [i for i, k in enumerate(ks) if k]
        dense = [i for i, k in enumerate(ks) if not k]

        # message: a container of float32 [k values per compressed slot | dense slots' u], 32-bit [k coordinates]
        mine: dict[int, Tensor] = {i: largest(vs[i], ks[i]) for i in squeezed}  # type: ignore[arg-type]
        floats = torch.cat([vs[i][mine[i]] for i in squeezed] + [us[i] for i in dense])  # type: ignore[index]
        ints = torch.cat([mine[i] for i in squeezed] + [floats.new_empty(0, dtype=torch.int64)])
        specs = [floats_spec(floats.numel()), indices_spec(ints.numel())]
        gathered = yield from allgather_buffers(self.rank, encode([floats, ints], specs),
                                                [encoded_size(specs)] * self.world_size)  # fmt: skip

        value_starts = offsets_of([ks[i] for i in squeezed] + [slots[i].numel for i in dense])
        out: list[Tensor] = [torch.zeros(s.numel, dtype=torch.float32, device=device) for s in slots]
        later = DeviceChecks()  # device buffers: every message's checks read in one transfer, after the loop
        with later.collecting():
            for received in gathered:  # rank order: the same sums on every worker
                their_floats, their_ints = decode(received, specs, later)
                coords = split_indices(their_ints, [ks[i] for i in squeezed], [slots[i].numel for i in squeezed],
                                       "local_topk message")  # fmt: skip
                for n, i in enumerate(squeezed):
                    out[i].index_add_(0, coords[n], their_floats[value_starts[n] : value_starts[n + 1]])
                for n, i in enumerate(dense, start=len(squeezed)):
                    out[i].add_(their_floats[value_starts[n] : value_starts[n + 1]])
        if not hold_for_the_pass(later):  # (the DDP hook's backward pass reads them at its end)
            later.read()
        for i in squeezed:
            self.memory.sent(slots[i], mine[i])  # u, v = 0 at the coordinates this worker sent
        return [t.div_(self.world_size) for t in out]


class TrueTopK(AccumulatingScheme):
    name = "true_topk"

    def defers_verdict(self, slots: Sequence[Slot]) -> bool:
        return True  # k per slot follows from the slot: every message's size is fixed

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        ks = [self.kept(s) for s in slots]  # raises before anything is sent
        us, vs = self.accumulate(slots, tensors, ks)
        # the oracle's dense allreduce: every compressed slot's v, every dense slot's u
        buf = torch.cat([vs[i] if k else us[i] for i, k in enumerate(ks)])  # type: ignore[list-item]
        summed = yield AllReduce(buf, inplace=True)
        offsets = offsets_of([s.numel for s in slots])
        out: list[Tensor] = []
        for i, (slot, k) in enumerate(zip(slots, ks)):
            part = summed[offsets[i] : offsets[i + 1]]
            if not k:
                out.append(part.div(self.world_size))
                continue
            top = largest(part, k)
            result = torch.zeros(slot.numel, dtype=torch.float32, device=part.device)
            result[top] = part[top].div(self.world_size)
            out.append(result)
            self.memory.sent(slot, top)
        return out
