"""Deep Gradient Compression (DGC): sampled-threshold sparsification of momentum-corrected, masked velocity.

Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth for Distributed
Training", ICLR 2018.

``dgc`` is one compressor that applies momentum itself (``owns_momentum``: ``gradcomp train`` sets the
optimizer's momentum to 0 and says so; the method's own ``momentum`` defaults to 0.9). For every slot (a
parameter tensor with the default layer granularity, the whole model with granularity ``model``) and
exchange index ``step`` it does, in this order:

1. **Local gradient clipping** (``clip``, off by default): g ← g · min(1, clip / ||g||_2), per slot, before
   anything is accumulated (the norm is computed in float64, so huge entries do not overflow it). DGC
   clips each worker's gradient and scales the global clipping threshold by N^(-1/2) for N workers (the
   worker's share of the global norm if all N gradients were i.i.d. Gaussian). A compressor is not told N,
   so ``clip`` is used exactly as given, on every worker: to follow the paper pass the global threshold
   times N^(-1/2) (e.g. ``clip=2.5`` for a global 5 on 4 workers).
2. **Momentum correction and momentum factor masking**, the arithmetic of :class:`gradcomp.compressors.state.Momentum`
   that :class:`gradcomp.feedback.MomentumCorrection` (``masking=True``) uses too::

       u = m·u + g          velocity (m = ``momentum``)
       v = v + u            accumulated velocity: what this worker would like to send
       send the selection of v (step 3)
       v = v − sent         what was sent leaves, the rest waits
       u = 0 where sent ≠ 0 momentum factor masking

   u and v start at 0 (the first step sends from v = u = g) and are float32, keyed by the slot's name and
   size (checkpointed by ``state_dict``; dropped by ``retain``). Masking resets the momentum of whatever is
   sent: at density 1 (everything sent every step) u is always 0 and ``dgc`` is SGD without momentum.
   v − sent and the masking touch only the sent positions (the message is sparse): no dense decompressed
   message is built.
3. **Selection by a sampled threshold** (the paper's "sampling to reduce top-k selection time": top-k on a
   0.1 %–1 % sample to estimate the threshold, then, if far more than expected pass it, a precise
   threshold from the already selected gradients). With p the step's density (step 4), d = slot size and
   k = ceil(p·d) (at least 1):

   - draw n_s = max(ceil(``sample``·d), ceil(2 / p)) coordinates uniformly *with replacement* from a
     generator seeded by (``seed``, step, slot index, "dgc", worker) — fresh every step and tensor,
     reproducible, and different on every worker (the exchange gives each worker's compressor its rank,
     ``bind_worker``), since every worker selects from its own v. The floor ceil(2/p) makes the sample keep
     at least 2 values, so the threshold is never just the largest sampled value (as in the authors' code);
     when n_s >= d, and always at density 1, the "sample" is all of |v| and the result is exact top-k;
   - first threshold tau = the r-th largest sampled |v|, r = n_s·k/d + 4·sqrt(n_s·k/d) + 4 (at most n_s):
     the expected number of top-k entries among the draws plus four standard deviations
     (``sparse.sample_rank``), so tau lies below the k-th largest |v| unless the sample is four sigmas off.
     The paper keeps a fraction p of the sample (r = ceil(p·n_s)); that tau is above the k-th largest on
     about half of the steps, and a selection that stops there sends fewer than k (docs/methods/dgc.md says
     how many). When n_s >= d, tau is the k-th largest;
   - candidates = every coordinate with |v| >= tau (and |v| > 0: a zero is never sent);
   - fewer than k candidates (rare): tau is lowered to the 4r-th, 16r-th, ... largest sample and the pass
     repeated (a rank whose value is not lower costs no pass), and if the sample runs out every nonzero
     coordinate is a candidate. The authors' public code lowers tau up to 10 times by ×0.8 until 0.8·k pass;
     gradcomp always ends with k candidates, or with every nonzero coordinate when there are fewer than k;
   - keep the exact top-k of |v| among the candidates only (``torch.topk``-equivalent, on about r·d/n_s
     values instead of all d): every candidate is >= tau > every other coordinate, so this IS the exact
     top-k of |v| (ties at the k-th value broken by torch). Every step sends k values (fewer only when v
     has fewer than k nonzero entries).

   On the device path of a gathered exchange (a GPU's), the selection is ``torch.topk`` over all of |v| instead
   (``DGC.select_sized``): the same k largest |v| except which entries a tie at the k-th value keeps, and no
   count of candidates to read before the size exchange (the sampled threshold's would cost two reads a message).

   The cost is one pass over the d entries (|v| >= tau, chunked through cache-sized scratch:
   ``gradcomp.compressors.sparse.magnitude_candidates``), rarely two, plus top-k over n_s + O(k) values,
   instead of ``torch.topk`` over all d. The k largest candidates are found by ``sparse.keep_largest`` (a
   selection), and by ``torch.topk`` on the candidates where the k-th largest is tied, as always.
4. **Exponential sparsity warm-up** (``warmup_steps``, off = 0): the density is 0.25, 0.0625, 0.015625,
   0.004 in the first four stages of ``warmup_steps`` exchanges each (sparsity 75 %, 93.75 %, 98.4375 %,
   99.6 %), then ``density`` (99.9 % for the default 0.001). A stage's density is never below ``density``
   (a warm-up does not make the message sparser than the target). The paper counts stages in epochs (four
   epochs of warm-up); gradcomp passes the compressor the exchange index, so the stage length is given in
   exchanges (training steps when gradients are exchanged every step): one epoch of MNIST with 4 workers
   and batch 32 is 468 exchanges.

Message: [sorted positions, their fp32 values], the same layout as ``threshold`` (a variable count, at most
d; the receiver learns it from the section headers); positions Golomb–Rice coded (``positions="golomb"``,
the default, because it is the shorter: at density 1e-3 about 12 bits per position, where ``"fixed"``
spends ceil(log2 d) = 18 bits on a 200k-entry layer, 24 on a 10M one) or bit-packed (``"fixed"``; encoding
is faster, the message longer; docs/methods/dgc.md). Messages are gathered (not
summable) and the update is their mean, as in the authors' code (an allgather of values and indices, then an
average). Not unbiased; no omega.

Parameters: ``density`` in (0, 1] (default 0.001: top-0.1 %), ``momentum`` in [0, 1) (0.9), ``sample`` in
(0, 1] (0.01), ``clip`` None or > 0 (None), ``warmup_steps`` >= 0 (0), ``positions`` "golomb" or "fixed"
("golomb"), ``seed`` >= 0 (0). Bad ones raise ConfigError when the compressor is built.

Left out: DGC's Nesterov option, and fp16 values and int32 indices (the wire carries fp32 values and coded
positions). Weight decay is folded into the gradient before compression, as in DGC: ``gradcomp train`` adds
it to each gradient before the exchange for methods that own their momentum (0 by default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors import sparse
from gradcomp.compressors import base
from gradcomp.compressors.base import (
    Capabilities,
    Compressor,
    Fields,
    SizedSelection,
    Slot,
    check_density,
    check_int,
    compress_each,
    kept_count,
    shared_generator,
)
from gradcomp.compressors.sparse import (
    _PositionsAndValues,
    check_positions_codec,
    compact,
    keep_largest,
    magnitude_candidates,
    position_spec,
    sample_rank,
)
from gradcomp.compressors.state import Momentum
from gradcomp.errors import ConfigError
from gradcomp.wire import Codec, FieldSpec
from gradcomp.wire.golomb import golomb_stream_bits, rice_parameter_on_device

__all__ = [
    "DGC", "MIN_SAMPLE_KEPT", "WARMUP_DENSITIES", "SampledThresholdTopK", "clip_norm", "sample_count", "warmup_density",
]

WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)  # sparsity 75 %, 93.75 %, 98.4375 %, 99.6 %
MIN_SAMPLE_KEPT = 2  # the sample always keeps at least this many values: n_s >= ceil(2 / p)
RETRY_MARGIN = 4.0  # sigmas: a lowered tau lets fewer than k through only if the sample is this far off
_SMALLEST = 2.0**-149  # the smallest positive float32: |v| >= max(tau, this) never selects a zero


def warmup_density(density: float, warmup_steps: int, step: int) -> float:
    """The density of exchange ``step``: the warm-up stage's (never below ``density``), then ``density``."""
    if warmup_steps > 0:
        stage = max(0, step) // warmup_steps
        if stage < len(WARMUP_DENSITIES):
            return max(WARMUP_DENSITIES[stage], density)
    return density


def _largest(samples: Tensor, rank: int) -> Tensor:
    """The ``rank``-th largest of ``samples`` (NaN counts as largest: a NaN among the ``rank`` largest gives NaN)."""
    return torch.topk(samples, rank, sorted=False).values.min()


def sample_count(density: float, sample: float, numel: int) -> int:
    """n_s = max(ceil(sample·d), ceil(MIN_SAMPLE_KEPT / p)), or d at density 1; all of |v| is used if n_s >= d."""
    if density >= 1.0:
        return numel  # keep everything: a sample's minimum is no bound for the whole tensor's
    return max(kept_count(sample, numel), math.ceil(MIN_SAMPLE_KEPT / Fraction(repr(density))))


class SampledThresholdTopK(_PositionsAndValues):
    """DGC's selection (step 3 of the module docstring) at the warm-up schedule's density (step 4).

    Stateless: the sample is drawn afresh from (seed, step, slot index, worker). Not registered on its own;
    :class:`DGC` wraps it in momentum correction.
    """

    capabilities = _PositionsAndValues.capabilities
    name = "dgc"

    def __init__(self, density: float, sample: float, warmup_steps: int, positions: str, seed: int):
        self.density, self.sample = density, sample
        self.warmup_steps, self.positions, self.seed = warmup_steps, positions, seed

    def density_at(self, step: int) -> float:
        return warmup_density(self.density, self.warmup_steps, step)

    def specs(self, slot: Slot) -> list[FieldSpec]:
        # one value per position: the decoder refuses sections whose counts disagree
        values = FieldSpec(Codec.F32, max_count=slot.numel, same_count_as=-1)
        return [position_spec(self.positions, slot.numel), values]

    def generator(self, slot: Slot, step: int, device: torch.device) -> torch.Generator:
        return shared_generator(self.seed, step, slot.index, device, salt=f"dgc:{self.worker}")

    def sampled_magnitudes(self, values: Tensor, slot: Slot, step: int) -> Tensor:
        """The n_s sampled |v| (a new tensor), or all of |v| when n_s >= d (``sample_count``)."""
        d = values.numel()
        n = sample_count(self.density_at(step), self.sample, d)
        if n < d:
            picks = torch.randint(d, (n,), generator=self.generator(slot, step, values.device), device=values.device)
            return torch.index_select(values, 0, picks).abs_()
        return values.abs()

    def first_rank(self, n: int, k: int, d: int) -> int:
        """Which of the n sampled magnitudes is the first tau: the k-th largest when the sample is all of |v|
        (n >= d: tau is exact), else the expected number of top-k entries in the sample (p·n) plus
        ``RETRY_MARGIN`` standard deviations and 4 (:func:`~gradcomp.compressors.sparse.sample_rank`)."""
        return min(n, k) if n >= d else sample_rank(n, k, d, RETRY_MARGIN)

    def threshold(self, magnitude: Tensor, slot: Slot, step: int) -> Tensor:
        """The first tau: the ``first_rank``-th largest of n_s sampled magnitudes (of all of them when n_s >= d).

        ``magnitude`` may also be the signed values: only the magnitudes of the sampled entries are used (the
        abs is taken of the n_s samples, not of all d entries).
        """
        d = magnitude.numel()
        samples = self.sampled_magnitudes(magnitude, slot, step)
        return _largest(samples, self.first_rank(samples.numel(), kept_count(self.density_at(step), d), d))

    def select(self, values: Tensor, slot: Slot, step: int) -> Tensor:
        """Sorted positions of the top-k of |v| (every nonzero entry if fewer than k are nonzero).

        ``values`` is v or |v|. Candidates |v| >= tau come from one chunked pass
        (:func:`gradcomp.compressors.sparse.magnitude_candidates`) with tau from the sample (:meth:`threshold`);
        fewer than k candidates: tau is lowered to a lower sample quantile and the pass repeated
        (:meth:`_lowered`). The k largest candidates come from :func:`~gradcomp.compressors.sparse.keep_largest`,
        or, where the k-th largest is tied, from ``torch.topk`` on the candidates' magnitudes.
        """
        d = values.numel()
        k = kept_count(self.density_at(step), d)
        samples = self.sampled_magnitudes(values, slot, step)
        rank = self.first_rank(samples.numel(), k, d)
        tau = _largest(samples, rank).clamp(min=_SMALLEST)  # a float32 value: exact
        if sparse._numpy_path(values):
            tau = float(tau)  # the CPU's numpy pass takes a number; torch's compares with the tensor, unread
        candidates = magnitude_candidates(values, tau, "ge")
        if candidates.numel() < k and not float(tau) <= _SMALLEST:  # tau is read only when too few got through
            candidates = self._lowered(values, samples, rank, k, float(tau))
        if candidates.numel() > k:
            scores = torch.index_select(values, 0, candidates).abs_()
            kept = keep_largest(candidates, scores, k)
            if kept is not None:
                return kept[0]
            candidates = torch.sort(candidates[torch.topk(scores, k, sorted=False).indices]).values
        return candidates

    def select_slots(self, values: Sequence[Tensor], slots: Sequence[Slot], step: int) -> list[Tensor]:
        """:meth:`select` for the slots of one message on the torch path (a GPU's), with the reads of all the slots
        together: every slot's candidate mask |v| >= tau first and their counts read at once (``compact`` then
        gives the positions with the size known), then keep_largest's two conditions for every slot with more than
        k candidates, read at once. A slot with fewer than k candidates lowers tau on its own (:meth:`_lowered`,
        rare), and one whose k-th largest candidate is tied asks ``torch.topk`` as :meth:`select` does: the same
        positions as :meth:`select`, slot by slot."""
        plans = []
        for v, slot in zip(values, slots):
            d = v.numel()
            if d == 0:
                plans.append(None)
                continue
            k = kept_count(self.density_at(step), d)
            samples = self.sampled_magnitudes(v, slot, step)
            rank = self.first_rank(samples.numel(), k, d)
            tau = _largest(samples, rank).clamp(min=_SMALLEST)
            plans.append((k, samples, rank, tau, v.abs() >= tau))  # magnitude_candidates' torch path, unread
        masks = [plan[4] for plan in plans if plan is not None]
        counts = iter(torch.stack([m.sum() for m in masks]).tolist() if masks else [])  # the first read
        found: list = []
        for v, plan in zip(values, plans):
            if plan is None:
                found.append(torch.zeros(0, dtype=torch.int64, device=v.device))
                continue
            k, samples, rank, tau, mask = plan
            count = next(counts)
            candidates = compact(mask, count)
            if count < k and not float(tau) <= _SMALLEST:
                candidates = self._lowered(v, samples, rank, k, float(tau))
            found.append(candidates)
        # the slots with more than k candidates: keep_largest's conditions of all of them in the second read
        over = [(i, torch.index_select(values[i], 0, c).abs_()) for i, c in enumerate(found)
                if plans[i] is not None and c.numel() > plans[i][0]]  # fmt: skip
        checks = []
        for i, scores in over:
            k = plans[i][0]
            keep = scores >= torch.kthvalue(scores, scores.numel() - k + 1).values
            checks.append((keep, torch.stack([torch.isnan(scores).any().to(torch.int64), keep.sum()])))
        read = torch.stack([c for _, c in checks]).tolist() if checks else []
        for (i, scores), (keep, _), (nan, kept) in zip(over, checks, read):
            k = plans[i][0]
            if nan or kept != k:  # a NaN or a tie at the k-th: torch.topk's own pick, as select
                found[i] = torch.sort(found[i][torch.topk(scores, k, sorted=False).indices]).values
            else:
                found[i] = found[i][compact(keep, k)]
        return found

    def largest_on_device(self, values: Tensor, slot: Slot, step: int) -> tuple[Tensor, Tensor] | None:
        """The device path's selection, nothing read (``DGC.select_sized``): ``(the sorted positions of the k
        largest |v| by torch.topk over all of them, which of those are nonzero)``, or None for an empty slot. The
        positions of the nonzero ones are :meth:`select`'s (the sampled threshold only narrows the search to
        candidates that hold the top-k), except which entries a tie at the k-th largest value keeps."""
        d = values.numel()
        if d == 0:
            return None
        magnitudes = values.abs()
        top = torch.topk(magnitudes, kept_count(self.density_at(step), d), sorted=False).indices
        positions = torch.sort(top).values
        return positions, torch.index_select(magnitudes, 0, positions) > 0

    @staticmethod
    def _lowered(values: Tensor, samples: Tensor, rank: int, k: int, tau: float) -> Tensor:
        """Candidates |v| >= a lower tau, when the ``rank``-th largest sample ``tau`` let fewer than k through.

        Each try keeps four times as many sampled values as the last, up to the sample's smallest value; a rank
        whose value is no lower than the last tau costs no pass. If even that is too few (or the sample's values
        reach 0), every nonzero entry is a candidate.
        """
        n = samples.numel()
        while rank < n:
            rank = min(n, 4 * rank)
            lower = float(_largest(samples, rank))
            if lower <= _SMALLEST:
                break
            if not lower >= tau:  # lower, or the last tau was NaN
                tau = lower
                candidates = magnitude_candidates(values, tau, "ge")
                if candidates.numel() >= k:
                    return candidates
        return magnitude_candidates(values, _SMALLEST, "ge")

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1)
        if flat.numel() == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=flat.device)
            return [empty, torch.zeros(0, dtype=torch.float32, device=flat.device)]
        positions = self.select(flat, slot, step)
        return [positions, torch.index_select(flat, 0, positions).to(torch.float32)]


def _check_fraction(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise ConfigError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def _check_clip(clip: object) -> float | None:
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0.0 < float(clip) < math.inf:
        raise ConfigError(f"clip must be None (off) or a positive finite number, got {clip!r}")
    return float(clip)


def clip_norm(g: Tensor, clip: float) -> Tensor:
    """g scaled to ℓ2 norm at most ``clip`` (a new tensor when scaled; ``g`` itself when within the bound)."""
    norm = float(torch.linalg.vector_norm(g, dtype=torch.float64))
    return g * (clip / norm) if norm > clip else g


class DGC(Compressor):
    """Deep Gradient Compression; see the module docstring for the algorithm and every choice."""

    capabilities = Capabilities(accumulate=True, select_sized=True, compress_slots=True)
    wraps = ("selector",)
    name = "dgc"
    owns_momentum = True
    owns_feedback = True  # its momentum correction keeps the residual: no error feedback on top

    def __init__(
        self,
        density: float = 0.001,
        momentum: float = 0.9,
        sample: float = 0.01,
        clip: float | None = None,
        warmup_steps: int = 0,
        positions: str = "golomb",
        seed: int = 0,
    ):
        selector = SampledThresholdTopK(
            density=check_density(density),
            sample=_check_fraction("sample", sample),
            warmup_steps=check_int("warmup_steps", warmup_steps, minimum=0),
            positions=check_positions_codec(positions),
            seed=check_int("seed", seed, minimum=0),
        )
        self.clip = _check_clip(clip)
        self.selector = selector
        self.memory = Momentum(momentum, "dgc")  # checks momentum

    density = property(lambda self: self.selector.density)
    momentum = property(lambda self: self.memory.momentum)
    velocity = property(lambda self: self.memory.state["velocity"], doc="u per slot key (``name#numel``)")
    accumulated = property(lambda self: self.memory.state["accumulated"], doc="v per slot key (``name#numel``)")

    def density_at(self, step: int) -> float:
        """The density used at exchange ``step`` (the warm-up schedule)."""
        return self.selector.density_at(step)

    def params(self) -> dict[str, Any]:
        s = self.selector
        return {
            "density": s.density,
            "momentum": self.momentum,
            "sample": s.sample,
            "clip": self.clip,
            "warmup_steps": s.warmup_steps,
            "positions": s.positions,
            "seed": s.seed,
        }

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return self.selector.specs(slot)

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        """Clipping, then momentum correction with masking (``state.Momentum``, as ``feedback.MomentumCorrection``
        with ``masking=True`` computes it) around the selection: v − sent and the masking touch only the sent
        positions (v[i] − v[i] at a sent position i, so Inf and NaN behave as before). The message's values are
        copies (``index_select``), never views of v."""
        g = x.reshape(-1).to(torch.float32)
        _, v = self.memory.step(slot, clip_norm(g, self.clip) if self.clip is not None else g)
        try:
            fields = self.selector.compress(v, slot, step)
            self.memory.sent(slot, *fields, masking=True)
        except BaseException:
            self.memory.state.drop(slot)  # half updated: start the slot afresh (as MomentumCorrection)
            raise
        return fields

    def compress_slots(self, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int) -> list[Fields]:
        """:meth:`compress` for the slots of one message; on the torch path (a GPU's) the selections of all of
        them read their counts together (:meth:`SampledThresholdTopK.select_slots`): every slot's momentum step,
        then the selections, then every slot's v − sent and masking. The same messages and state as
        :meth:`compress` slot by slot."""
        if not tensors or sparse._numpy_path(tensors[0]):
            return compress_each(self, tensors, slots, step)
        try:
            vs = []
            for x, slot in zip(tensors, slots):
                g = x.reshape(-1).to(torch.float32)
                vs.append(self.memory.step(slot, clip_norm(g, self.clip) if self.clip is not None else g)[1])
            out = []
            for v, slot, positions in zip(vs, slots, self.selector.select_slots(vs, slots, step)):
                fields = [positions, torch.index_select(v, 0, positions).to(torch.float32)]
                self.memory.sent(slot, *fields, masking=True)
                out.append(fields)
        except BaseException:
            for slot in slots:
                self.memory.state.drop(slot)  # half updated: start afresh (as compress)
            raise
        return out

    def select_sized(self, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int) -> SizedSelection | None:
        """The device path's :meth:`compress_slots` in two halves, so that sizing the message reads nothing of its
        own: every slot's momentum step and its k largest |v| (``SampledThresholdTopK.largest_on_device``), with
        the counts of their nonzero entries and their Golomb streams' lengths (the Rice parameter of each count
        computed on the device too: ``wire.golomb.rice_parameter_on_device``) left for the caller's size exchange
        to read; then, given the counts, the messages and every slot's v − sent and masking. None with ``clip``
        (its norm is read) and on the CPU's numpy path."""
        if not tensors or sparse._numpy_path(tensors[0]) or self.clip is not None:
            return None
        try:
            vs = [self.memory.step(slot, x.reshape(-1).to(torch.float32))[1] for x, slot in zip(tensors, slots)]
            tops = [self.selector.largest_on_device(v, slot, step) for v, slot in zip(vs, slots)]
        except BaseException:
            for slot in slots:
                self.memory.state.drop(slot)  # half updated: start afresh (as compress)
            raise
        nonzero = [None if top is None else top[1].sum() for top in tops]
        counts: list[list[int | Tensor]] = [[0, 0] if n is None else [n, n] for n in nonzero]
        bits = None
        if self.selector.positions == "golomb":
            bits = torch.stack([
                torch.zeros((), dtype=torch.int64, device=v.device) if top is None
                else golomb_stream_bits(top[0], rice_parameter_on_device(n, slot.numel), top[1])
                for v, slot, top, n in zip(vs, slots, tops, nonzero)
            ])  # fmt: skip

        def finish(values: list[int]) -> list[Fields]:
            sent = iter(values[::2])  # (each slot's positions' count, then its values')
            out = []
            try:
                for v, slot, top in zip(vs, slots, tops):
                    positions = torch.zeros(0, dtype=torch.int64, device=v.device) if top is None else top[0]
                    if top is not None and (n := next(sent)) < positions.numel():
                        positions = positions[compact(top[1], n)]
                    fields = [positions, torch.index_select(v, 0, positions).to(torch.float32)]
                    self.memory.sent(slot, *fields, masking=True)
                    out.append(fields)
            except BaseException:
                for slot in slots:
                    self.memory.state.drop(slot)
                raise
            return out

        return SizedSelection(counts, finish, bits)

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return self.selector.decompress(fields, slot, step)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        base.accumulate(self.selector, fields, slot, step, out)

    def retain(self, slots: list[Slot]) -> None:
        self.memory.state.retain(slots)

    def state_dict(self) -> dict[str, Any]:
        return self.memory.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.state.load_state_dict(state)
