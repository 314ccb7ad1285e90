"""QSGD: stochastic uniform quantisation to s levels of |g_i|/||g||_2, with a fixed-width or an Elias code.

Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NeurIPS 2017.

Quantiser (the paper's Q_s): for a tensor g of d entries with ℓ2 norm ||g|| and ``levels`` s, each entry
becomes Q(g)_i = ||g||·sign(g_i)·ξ_i/s, where ξ_i is the stochastic rounding of s·|g_i|/||g|| to one of its two
neighbouring integers in {0, …, s}, up with probability s·|g_i|/||g|| − floor(s·|g_i|/||g||) — unbiased,
E[Q(g)] = g, with E||Q(g) − g||² <= min(d/s², √d/s)·||g||² (the paper's Lemma 3.1; ``omega_bound(d)``) and
E[number of nonzero ξ_i] = Σ_i min(1, s·|g_i|/||g||) <= s·√d. This is exactly standard random dithering with
p = 2, so ``qsgd`` subclasses :class:`gradcomp.compressors.natural.RandomDithering` and reuses its quantiser
(scale-safe norm, NaN/Inf check, float32 rounding, clamping, decoding) unchanged: only the name (which salts
the random numbers: they differ from ``random_dithering``'s), the parameters and the ``elias`` wire code are
new. Randomness: a generator seeded by (``seed``, step, slot index, "qsgd", worker), fresh every step and
tensor, reproducible, independent per worker (``bind_worker``). Both codings quantise with the same draws,
so for the same seed, step, slot and worker they carry bit-identical tensors; only the bytes differ.

Two codings of the same message (``coding``):

- ``"packed"`` (default) — random dithering's wire format: field 0 the norm (F32, one value), field 1 one
  BITS field of width w = 1 + ceil(log2(s + 1)) and count d, each code sign·2^(w−1) + ξ_i (the sign bit only
  set where ξ_i > 0). Exactly 32 + w·d bits (plus the 20-byte container header once per message and a
  10-byte header per section, and the BITS field's padding to whole bytes); s = 127 (the default): 8 bits per
  entry; s = 7: 4.
- ``"elias"`` — the paper's Elias code (its Section 3.2 / Appendix A, with Elias-gamma where the paper uses
  the recursive Elias omega code): the norm in 32 bits, then, for each nonzero ξ_i in increasing position i,
  the gap to it (Elias-gamma of i − i_prev, i_prev the previous nonzero position or −1, so the first code is
  i + 1 >= 1), its sign bit and its level (Elias-gamma of ξ_i >= 1). Zero entries cost nothing, and neither
  does the sign of a zero. Wire layout: field 0 the norm (F32, one value); field 1 the sign bits of the
  nonzero entries in position order (BITS width 1, variable count nnz <= d: 1 = negative; the section
  header's count tells the receiver nnz); field 2 the Elias-gamma stream (:mod:`gradcomp.wire.elias`, LSB
  first) of the 2·nnz integers gap_1, ξ_1, gap_2, ξ_2, … handed to the container as bytes (BITS width 8,
  variable count). Bits: 32 + Σ_nonzero [1 + (2·floor(log2 gap) + 1) + (2·floor(log2 ξ) + 1)] plus padding
  to whole bytes (at most 7 bits in each of fields 1 and 2) and one more 10-byte section header than
  ``packed``. Since Σ gap <= d and log is concave, this is at most 32 + nnz·(3 + 2·log2(d/nnz) +
  2·log2(mean nonzero ξ)) bits, and E[nnz] <= s·√d: for small s (1, 2) and a large tensor most ξ_i are 0 and
  the message is far shorter than packed's w·d bits (tests/test_qsgd.py measures it; docs/methods/qsgd.md
  gives the numbers). Where most entries are nonzero with large levels (gaps of 1 cost 1 bit, a level
  2·floor(log2 ξ) + 1 bits: more than w when ξ is near s, e.g. d equal entries with s >> √d) ``packed`` is
  shorter. Interleaving the signs into the Elias stream, as the paper
  does, would save one section header per slot; we keep them apart so that the stream is pure Elias-gamma
  and nnz travels in the signs' section header.

The decoder of the elias coding refuses (WireError) a stream whose codes do not match the count of signs
(truncated, trailing codes or padding), a position at or beyond d and a level above s. An Elias stream
cannot detect a flipped bit inside a code's value part (no prefix code can: the result is another valid
stream); the container's 64-bit body checksum catches those.

Parameters: ``levels`` s >= 1 (default 127; at most 2^24 − 1 so ξ_i is exact in float32), ``seed`` >= 0,
``coding`` "packed" or "elias". The default s = 127 gives 8-bit packed codes (as the paper's 8-bit runs): 1
sign bit and 7 level bits, all 128 level codes used. It is chosen because this implementation normalises per
tensor (per slot), as random_dithering does, not per bucket of a few hundred entries (512 in most of the
paper's experiments): the variance bound min(d/s², √d/s) then grows with the layer (√d/s = 3.5 for the
SmallCNN's 200,704-entry layer at s = 127, 64 at s = 7), so a large s is the default: on MNIST s = 127 trained as well
as fp32 where s = 7 (4-bit codes) was unstable and s = 1 diverged (docs/methods/qsgd.md has the runs). With
``coding="elias"`` a large s costs few bits. The paper's sparse variant s = √d is a per-tensor choice that one parameter
for all tensors cannot make; it is left to ``levels``. Per-bucket normalisation is not implemented.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Fields, Slot
from gradcomp.compressors.natural import RandomDithering
from gradcomp.errors import ConfigError, WireError
from gradcomp.wire import Codec, FieldSpec
from gradcomp.wire.bits import host_path
from gradcomp.wire.refusals import check_received
from gradcomp.wire.elias import elias_gamma_decode, elias_gamma_encode

__all__ = ["QSGD", "CODINGS", "elias_max_bytes"]

CODINGS = ("packed", "elias")


_DECODE_CHUNK = 1 << 17  # codes decoded per step of ``QSGD._decode``: chunk-sized temporaries, in cache
# on an accelerator each step is ~8 kernel launches: larger steps (about 160 MB of temporaries), so that a
# 25M-entry model takes 6 steps per message, not 190
_DEVICE_DECODE_CHUNK = 1 << 22


def _check_coding(coding: object) -> str:
    if not isinstance(coding, str) or coding not in CODINGS:
        raise ConfigError(f"coding must be one of {list(CODINGS)}, got {coding!r}")
    return coding


def elias_max_bytes(numel: int, levels: int) -> int:
    """An upper bound on the bytes of the elias coding's gamma stream for ``numel`` entries.

    Gaps: Σ (2·floor(log2 gap_i) + 1) over k nonzeros with Σ gap_i <= d is at most k·(2·log2(d/k) + 1) <=
    1.51·d (maximised at k ≈ d/1.92), so 2·d bits bound it; levels: at most d codes of 2·floor(log2 s) + 1 bits.
    """
    level_bits = 2 * (levels.bit_length() - 1) + 1
    return (2 * numel + level_bits * numel + 7) // 8


class QSGD(RandomDithering):
    """QSGD (Alistarh et al., 2017): ℓ2-normalised stochastic rounding to s levels; packed or Elias-coded."""

    capabilities = RandomDithering.capabilities
    _CODES_KERNEL = RandomDithering._CODES_KERNEL  # the same level index and codes as random dithering
    name = "qsgd"

    def __init__(self, levels: int = 127, seed: int = 0, coding: str = "packed"):
        super().__init__(levels=levels, norm=2, seed=seed, norm_codec="f32")
        self.coding = _check_coding(coding)

    def params(self) -> dict[str, Any]:
        return {"levels": self.levels, "seed": self.seed, "coding": self.coding}

    def specs(self, slot: Slot) -> list[FieldSpec]:
        if self.coding == "packed":
            return super().specs(slot)
        d = slot.numel
        return [
            FieldSpec(Codec.F32, count=1),
            FieldSpec(Codec.BITS, max_count=d, width=1),
            FieldSpec(Codec.BITS, max_count=elias_max_bytes(d, self.levels), width=8),
        ]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        norm, codes = super().compress(x, slot, step)
        if self.coding == "packed":
            return [norm, codes]
        # A code is nonzero exactly where its level is (the sign bit is only set where xi_i > 0), so the
        # nonzero codes are picked first and split into sign and level: no d-sized level tensor besides the codes.
        positions = torch.nonzero(codes).reshape(-1)
        picked = codes[positions]
        negative = (picked >> self.level_bits) & 1
        previous = torch.cat([positions.new_full((1,), -1), positions[:-1]])
        # interleaved gap_1, level_1, gap_2, level_2, …: every value >= 1
        levels = (picked & ((1 << self.level_bits) - 1)).to(torch.int64)
        values = torch.stack([positions - previous, levels], dim=1).reshape(-1)
        stream, _ = elias_gamma_encode(values)
        return [norm, negative, stream.to(torch.int64)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        out = torch.empty(slot.numel, dtype=torch.float32, device=fields[0].device)
        self._decode(fields, slot, step, out, add=False)
        return out

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        """``out += decompress(...)``, decoded chunk by chunk into the running sum (see ``_decode``)."""
        if not out.is_contiguous() or out.dtype != torch.float32:  # a view would copy: add the dense tensor
            out += self.decompress(fields, slot, step).reshape(out.shape)
            return
        self._decode(fields, slot, step, out.view(-1), add=True)

    def _decode(self, fields: Fields, slot: Slot, step: int, out: Tensor, add: bool) -> None:
        """The decoded message written (``add=False``) or added (``add=True``) into the flat float32 ``out``.

        Random dithering's ``decompress`` maps each code to its value elementwise, through d-sized temporaries
        (int64 level and sign tests, float level value, magnitude, its negation, the result: about 40 bytes per
        entry, ten fp32 gradients' worth, all alive at once in ``accumulate``'s ``out += decompress(...)``,
        where a worker adds up W messages). Here it runs on slices of
        ``_DECODE_CHUNK`` codes at a time, each decoded by that same ``decompress`` (the parent class's own
        arithmetic: the same values, bit for bit) and written or added into its slice of ``out`` at once, so the
        temporaries are chunk-sized (``_DEVICE_DECODE_CHUNK`` on an accelerator, where each chunk costs kernel
        launches). On the CPU the compiled table-lookup decoder (``_decode_compiled``) does it in one
        pass without temporaries, with the same values. The elias coding first rebuilds the dense codes
        (``_elias_codes``).
        """
        if self.coding == "packed":
            norm, codes = fields
            self.check_message(norm, codes, slot)
        else:  # (the elias codes are checked against levels as they are rebuilt)
            norm, codes = fields[0], self._elias_codes(fields, slot)
            self.check_message(norm, None, slot)
        codes = codes.reshape(-1)
        if self._decode_compiled([norm, codes], out, add) is not None:  # the CPU: one compiled pass into out
            return
        chunk = _DECODE_CHUNK if host_path(codes) else _DEVICE_DECODE_CHUNK
        for start in range(0, slot.numel, chunk):
            piece = codes[start : start + chunk]
            values = self._values([norm, piece])
            if add:
                out[start : start + piece.numel()] += values
            else:
                out[start : start + piece.numel()] = values

    def _elias_codes(self, fields: Fields, slot: Slot) -> Tensor:
        """The packed coding's codes (sign·2^level_bits + level) of an elias message, as int32 (s < 2^24: the
        codes fit), checked as the wire format requires: WireError for a bad one, or, inside a step that keeps its
        refusals for its end (``wire.refusals.refusing_later``), the fault noted and zero codes in its place."""
        _, negative, stream = fields
        negative = negative.reshape(-1).to(torch.int64)
        try:
            return self._checked_codes(negative, stream, slot)
        except WireError as exc:
            check_received(False, str(exc))
            return torch.zeros(slot.numel, dtype=torch.int32, device=negative.device)

    def _checked_codes(self, negative: Tensor, stream: Tensor, slot: Slot) -> Tensor:
        nnz = negative.numel()
        values = elias_gamma_decode(stream.reshape(-1).to(torch.uint8), 2 * nnz)
        pairs = values.reshape(nnz, 2)
        gaps, level = pairs[:, 0], pairs[:, 1]
        if nnz:
            widest, top = torch.stack([gaps.max(), level.max()]).tolist()
            if widest > slot.numel:  # checked first: bounds the sum below, which then cannot overflow
                raise WireError(f"qsgd: {slot.name}: decoded gap {widest} exceeds the {slot.numel} entries")
            if top > self.levels:
                raise WireError(f"qsgd: {slot.name}: decoded level {top} exceeds levels = {self.levels}")
        positions = torch.cumsum(gaps, 0) - 1  # gaps >= 1: strictly increasing from >= 0
        if nnz and int(positions[-1]) >= slot.numel:
            raise WireError(f"qsgd: {slot.name}: decoded position {int(positions[-1])} is outside [0, {slot.numel})")
        codes = torch.zeros(slot.numel, dtype=torch.int32, device=level.device)
        codes[positions] = (level | (negative.to(level.device) << self.level_bits)).to(torch.int32)
        return codes
