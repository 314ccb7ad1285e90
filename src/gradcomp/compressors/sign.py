"""The sign family: signSGD with majority vote, Signum, EF-signSGD and 1-bit SGD, one bit per coordinate.

Bernstein, Wang, Azizzadenesheli, Anandkumar, "signSGD: Compressed Optimisation for Non-Convex Problems",
ICML 2018 (signSGD, Signum, majority vote); Bernstein, Zhao, Azizzadenesheli, Anandkumar, "signSGD with
Majority Vote is Communication Efficient and Fault Tolerant", ICLR 2019 (Signum with majority vote);
Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
ICML 2019 (EF-signSGD); Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014 (1-bit SGD).

``signsgd`` — every worker sends sign(g), one bit per coordinate. Decompressed, a message is ±1 per
coordinate; the update is the **majority vote**, sign(sum over workers of sign(g)) (``aggregate``), so every
coordinate moves by exactly ±lr — or by 0 where the vote ties, which happens only with an even number of
workers (2 of 4 say +, 2 say −: that coordinate stays where it is this step).

``signum`` — sign with momentum kept on the worker: m = β·m + (1 − β)·g (``momentum`` β = 0.9 by default,
m starts at 0, so the first step sends sign(g)), the worker sends sign(m), the update is the majority vote.
The method applies momentum itself (``owns_momentum``: the CLI sets the optimizer's momentum to 0). The
momentum is per slot, a ``MovingAverage`` on a ``SlotState`` (compressors/state.py: keyed by the slot's name and
size), is checkpointed by ``state_dict`` and dropped for slots that disappear by ``retain``.

``efsignsgd`` — the scaled sign C(p) = (||p||_1 / d)·sign(p) of p = g + residual, with error feedback on by
default (``make`` wraps it in ``ErrorFeedback``: the residual p − C(p) is added to the next step's input).
The message is the sign bits plus ONE fp32 number, the scale ||p||_1 / d; the workers' decompressed
messages are averaged (the mean, not a vote). C is contractive: ||C(p) − p||² = ||p||² − ||p||_1²/d <=
(1 − 1/d)·||p||², so the residual stays bounded.

``onebit`` — 1-bit SGD: the sign bit plus TWO fp32 reconstruction values, the mean of the entries >= 0 and
the mean of the entries < 0; an entry decodes to the mean of its side. These means minimise the squared
reconstruction error for the threshold 0 (so C is contractive too). Error feedback (the paper's
"quantization error" carried to the next minibatch) is on by default; mean aggregation. The paper computes
the two values per column of each weight matrix; here they are computed per slot — per tensor with the
default layer granularity, one pair for the whole model with granularity ``model``.

Learning rate. With majority vote (signsgd, signum) the aggregated gradient is ±1 (or 0) in every
coordinate, so the optimizer's lr IS the per-coordinate step (and local steps, which have no lr to apply to
the aggregate, are refused), whatever the gradient's size: typical values
are 1e-4 to 1e-3 on MNIST with plain SGD and no momentum in the optimizer (for signum the CLI turns the
optimizer's momentum off). A learning rate tuned for fp32 SGD (0.01–0.1) moves every weight by that much
every step and diverges. For efsignsgd and onebit the fp32 scale keeps the gradient's magnitude (each
coordinate moves by the mean |p| of its side), so the usual SGD lr works, without optimizer momentum on top of
error feedback (docs/methods/sign.md has the learning rates tried and what each gave).

Wire layout. The sign bits are the LSB-first bitmap of the *negative* mask: bit k of byte k // 8 (counted
from the least significant bit) is 1 when entry k is < 0; the unused high bits of the last byte are 0.
These are exactly the bytes ``gradcomp.wire.pack_bool(x < 0)`` produces, ceil(d/8) of them. The compressor
packs them itself in one vectorised pass (``pack_signs``: on the CPU, numpy's comparison into a reused
bool buffer and ``np.packbits``, in chunks of 2^18 entries that stay in cache; on other devices the
comparison writes a byte per entry, every 8 bytes are read as one little-endian 64-bit word and three
shift-ors gather its 8 low bits into its low byte, in chunks of 2^20 entries; efsignsgd and onebit pack
each chunk while they sum it, signum right after its momentum update of the chunk) and hands the
container ceil(d/8) bytes, declared as a BITS section of width 8 — the container's width-1 path would need
every sign as an integer code in memory and is several times slower. The field is uint8 in memory, which the
container sends as it is; the wire decodes it to int16, one value per byte, as every BITS field of 8 bits. On the CPU
the packing, and the decoding that error feedback's subtraction and the receivers' sums need, are compiled
kernels (``gradcomp.kernels.sign_kernel``); the numpy and torch paths give the same bytes and sums. So one
slot's message is:

    signsgd, signum:  [BITS width 8, count ceil(d/8)]                         10 + ceil(d/8) bytes
    efsignsgd:        [BITS width 8, count ceil(d/8)], [F32, count 1: scale]  10 + ceil(d/8) + 10 + 4
    onebit:           [BITS width 8, count ceil(d/8)], [F32, count 2: mean >= 0, mean < 0]
                                                                              10 + ceil(d/8) + 10 + 8

plus the container's 20-byte header once per message (all slots of a step travel in one message). A set
padding bit in the last byte is rejected with WireError by ``decompress``, as the container does for its
own bitmaps (on the device path the check joins the decoding step's one read, ``wire.refusals.check_received``). Decoding reads each byte's 8 values from a 256-row table (±1, ±scale, or the two means);
``accumulate`` adds them into the running sum chunk by chunk, without a d-sized temporary.

Choices where the papers are silent or differ:

- the sign of 0 (and of −0.0). One bit cannot say 0. signsgd and signum send a zero as + (bit 0) on even
  exchange steps and as − (bit 1) on odd ones, so a coordinate whose gradient (signum: momentum) is exactly 0
  on every worker — an unused parameter, a dead unit — moves by −lr and +lr in turn and stays within lr of
  where it was; always +, it drifted by −lr a step without bound. efsignsgd and onebit send a zero as + on
  every step (decoded as +scale, the mean of the entries >= 0); their error feedback, on by default, takes
  it back on the next step;
- a tie of the vote (even number of workers) gives 0 — the coordinate does not move. With the parameter
  server topology and ``--server-compressor signsgd`` the vote travels down in one bit, and a tie's 0 then
  goes down by the rule above: + on even steps, − on odd ones. The CLI builds the server compressor with
  error feedback (``--no-server-error-feedback`` turns it off), and that gives the same alternation: a tie
  sent as + leaves a residual of −1, which makes the next tie −;
- signum's m starts at 0 and is float32; β = 0 is signsgd;
- the sums behind efsignsgd's scale and onebit's means are float32 reductions over chunks of 2^20 entries,
  added in float64; if a chunk's sum overflows (only for entries near float32's largest value) the sums are
  recomputed in float64, so the scale of finite input is finite. On the host path this check is compress's one
  host synchronisation (efsignsgd and onebit; signsgd/signum have none); the device path reads nothing: it
  computes the float64 sums too and takes them where the float32 ones are not finite (``torch.where``);
- error feedback works in gradient units (residual r, p = g + r, update lr·C(p)), where the EF-signSGD
  paper feeds back in update units (p = γ·g + e). As C is positively homogeneous, C(γ·p) = γ·C(p), the two
  are the same for a constant lr;
- the distributed efsignsgd / onebit average the workers' scaled signs (each worker has its own residual);
  the papers' single-worker algorithm is the W = 1 case;
- signsgd and signum take error feedback only when asked (``error_feedback=True``); the residual is then in
  units of the unscaled ±1 message (not the EF-signSGD algorithm). It stays within 1 per coordinate only
  while |g| <= 1: a coordinate with |g| > 1 on every step grows by |g| − 1 a step, without bound;
- a majority vote is a direction without a size (``scale_free``): local steps (``LocalUpdateExchange``, which
  applies the aggregate to the weights as it is) refuse signsgd and signum as the workers' or the server's
  compressor, which would move every weight by 1.0 at each sync;
- a NaN or Inf in what efsignsgd or onebit would send (the gradient, or with error feedback gradient plus
  residual, whose sum can overflow float32 for finite entries near its largest value) raises
  NonFiniteGradientError naming the slot before anything is sent on the host path (the check is the host
  synchronisation above); on the device path the NaN / Inf travels as the scale or means, so every decoded
  entry is non-finite and shows in the receivers' sums.

None of these compressors is unbiased (a sign throws away the magnitude: E[sign(g)] is not g), so
``unbiased`` is False and no ``omega`` is declared.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from gradcomp import kernels
from gradcomp.compressors.base import Capabilities, Compressor, Fields, Slot, Tally, add_then_compress
from gradcomp.compressors.sparse import workspace
from gradcomp.compressors.state import MovingAverage
from gradcomp.errors import ConfigError, NonFiniteGradientError
from gradcomp.wire import Codec, FieldSpec
from gradcomp.wire.bits import host_path
from gradcomp.wire.refusals import check_received, check_received_range

__all__ = ["EFSignSGD", "OneBit", "SignSGD", "Signum", "pack_signs", "packed_count", "unpack_signs"]


def packed_count(numel: int) -> int:
    """Bytes of the sign bitmap of ``numel`` entries: ceil(numel / 8)."""
    return (numel + 7) // 8


_CHUNK = 1 << 20  # entries per pass: scratch buffers of about 1–4 MB that the allocator reuses
# entries per chunk of the numpy sign packer (a multiple of 8): 1 MB of input and 256 kB of mask, in cache
_PACK_CHUNK = 1 << 18
_SUBTRACT_CHUNK = 1 << 18  # entries per step of _Sign.subtract_sent (a multiple of 8): 1 MB of scratch


def _pack_into(flat: Tensor, out: Tensor, mask: Tensor, shifted: Tensor, zero_negative: bool = False) -> None:
    """Pack the signs of ``flat`` (at most ``mask.numel()`` entries) into ``out`` (ceil(n/8) int64 bytes): bit 1
    where an entry is < 0, or <= 0 when ``zero_negative``.

    The comparison writes one bool byte per entry into ``mask``, zero-padded to a multiple of 8. Each group
    of 8 bool bytes (each 0 or 1) is then read as one little-endian int64 word w, entry j at bit 8j. Or-ing
    in w >> 7, then w >> 14, then w >> 28 copies every bit to all positions 8j − 7k, k = 0..7; entry j thus
    reaches bit j (k = j), and no other entry lands in bits 0..7 (8i − 7k = j with i, k in 0..7 forces
    i = k = j), so the low byte is the packed byte. Values stay below 2^57: no sign or overflow issues.
    """
    n, groups = flat.numel(), out.numel()
    padded = mask[: 8 * groups]
    (torch.le if zero_negative else torch.lt)(flat, 0, out=padded[:n])
    padded[n:] = False
    words = padded.view(torch.uint8).view(torch.int64)
    tmp = shifted[:groups]
    torch.bitwise_right_shift(words, 7, out=out).bitwise_or_(words)
    out.bitwise_or_(torch.bitwise_right_shift(out, 14, out=tmp))
    out.bitwise_or_(torch.bitwise_right_shift(out, 28, out=tmp))
    out.bitwise_and_(0xFF)


_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)
_KERNEL_FLOATS = (torch.float32, torch.float64)  # what the compiled kernel reads (numba has no CPU float16)


def _numpy_path(flat: Tensor) -> bool:
    """Whether signs are packed by numpy (CPU, numpy float dtypes) or by torch ops (any device; the same bytes:
    tests switch the numpy path off to check the torch one on the CPU)."""
    return host_path(flat) and flat.dtype in _NUMPY_FLOATS


def _pack_piece(
    piece: np.ndarray, dest: np.ndarray, kernel, scratch: np.ndarray | None, count: bool, zero_negative: bool = False
) -> int:
    """The signs of the numpy chunk ``piece`` into ``dest`` (its ceil(n/8) packed bytes): the compiled kernel when
    given, else numpy's ``piece < 0`` (``<= 0`` when ``zero_negative``: a zero sent as −) into the bool
    ``scratch`` and ``np.packbits``. Returns the number of set bits (0 on the numpy path unless ``count``)."""
    if kernel is not None:
        return int(kernel.sign_bits(piece, dest, _below(piece.dtype, zero_negative)))
    mask = scratch[: piece.size]
    (np.less_equal if zero_negative else np.less)(piece, 0, out=mask)
    dest[:] = np.packbits(mask, bitorder="little")
    return int(np.count_nonzero(mask)) if count else 0


def _below(dtype: np.dtype, zero_negative: bool):
    """The compiled kernel's bound: x < 0, or x <= 0 as x < the dtype's smallest positive value."""
    return np.nextafter(dtype.type(0), dtype.type(1)) if zero_negative else dtype.type(0)


def _pack(
    flat: Tensor, count: bool = False, before=None, zero_negative: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(sign bitmap as ceil(d/8) uint8 bytes, number of negative entries if ``count``).

    ``before(start, end)``, if given, is called on each chunk just before its signs are read (Signum updates
    its momentum there, so that the chunk is packed while it is in cache). ``zero_negative`` sets the bit of
    the entries equal to 0 (±0.0) too, x <= 0 instead of x < 0 (the majority vote's odd steps,
    ``_MajorityVote.signs``); the compiled kernel does both in the same pass (``_below``).

    Works through chunks with small scratch buffers: d-sized temporaries would cost page faults (on CPU a
    fresh 40 MB tensor takes several times as long as the arithmetic on it). On the CPU the compiled kernel
    (``gradcomp.kernels.sign_kernel``) packs the whole tensor in one pass and counts the bitmap's set bits
    afterwards (chunk by chunk of 2^18 entries when ``before`` is given); without it numpy does each chunk
    in two calls, the comparison into a reused bool buffer and ``np.packbits`` (LSB first: the same bytes);
    elsewhere the torch word arithmetic of ``_pack_into``, in chunks of 2^20 entries.
    """
    d = flat.numel()
    out = torch.empty(packed_count(d), dtype=torch.uint8, device=flat.device)
    if _numpy_path(flat):
        x, o = flat.detach().contiguous().numpy(), out.numpy()
        kernel = kernels.sign(d) if flat.dtype in _KERNEL_FLOATS else None
        if kernel is not None and before is None:
            negative = int(kernel.sign_bits(x, o, _below(x.dtype, zero_negative)))
            return out, torch.tensor(negative, dtype=torch.int64) if count else None
        scratch = workspace("signs", min(d, _PACK_CHUNK), torch.bool).numpy() if kernel is None else None
        negative = 0
        for start in range(0, d, _PACK_CHUNK):
            piece = x[start : start + _PACK_CHUNK]
            if before is not None:
                before(start, start + piece.size)
            dest = o[start // 8 : start // 8 + packed_count(piece.size)]
            negative += _pack_piece(piece, dest, kernel, scratch, count, zero_negative)
        return out, torch.tensor(negative, dtype=torch.int64) if count else None
    width = min(d, _CHUNK)
    mask = torch.empty(8 * packed_count(width), dtype=torch.bool, device=flat.device)
    shifted = torch.empty(packed_count(width), dtype=torch.int64, device=flat.device)
    words = torch.empty(packed_count(width), dtype=torch.int64, device=flat.device)
    negatives = []
    for start in range(0, d, _CHUNK):  # _CHUNK is a multiple of 8: every chunk starts on a byte
        piece = flat[start : start + _CHUNK]
        if before is not None:
            before(start, start + piece.numel())
        groups = packed_count(piece.numel())
        _pack_into(piece, words[:groups], mask, shifted, zero_negative)
        out[start // 8 : start // 8 + groups].copy_(words[:groups])
        if count:
            negatives.append(torch.count_nonzero(mask[: piece.numel()]))
    total = None
    if count:
        total = torch.stack(negatives).sum() if negatives else torch.zeros((), dtype=torch.int64, device=flat.device)
    return out, total


def pack_signs(x: Tensor) -> Tensor:
    """The sign bitmap of ``x`` (bit = 1 where x < 0), ceil(d/8) uint8 bytes; equals pack_bool(x < 0)."""
    return _pack(x.reshape(-1))[0]


_BIT_TABLES: dict[torch.device, Tensor] = {}


def _bit_table(device: torch.device) -> Tensor:
    """(256, 8) bool: row b holds the 8 bits of byte b, least significant first."""
    table = _BIT_TABLES.get(device)
    if table is None:
        byte = torch.arange(256, device=device).unsqueeze(1)
        table = (torch.bitwise_right_shift(byte, torch.arange(8, device=device)) & 1).to(torch.bool)
        _BIT_TABLES[device] = table
    return table


def _check_packed(packed: Tensor, numel: int, where: str, received: bool = True) -> None:
    """ConfigError for a bitmap of the wrong length; WireError for nonzero padding bits after the last sign.

    The padding is read on the host path; on the device path the check is handed to the decoding step's one read
    (``wire.refusals.check_received``: no host synchronisation here), and skipped for a bitmap this worker made
    itself (``received`` False: error feedback's subtraction of what it sent)."""
    count = packed_count(numel)
    if packed.numel() != count:
        raise ConfigError(f"{where}: {packed.numel()} sign bytes for {numel} entries, expected {count}")
    if not (numel % 8 and count):
        return
    message = f"{where}: nonzero padding bits after {numel} signs"
    if host_path(packed):
        check_received(not int(packed[-1]) >> (numel % 8), message)  # (harmless if let through to the step's end)
    elif received:
        check_received(torch.bitwise_right_shift(packed.reshape(-1)[-1], numel % 8) == 0, message)


def _value_table(device: torch.device, positive: Tensor, negative: Tensor) -> Tensor:
    """(256, 8) float32: row b holds the decoded values of the 8 entries that byte b stands for."""
    return torch.where(_bit_table(device), negative, positive)


def _rows(packed: Tensor) -> Tensor:
    """Byte values as an index tensor (``index_select`` takes int32 or int64; the compressor's bytes are uint8)."""
    return packed if packed.dtype in (torch.int32, torch.int64) else packed.to(torch.int32)


def _kernel_for(packed: Tensor, out: Tensor):
    """The compiled sign kernels for ``out += / -= decoded`` on the CPU (contiguous float32 ``out``), or None."""
    if not host_path(packed) or out.dtype != torch.float32 or not out.is_contiguous():
        return None
    return kernels.sign(out.numel())


def _expand(packed: Tensor, numel: int, positive: Tensor, negative: Tensor) -> Tensor:
    """float32 vector of ``numel`` entries: ``negative`` where the bit is 1, ``positive`` where it is 0."""
    table = _value_table(packed.device, positive, negative)
    return torch.index_select(table, 0, _rows(packed.reshape(-1))).reshape(-1)[:numel]


def _expand_add(packed: Tensor, numel: int, positive: Tensor, negative: Tensor, out: Tensor) -> None:
    """``out += _expand(...)``: one compiled pass on the CPU; elsewhere through chunks of 2^20 entries and one
    small scratch buffer (see ``_pack``). The same float32 addition per entry either way."""
    packed = packed.reshape(-1)
    kernel = _kernel_for(packed, out)
    if kernel is not None:
        kernel.sign_add(packed.contiguous().numpy(), np.float32(positive), np.float32(negative), out.numpy())
        return
    table = _value_table(packed.device, positive, negative)
    scratch = torch.empty(packed_count(min(numel, _CHUNK)), 8, dtype=torch.float32, device=packed.device)
    for start in range(0, numel, _CHUNK):
        n = min(_CHUNK, numel - start)
        rows = scratch[: packed_count(n)]
        torch.index_select(table, 0, _rows(packed[start // 8 : start // 8 + packed_count(n)]), out=rows)
        out[start : start + n] += rows.reshape(-1)[:n]


def unpack_signs(packed: Tensor, numel: int) -> Tensor:
    """±1.0 (float32) of each of ``numel`` entries of a sign bitmap: −1 where the bit is set."""
    one = torch.ones((), dtype=torch.float32, device=packed.device)
    return _expand(packed, numel, one, -one)


def _f32(x: Tensor) -> Tensor:
    return x.reshape(-1).to(torch.float32)


def _sign_spec(slot: Slot) -> FieldSpec:
    return FieldSpec(Codec.BITS, count=packed_count(slot.numel), width=8)


class _Sign(Compressor):
    """Shared by all four: the sign bitmap as the first field, float values after it."""

    capabilities = Capabilities(accumulate=True, subtract_sent=True)
    summable = False
    unbiased = False
    omega = None

    def _decode_values(self, fields: Fields, slot: Slot) -> tuple[Tensor, Tensor]:
        """(value for bit 0, value for bit 1) as float32 scalars."""
        raise NotImplementedError

    def _received_values(self, fields: Fields, slot: Slot) -> tuple[Tensor, Tensor]:
        """``_decode_values`` of a received message, checked: WireError (``wire.refusals.check_received``) for a
        value for bit 0 below 0 or one for bit 1 above 0, which no sender makes (every decoded sign flipped)."""
        positive, negative = self._decode_values(fields, slot)
        where = f"{self.name}: {slot.name}"
        check_received_range(positive.reshape(-1), 0.0, None, f"{where}: a negative value for the + sign")
        check_received_range(negative.reshape(-1), None, 0.0, f"{where}: a positive value for the − sign")
        return positive, negative

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        packed = fields[0]
        _check_packed(packed, slot.numel, f"{self.name}: {slot.name}")
        positive, negative = self._received_values(fields, slot)
        return _expand(packed, slot.numel, positive, negative)

    def subtract_sent(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        """``out -= decompress(...)``: each chunk's decoded values (rows of the same 256-row table that
        ``decompress`` reads) gathered into a reused scratch buffer and subtracted from that chunk.

        Why: it spares the d-sized tensor that ``decompress`` must return and a second pass over it; chunks of
        2^18 entries keep the per-thread scratch at 1 MB. The gather, not the memory traffic, is the cost, so
        neither integer selection between the two values' bit patterns nor deferring the subtraction to error
        feedback's next x + r pass helps (docs/methods/sign.md has the times).
        """
        packed = fields[0]
        _check_packed(packed, slot.numel, f"{self.name}: {slot.name}", received=False)
        positive, negative = self._decode_values(fields, slot)
        packed = packed.reshape(-1)
        kernel = _kernel_for(packed, out)
        if kernel is not None:  # one compiled pass: the same float32 subtraction per entry
            kernel.sign_subtract(packed.contiguous().numpy(), np.float32(positive), np.float32(negative), out.numpy())
            return
        table = _value_table(packed.device, positive, negative)
        groups = packed_count(min(slot.numel, _SUBTRACT_CHUNK))
        if host_path(packed):
            scratch = workspace("subtract-signs", 8 * groups, torch.float32).view(groups, 8)
        else:
            scratch = torch.empty(groups, 8, dtype=torch.float32, device=packed.device)
        for start in range(0, slot.numel, _SUBTRACT_CHUNK):  # a multiple of 8: every chunk starts on a byte
            n = min(_SUBTRACT_CHUNK, slot.numel - start)
            rows = scratch[: packed_count(n)]
            torch.index_select(table, 0, _rows(packed[start // 8 : start // 8 + packed_count(n)]), out=rows)
            out[start : start + n].sub_(rows.reshape(-1)[:n])

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        packed = fields[0]
        _check_packed(packed, slot.numel, f"{self.name}: {slot.name}")
        positive, negative = self._received_values(fields, slot)
        if out.is_contiguous():
            _expand_add(packed, slot.numel, positive, negative, out.view(-1))
        else:  # a reshape would copy: add the dense tensor instead
            out += _expand(packed, slot.numel, positive, negative).reshape(out.shape)


class VoteTally(Tally):
    """Majority vote by counting sign bits: the workers' bitmaps are added as bit-sliced integers.

    Plane l holds bit l of each coordinate's number of negative votes n, 64 coordinates per int64 word (the
    bitmap's bytes read 8 at a time), and adding a worker's bitmap is a ripple of word-wise AND / XOR through
    the planes. The vote of W workers is + where n < W/2, − where n > W/2 and 0 on a tie (n = W/2, even W):
    exactly ``sign`` of the float sum of ±1 that ``accumulate`` + ``aggregate`` compute (a tie is +0.0 there
    too), but without decoding every worker's message into 32-bit floats; only the result is expanded
    (``benchmarks/vote_aggregate.py`` times it against decoding; docs/methods/sign.md has the times).
    """

    def __init__(self, slot: Slot, device: torch.device, name: str):
        self.slot, self.device, self.where = slot, device, f"{name}: {slot.name}"
        self.words = -(-packed_count(slot.numel) // 8)
        self.planes: list[Tensor] = []
        self.added = 0

    def add(self, fields: Fields) -> None:
        packed = fields[0]
        _check_packed(packed, self.slot.numel, self.where)
        raw = torch.zeros(8 * self.words, dtype=torch.uint8, device=self.device)
        raw[: packed.numel()] = packed.reshape(-1)
        carry = raw.view(torch.int64)
        for plane in self.planes:
            overflow = plane & carry
            plane ^= carry
            carry = overflow
        self.added += 1
        if len(self.planes) < self.added.bit_length():
            self.planes.append(carry)

    def result(self, count: int) -> Tensor:
        if count != self.added:
            raise ConfigError(f"{self.where}: a vote of {count} workers, but {self.added} messages were added")
        half = count // 2
        more, equal = _compare_planes(self.planes, half, self.words, self.device)
        negative = more  # n > W/2 (n > (W-1)/2 for odd W)
        positive = ~(more | equal) if count % 2 == 0 else ~more  # n < W/2; for odd W, n = (W-1)/2 too
        return _plus_minus(positive, negative, self.slot.numel)


def _compare_planes(planes: list[Tensor], k: int, words: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(n > k, n == k) as word masks, for the bit-sliced numbers n in ``planes`` and the constant k >= 0."""
    more = torch.zeros(words, dtype=torch.int64, device=device)
    equal = torch.full((words,), -1, dtype=torch.int64, device=device)
    for bit in reversed(range(max(len(planes), k.bit_length()))):
        plane = planes[bit] if bit < len(planes) else torch.zeros_like(more)
        if (k >> bit) & 1:
            equal &= plane
        else:
            more |= equal & plane
            equal &= ~plane
    return more, equal


def _numpy_bits(t: Tensor) -> bool:
    """Whether bit masks are expanded by numpy (CPU) or by torch ops (any device; tests check both)."""
    return host_path(t)


def _plus_minus(positive: Tensor, negative: Tensor, numel: int) -> Tensor:
    """float32 of ``numel`` entries: +1 where ``positive``'s bit is set, −1 where ``negative``'s is, else +0.0."""
    pos, neg = positive.view(torch.uint8), negative.view(torch.uint8)
    if _numpy_bits(pos):
        out = np.empty(numel, dtype=np.float32)
        up = np.unpackbits(pos.numpy(), count=numel, bitorder="little")
        down = np.unpackbits(neg.numpy(), count=numel, bitorder="little")
        np.subtract(up, down, out=out, dtype=np.float32)
        return torch.from_numpy(out)
    table = _bit_table(pos.device).to(torch.float32)
    up = torch.index_select(table, 0, pos.to(torch.int64)).reshape(-1)[:numel]
    return up.sub_(torch.index_select(table, 0, neg.to(torch.int64)).reshape(-1)[:numel])


class _MajorityVote(_Sign):
    """A message of sign bits only (±1 decoded); the update is the sign of the sum of the workers' signs.

    ``scale_free``: the aggregate is ±1 (or 0) whatever the size of what was sent, so it is a direction for the
    optimizer's lr to scale, never an update to apply as it is (``LocalUpdateExchange`` refuses such methods).
    """

    capabilities = Capabilities(accumulate=True, subtract_sent=True, tally=True)
    scale_free: ClassVar[bool] = True

    @staticmethod
    def _signs(flat: Tensor, step: int, before=None) -> Tensor:
        """The sign bitmap of the flat ``flat`` at exchange ``step``: an entry equal to 0 (±0.0) is sent as + on
        even steps and as − on odd ones, so that a coordinate that is 0 on every worker moves back and forth by
        lr instead of drifting by −lr a step (module docstring)."""
        return _pack(flat, before=before, zero_negative=step % 2 == 1)[0]

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [_sign_spec(slot)]

    def _decode_values(self, fields: Fields, slot: Slot) -> tuple[Tensor, Tensor]:
        one = torch.ones((), dtype=torch.float32, device=fields[0].device)
        return one, -one

    def aggregate(self, total: Tensor, count: int) -> Tensor:
        """Majority vote: sign(sum of ±1) per coordinate; a tie (even ``count``) gives 0."""
        return total.sign_()

    def new_tally(self, slot: Slot, device: torch.device) -> VoteTally:
        return VoteTally(slot, device, self.name)


class SignSGD(_MajorityVote):
    """signSGD with majority vote: send sign(g) in one bit per coordinate; the update is the vote.

    Learning rate: every coordinate moves by exactly ±lr (0 on a tie), independent of |g|, so lr is the
    per-coordinate step size: about 1e-4 to 1e-3 on MNIST with SGD and no optimizer momentum.
    """

    capabilities = _MajorityVote.capabilities
    name = "signsgd"

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        return [self._signs(_f32(x), step)]  # float64 rounded to float32 first, as the rest of the family does


class Signum(_MajorityVote):
    """Signum with majority vote: m = β·m + (1 − β)·g on the worker, send sign(m); the update is the vote.

    Learning rate: as for signsgd, every coordinate moves by exactly ±lr (0 on a tie), so lr is the
    per-coordinate step (about 1e-4 to 1e-3 on MNIST); the optimizer must run without momentum (the CLI
    sets it to 0, since this method owns momentum — give ``momentum`` here instead).
    """

    capabilities = _MajorityVote.capabilities
    name = "signum"
    owns_momentum: ClassVar[bool] = True

    def __init__(self, momentum: float = 0.9):
        self.average = MovingAverage(momentum, "signum")  # m per slot; its state dict: {"momentum": {key: m}}
        self.momentum, self.state = self.average.beta, self.average.state

    def params(self) -> dict[str, Any]:
        return {"momentum": self.momentum}

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        m, update = self.average.step(slot, _f32(x))
        return [self._signs(m, step, before=update)]  # each chunk's signs packed right after its update, in cache

    def retain(self, slots: list[Slot]) -> None:
        self.state.retain(slots)

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)


def _signs_and_sums(
    flat: Tensor, maps, signs: bool = True, count: bool = False, before=None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(a float64 tensor of sum(m(flat)) for each elementwise map ``m(piece, out=scratch)``, the sign bitmap
    ``pack_signs(flat)``, its count of negative entries): one pass over ``flat`` instead of two on the CPU, each
    2^20-entry chunk packed while it is in cache.

    The sums go through one small scratch buffer (for the reason given in ``_pack``): the float32 ``sum`` of each
    mapped chunk, added in float64. The scratch buffer is reused across calls (``workspace``).
    ``before(start, end)``, if given, updates ``flat[start:end]`` in place just before that chunk is read (error
    feedback's r += x, ``_Sign.compress_sum``); where the chunks are not read in one pass, it runs on the whole
    tensor first.
    """
    d = flat.numel()
    fused = signs and _numpy_path(flat)
    if before is not None and not fused:
        before(0, d)
        before = None
    packed = negatives = None
    if signs and not fused:
        packed, negatives = _pack(flat, count)
    if host_path(flat):
        scratch = workspace("sign-sums", min(d, _CHUNK), torch.float32)
    else:
        scratch = torch.empty(min(d, _CHUNK), dtype=torch.float32, device=flat.device)
    if fused:
        packed = torch.empty(packed_count(d), dtype=torch.uint8)
        x, o = flat.detach().contiguous().numpy(), packed.numpy()
        kernel = kernels.sign(d) if flat.dtype in _KERNEL_FLOATS else None
        mask_buffer = workspace("signs", min(d, _CHUNK), torch.bool).numpy() if kernel is None else None
        negative = 0
    parts = []
    for start in range(0, d, _CHUNK):
        piece = flat[start : start + _CHUNK]
        if before is not None:
            before(start, start + piece.numel())
        out = scratch[: piece.numel()]
        parts.append(torch.stack([m(piece, out=out).sum() for m in maps]))
        if fused:
            dest = o[start // 8 : start // 8 + packed_count(piece.numel())]
            negative += _pack_piece(x[start : start + _CHUNK], dest, kernel, mask_buffer, count)
    if fused and count:
        negatives = torch.tensor(negative, dtype=torch.int64)
    return torch.stack(parts).double().sum(0), packed, negatives


def _nonnegative(piece: Tensor, out: Tensor) -> Tensor:
    return torch.clamp(piece, min=0, out=out)


def _negative(piece: Tensor, out: Tensor) -> Tensor:
    return torch.clamp(piece, max=0, out=out)


def _finite_or_f64(values: Tensor, recompute, name: str, slot: Slot) -> Tensor:
    """``values`` if all finite (one host sync), else ``recompute()`` (float64 sums) cast to float32, which must
    be finite: a NaN or Inf in the input (with error feedback, in g + residual, which can overflow for finite g
    near float32's largest value) raises NonFiniteGradientError naming the slot, before anything is sent.

    The device path reads nothing back: it always computes ``recompute()`` too (one more pass over the input)
    and sends, entry by entry, ``values`` where finite, else the float64 recomputation, which is itself NaN or
    ±Inf for a NaN or Inf input: the non-finite value then travels in the message and every decoded entry is
    non-finite, which the receivers' finiteness check of the sums sees."""
    if not host_path(values):
        return torch.where(torch.isfinite(values), values, recompute())
    if bool(torch.isfinite(values).all()):
        return values
    values = recompute()
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteGradientError(
            f"{name}: non-finite (NaN or Inf) value to send in {slot.name}: the gradient (plus the residual, "
            "with error feedback, whose sum can overflow float32) is not finite; it was not sent"
        )
    return values


class _ChunkedSign(_Sign):
    """EF-signSGD and 1-bit SGD: their compress reads the input chunk by chunk (``_signs_and_sums``), so error
    feedback's r += x is done chunk by chunk too, each chunk just before it is read (``compress_sum``): the
    same sums, one pass over the residual fewer from memory."""

    capabilities = Capabilities(accumulate=True, subtract_sent=True, compress_sum=True)

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        return self._compress(_f32(x), slot)

    def _compress(self, flat: Tensor, slot: Slot, before=None) -> Fields:
        """The fields for the flat float32 ``flat``; ``before`` as ``_signs_and_sums`` takes it."""
        raise NotImplementedError

    def compress_sum(self, x: Tensor, into: Tensor, slot: Slot, step: int) -> Fields:
        if not (_numpy_path(into) and into.dtype == x.dtype == torch.float32 and into.dim() == 1
                and into.is_contiguous() and x.shape == into.shape):
            return add_then_compress(self, x, into, slot, step)

        def add(start: int, end: int) -> None:  # x + r, the operands in error feedback's order
            torch.add(x[start:end], into[start:end], out=into[start:end])

        return self._compress(into, slot, before=add)


class EFSignSGD(_ChunkedSign):
    """EF-signSGD: send sign(p) and one fp32 scale ||p||_1 / d, p = g + residual; mean aggregation.

    Error feedback is on by default (``make`` wraps it in ErrorFeedback). Learning rate: the scale keeps
    the magnitude of the gradient (the update has the size of mean |g|), so the usual SGD lr works; on
    MNIST lr 0.4 without optimizer momentum (the effective step of lr 0.05 with momentum 0.9).
    """

    capabilities = _ChunkedSign.capabilities
    name = "efsignsgd"
    default_error_feedback: ClassVar[bool] = True

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [_sign_spec(slot), FieldSpec(Codec.F32, count=1)]

    def _compress(self, flat: Tensor, slot: Slot, before=None) -> Fields:
        d = flat.numel()
        if d == 0:
            return [torch.zeros(0, dtype=torch.uint8, device=flat.device), torch.zeros(1, device=flat.device)]
        sums, packed, _ = _signs_and_sums(flat, (torch.abs,), before=before)
        scale = (sums / d).to(torch.float32)

        def in_float64() -> Tensor:  # (on a device, summed in float64 without a float64 copy of the input)
            total = flat.abs().sum(dtype=torch.float64) if not host_path(flat) else flat.double().abs().sum()
            return (total / d).to(torch.float32).reshape(1)

        scale = _finite_or_f64(scale, in_float64, self.name, slot)
        return [packed, scale]

    def _decode_values(self, fields: Fields, slot: Slot) -> tuple[Tensor, Tensor]:
        scale = fields[1].reshape(-1)[0].to(torch.float32)
        return scale, -scale


class OneBit(_ChunkedSign):
    """1-bit SGD: sign bit plus two fp32 values, the mean of the entries >= 0 and of the entries < 0.

    Error feedback is on by default. Learning rate: the two means keep the gradient's magnitude, so the
    usual SGD lr works; on MNIST lr 0.4 without optimizer momentum (the effective step of lr 0.05 with
    momentum 0.9).
    """

    capabilities = _ChunkedSign.capabilities
    name = "onebit"
    default_error_feedback: ClassVar[bool] = True

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [_sign_spec(slot), FieldSpec(Codec.F32, count=2)]

    def _compress(self, flat: Tensor, slot: Slot, before=None) -> Fields:
        d = flat.numel()
        if d == 0:
            return [torch.zeros(0, dtype=torch.uint8, device=flat.device), torch.zeros(2, device=flat.device)]
        sums, packed, n_negative = _signs_and_sums(flat, (_nonnegative, _negative), count=True, before=before)
        n_negative = n_negative.double()
        counts = torch.stack([(d - n_negative).clamp(min=1), n_negative.clamp(min=1)])  # an empty side sums to 0
        means = (sums / counts).to(torch.float32)

        def in_float64() -> Tensor:
            if host_path(flat):
                wide = flat.double()
                exact = torch.stack([wide.clamp(min=0).sum(), wide.clamp(max=0).sum()])
            else:  # summed in float64 without a float64 copy of the input (clamping is exact in float32)
                wide = torch.float64
                exact = torch.stack([flat.clamp(min=0).sum(dtype=wide), flat.clamp(max=0).sum(dtype=wide)])
            return (exact / counts).to(torch.float32)

        return [packed, _finite_or_f64(means, in_float64, self.name, slot)]

    def _decode_values(self, fields: Fields, slot: Slot) -> tuple[Tensor, Tensor]:
        means = fields[1].reshape(-1).to(torch.float32)
        return means[0], means[1]

