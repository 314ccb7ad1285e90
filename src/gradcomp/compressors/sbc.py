"""Sparse Binary Compression (SBC) and its ternary variant STC.

Sattler, Wiedemann, Müller, Samek, "Sparse Binary Compression: Towards Distributed Deep Learning with
minimal Communication", IJCNN 2019; STC from Sattler et al., "Robust and Communication-Efficient Federated
Learning from Non-IID Data", IEEE TNNLS 2019.

``sbc`` — sparse binarization, per tensor, of the accumulated update A (the residual is added by the
ErrorFeedback wrapper, which SBC turns on by default — the paper's "residual accumulation"):

    k   = ceil(p · numel)
    μ+  = mean of the k largest entries of A          (the k largest positive values)
    μ−  = mean of the k largest entries of −A         (magnitudes of the k most negative values)
    if μ+ >= μ−: send the positions of the k largest entries, all carrying +μ+
    else:        send the positions of the k most negative entries, all carrying −μ−

On the wire: the sorted positions, Golomb–Rice coded with b* = 1 + floor(log2(ln(φ−1) / ln(1−p)))
(``positions="golomb"``, the default; ``"fixed"`` bit-packs them), and ONE fp32 number, the signed mean:
its sign bit is the paper's per-tensor sign bit, so nothing else travels. Everything not sent — the other
entries and the difference between the kept entries and μ — stays in the residual.

``stc`` — sparse ternary: keep the k entries of largest magnitude (both signs), send their positions, one
sign bit each (bit-packed) and ONE shared magnitude μ = mean |A| over the kept entries. As in the paper's
algorithm (μ = Σ|kept| / k; the message is μ·sign(kept)), a kept entry that is exactly zero carries 0: it is
left out of the message, which then holds fewer than k positions (a tensor with fewer than k nonzero entries);
μ is still the sum over k. (A one-bit sign cannot say 0, so such an entry sent would arrive as +μ.) Its Golomb positions
use SBC's b* of the configured density p = k / d, also in a message with fewer than k positions: the encoder then
needs no count to choose it, and on a GPU the stream's length is computed before the count is read.

Choices where the papers are silent: ties between μ+ and μ− go to the positive side; if a tensor has fewer
than k positive (negative) entries, the k largest (smallest) still fill up with entries of the other sign
or zeros, exactly as ``torch.topk`` returns them, and their mean is used as is; the side is chosen with
``torch.where`` on the device, without a host synchronisation.

Speed: on the CPU, where k <= d/64, both select by sampled thresholds with exact selection among the
candidates above them (``_both_sides``; stc through ``sparse.topk_positions``) instead of ``torch.topk``
over all d entries, and fall back to ``torch.topk`` wherever that route cannot vouch for the same set. The
means are sums in a fixed order, so they are taken over the kept values in decreasing order, the order in
which ``torch.topk`` returns them on that path: the messages are bit-identical to the earlier ones
(tests/test_wire_stability.py). A mean whose float32 sum overflows (entries near float32's largest, ~3e38 / k) is
taken in float64 instead, by ``torch.where`` (nothing read): the mean of finite entries is finite, and every other
mean keeps its bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from gradcomp.compressors import sparse
from gradcomp.compressors.base import Capabilities, Compressor, Fields, SizedSelection, Slot, compress_each
from gradcomp.compressors.sparse import (
    KeptCount,
    check_positions_codec,
    compact,
    fast_topk_applies,
    keep_largest,
    kth_largest,
    magnitude_candidates,
    position_spec,
    sample_rank,
    strided_sample,
    topk_positions,
)
from gradcomp.wire import Codec, FieldSpec, optimal_rice_parameter
from gradcomp.wire.refusals import check_received_range
from gradcomp.wire.golomb import golomb_stream_bits


def _decreasing(values: Tensor) -> Tensor:
    """``values`` (float32, sign bits clear: magnitudes, or one side's values above a positive threshold) in
    decreasing order: the order ``torch.topk`` returns its values in on the CPU when 64·k <= d (its partial-sort
    path), hence the order in which the means below have always been summed. Sorted as int32 bit patterns,
    whose order is the float order for non-negative floats (NaN last) and which torch sorts several times
    faster than float32."""
    return torch.sort(values.contiguous().view(torch.int32)).values.flip(0).view(torch.float32)


def _both_sides(flat: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """SBC's two selections by sampled thresholds: (positions of the k largest entries, their values in
    decreasing order, positions of the k most negative entries, their negated values in decreasing order),
    positions increasing — exactly what ``torch.topk(flat, k)`` and ``torch.topk(-flat, k)`` select — or None
    where the sampled route cannot vouch for that (the caller then runs torch.topk, as before).

    One sample gives each side its threshold (tau+ from the sample, tau- from the negated sample); one pass
    collects every entry with |x| >= min(tau+, tau-); each side keeps its k largest among its candidates
    (:func:`gradcomp.compressors.sparse.keep_largest`). None when a side has fewer than k candidates or a tie
    at its k-th value, a threshold is not positive (fewer than about k entries of that sign), or a NaN shows.
    """
    if not fast_topk_applies(flat, k):
        return None
    sample = strided_sample(flat, k)
    r = sample_rank(sample.numel(), k, flat.numel())
    tau_positive, tau_negative = kth_largest(sample, r), kth_largest(sample.neg_(), r)
    if not (tau_positive > 0.0 and tau_negative > 0.0):
        return None
    candidates = magnitude_candidates(flat, min(tau_positive, tau_negative), "ge_or_nan").numpy()
    values = torch.index_select(flat, 0, torch.from_numpy(candidates)).numpy()  # CPU only (fast_topk_applies)
    if np.isnan(values).any():
        return None
    sides = []
    for side, tau in ((values, tau_positive), (np.negative(values), tau_negative)):
        mine = side >= np.float32(tau)  # every entry of this side above its own threshold is a candidate
        if int(np.count_nonzero(mine)) < k:
            return None
        kept = keep_largest(torch.from_numpy(np.compress(mine, candidates)), torch.from_numpy(side[mine]), k)
        if kept is None:
            return None
        sides += [kept[0], _decreasing(kept[1])]
    return sides[0], sides[1], sides[2], sides[3]

def _mean(values: Tensor) -> Tensor:
    """``values.mean()`` (float32), or its float64 mean where the float32 sum overflowed."""
    mean = values.mean()
    return torch.where(torch.isfinite(mean), mean, values.mean(dtype=torch.float64).to(torch.float32))


class _SharedValueSparsifier(Compressor):
    """Messages whose kept entries share one magnitude: [positions, (signs), value]."""

    default_error_feedback: ClassVar[bool] = True

    def __init__(self, density: float | None = None, positions: str = "golomb", *, k: int | None = None):
        self.count = KeptCount(density, k)
        self.positions = check_positions_codec(positions)

    @property
    def density(self) -> float | None:
        return self.count.density

    def params(self) -> dict:
        return {**self.count.params(), "positions": self.positions}

    def _positions_spec(self, slot: Slot) -> FieldSpec:
        return position_spec(self.positions, slot.numel, self.count(slot))


class SparseBinary(_SharedValueSparsifier):
    capabilities = Capabilities(accumulate=True, sent_entries=True)
    name = "sbc"

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [self._positions_spec(slot), FieldSpec(Codec.F32, count=1)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1).to(torch.float32)
        k = self.count(slot)
        if k == 0:
            return [torch.zeros(0, dtype=torch.int64, device=flat.device), torch.zeros(1, device=flat.device)]
        sides = _both_sides(flat, k)
        if sides is None:
            top_values, top_positions = torch.topk(flat, k, sorted=False)
            bottom_values, bottom_positions = torch.topk(-flat, k, sorted=False)
            top_positions, bottom_positions = torch.sort(top_positions).values, torch.sort(bottom_positions).values
        else:
            top_positions, top_values, bottom_positions, bottom_values = sides
        mean_positive, mean_negative = _mean(top_values), _mean(bottom_values)
        positive = mean_positive >= mean_negative
        chosen = torch.where(positive, top_positions, bottom_positions)
        signed_mean = torch.where(positive, mean_positive, -mean_negative)
        return [chosen, signed_mean.reshape(1)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        positions, signed_mean = fields
        out = torch.zeros(slot.numel, dtype=torch.float32, device=signed_mean.device)
        out[positions] = signed_mean.to(torch.float32)
        return out

    def sent_entries(self, fields: Fields, slot: Slot, step: int) -> tuple[Tensor, Tensor]:
        positions, signed_mean = fields
        return positions, signed_mean.to(torch.float32).reshape(-1).expand(positions.numel())

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        positions, signed_mean = fields
        out.index_add_(0, positions, signed_mean.to(out.dtype).expand(positions.numel()))


class SparseTernary(_SharedValueSparsifier):
    capabilities = Capabilities(accumulate=True, sent_entries=True, select_sized=True, compress_slots=True)
    name = "stc"

    def specs(self, slot: Slot) -> list[FieldSpec]:
        # at most k positions: kept entries that are exactly zero are not sent (their ternary value is 0). Golomb
        # positions are coded with the Rice parameter of the density k / d, as the paper's b*(p), whatever the count
        # sent: the encoder then knows it before the count is read, and a device can size the stream without a read
        k = self.count(slot)
        positions = replace(self._positions_spec(slot), count=None, max_count=k)
        if positions.codec == Codec.GOLOMB:
            positions = replace(positions, golomb_b=optimal_rice_parameter(k / slot.numel if slot.numel else 1.0))
        return [positions, FieldSpec(Codec.BITS, max_count=k, width=1, same_count_as=-1), FieldSpec(Codec.F32, count=1)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        kept = self._kept(x, slot)
        if kept is None:
            return self._empty(x.device)
        nonzero = kept[1] != 0
        return self._message(*kept, nonzero, int(nonzero.sum()))  # the one read of this slot's count

    def compress_slots(self, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int) -> list[Fields]:
        """On the torch path (a GPU's), every slot's top-k first, then the counts of their nonzero entries read
        back together once, not once per slot; the messages of ``compress``, byte for byte."""
        if not tensors or sparse._numpy_path(tensors[0]):
            return compress_each(self, tensors, slots, step)
        kept = [self._kept(x, slot) for x, slot in zip(tensors, slots)]
        nonzero = [None if k is None else k[1] != 0 for k in kept]
        sums = [n.sum() for n in nonzero if n is not None]
        counts = iter(torch.stack(sums).tolist() if sums else [])  # the one read of this message's counts
        return [
            self._empty(x.device) if k is None else self._message(*k, n, next(counts))
            for x, k, n in zip(tensors, kept, nonzero)
        ]

    def select_sized(self, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int) -> SizedSelection | None:
        """The device path's two halves of ``compress_slots``: every slot's top-k, the counts of their nonzero
        entries and their Golomb streams' lengths (of the nonzero entries' positions, ``golomb_stream_bits`` with
        ``kept``) left on the device, read by the caller with its size exchange; then the messages."""
        if sparse._numpy_path(tensors[0]):
            return None
        kept = [self._kept(x, slot) for x, slot in zip(tensors, slots)]
        nonzero = [None if k is None else k[1] != 0 for k in kept]
        counts: list[list[int | Tensor]] = [[0, 0, 1] if n is None else [n.sum(), n.sum(), 1] for n in nonzero]
        bits = None
        if self.positions == "golomb":
            device = tensors[0].device
            b = [spec.golomb_b for slot in slots for spec in self.specs(slot)[:1]]
            bits = torch.stack([
                torch.zeros((), dtype=torch.int64, device=device) if k is None else golomb_stream_bits(k[0], bi, n)
                for k, n, bi in zip(kept, nonzero, b)
            ])

        def finish(values: list[int]) -> list[Fields]:
            sent = iter(values[::2])  # (each slot's positions' count, then its signs')
            return [
                self._empty(x.device) if k is None else self._message(*k, n, next(sent))
                for x, k, n in zip(tensors, kept, nonzero)
            ]

        return SizedSelection(counts, finish, bits)

    def _kept(self, x: Tensor, slot: Slot) -> tuple[Tensor, Tensor, Tensor] | None:
        """(positions, values, mean magnitude) of the k largest |x|, or None when k = 0."""
        flat = x.reshape(-1).to(torch.float32)
        k = self.count(slot)
        if k == 0:
            return None
        if fast_topk_applies(flat, k):
            positions = topk_positions(flat, k)
            values = torch.index_select(flat, 0, positions)
            magnitudes = _decreasing(values.abs())  # torch.topk's value order here: the same mean, bit for bit
        else:
            magnitudes, positions = torch.topk(flat.abs(), k, sorted=False)
            positions = torch.sort(positions).values
            values = torch.index_select(flat, 0, positions)
        magnitude = _mean(magnitudes).reshape(1)  # over all k, zeros included: the paper's mu = sum|kept| / k
        return positions, values, magnitude

    @staticmethod
    def _empty(device: torch.device) -> Fields:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return [empty, empty, torch.zeros(1, device=device)]

    @staticmethod
    def _message(positions: Tensor, values: Tensor, magnitude: Tensor, nonzero: Tensor, sent: int) -> Fields:
        """The fields, given which kept values are nonzero and how many (``sent``, read by the caller)."""
        if sent < values.numel():  # fewer than k nonzero entries: sign(0) = 0, so they are not sent
            at = compact(nonzero, sent)  # their indices, with the size read: no boolean indexing
            positions, values = positions[at], values[at]
        negative = (values < 0).to(torch.int64)
        return [positions, negative, magnitude]

    def _values(self, fields: Fields) -> tuple[Tensor, Tensor]:
        positions, negative, magnitude = fields
        signs = 1.0 - 2.0 * negative.to(torch.float32)
        return positions, signs * magnitude.to(torch.float32)

    def _received(self, fields: Fields, slot: Slot) -> tuple[Tensor, Tensor]:
        """``_values`` of a received message, checked: WireError (``wire.refusals.check_received``) for a
        magnitude below 0, which no sender makes (every sent sign flipped). A worker's own message
        (``sent_entries``, for error feedback) is not checked."""
        check_received_range(fields[2].reshape(-1).to(torch.float32), 0.0, None, f"stc: {slot.name}: a negative mean")
        return self._values(fields)

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        positions, values = self._received(fields, slot)
        out = torch.zeros(slot.numel, dtype=torch.float32, device=values.device)
        out[positions] = values
        return out

    def sent_entries(self, fields: Fields, slot: Slot, step: int) -> tuple[Tensor, Tensor]:
        return self._values(fields)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        positions, values = self._received(fields, slot)
        out.index_add_(0, positions, values.to(out.dtype))
