"""Natural compression, natural and standard random dithering, and TernGrad.

Horváth, Ho, Horváth, Sahu, Canini, Richtárik, "Natural Compression for Distributed Deep Learning",
MSML 2022 (C_nat, D_nat, D_sta); Alistarh et al., "QSGD", NeurIPS 2017 (D_sta with p = 2); Wen et al.,
"TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning", NeurIPS 2017.

All four are stochastic, unbiased (TernGrad only without clipping) and never summable: their codes are
integers of sign and level, not values that add. Everything is vectorized torch on the tensor's device;
``compress`` synchronises with the host exactly once on the host path (the NaN/Inf check) and never on the
device path, where a NaN or Inf travels in the message instead (a non-finite norm or scale, or C_nat's exponent
code 255) and shows in the receivers' sums, whose finiteness the step reads anyway; ``decompress`` never.

Speed (CPU): C_nat's codes come from one compiled pass (``gradcomp.kernels.cnat_kernel``: random number, code,
sign and the NaN/Inf check together), its 9-bit packing from the compiled packer (``gradcomp.kernels``, packed
by ``wire.encode`` straight into the message), and its decoding and adding-up from one compiled pass each;
without numba the same formulas run as torch operations and give the same codes. The ditherings and TernGrad
make their codes in chunks of 2^17 entries with reused scratch buffers (everything after the norm is
elementwise, and the random numbers drawn chunk by chunk from the same generator are the same numbers in the
same order, so the codes are bit-identical), and max|x| comes from one min/max pass instead of a d-sized |x|.
On the CPU the ditherings' level index and sign are one compiled pass per chunk (``kernels.dither_kernel``, the
same float32 operations), and their codes are int16 up to 15 bits (``wire.bits.decoded_dtype``); what remains
is mostly their random numbers (one mt19937 draw per entry). TernGrad's keep, sign and code steps are one
compiled pass too (``ternary_codes``), into int16 codes.

``cnat`` — natural compression C_nat. An entry t with 2^a <= |t| < 2^(a+1) becomes sign(t)·2^a with
probability (2^(a+1) − |t|)/2^a, else sign(t)·2^(a+1); 0 stays 0. On the IEEE-754 bits of the float32
entry (exponent field e, 23-bit mantissa m) this is: drop m and add one to e with probability m/2^23,
decided by comparing a uniform random 23-bit integer u with m (``e + (u < m)``; no log or pow). Wire: ONE
BITS field of width 9 and count d, each code = sign·2^8 + exponent code (the float32 sign bit and
biased exponent; the decoder rebuilds the float32 bit pattern ``sign << 31 | exponent << 23``), so
exactly 9 bits per entry plus the container and section headers. ω = 1/8: E||C(x)||² <= (9/8)||x||² for
normal float32 entries (|x_i| >= 2^-126); subnormals break it (below), by at most d·2^-252 in absolute terms.

Choices where the paper is silent:

- zero (either sign) is exponent code 0 with sign bit 0 and decodes to +0.0;
- subnormals |t| = m·2^-149 < 2^-126 (e = 0, m != 0): the same rule ``e + (u < m)`` rounds them to 0 or
  to sign(t)·2^-126 (exponent code 1) with probability m/2^23 = |t|/2^-126 — unbiased, bracketing, but not
  between neighbouring powers of two (a subnormal power of two such as 2^-149 is not sent exactly), so the
  relative variance of a subnormal entry is up to 2^23 instead of 1/8: E C(t)² = |t|·2^-126;
- overflow: rounding up from exponent 254 (|t| in [2^127, 2^128)) would give exponent 255 (Inf), so those
  entries always round down to sign(t)·2^127 — the one biased case, E[C(t)] = 2^127 instead of |t| < 2^128,
  for gradient entries above 1.7e38. Exponent code 255 is never sent (a decoder given one yields ±Inf);
- NaN/Inf input raises NonFiniteGradientError; inputs are cast to float32 first (exact for fp16/bf16);
- randomness: entry i's u is the top 23 bits of SplitMix64(key + (i + 1)·γ) (``uniform23``; γ = 0x9E3779B97F4A7C15,
  arithmetic modulo 2^64), a counter-based generator keyed by ``shared_seed(seed, step, slot index,
  "cnat:<worker>")``: fresh every step and tensor, reproducible, computable for any piece of a tensor on any
  device (the compiled kernel and the torch path give the same numbers), and independent per worker: the
  exchange tells each compressor its rank (``bind_worker``; the parameter server's compressor gets W), so
  workers' rounding errors are independent, as the variance-of-the-average analysis assumes. (Until the
  kernel, u came from torch's mt19937, whose one draw per entry was most of the time; SplitMix64's outputs
  pass BigCrush, and tests/test_kernels.py checks uniformity, the moments and independence across keys.)
- codes are int16 (they fit 9 bits): a quarter of the memory of the int64 codes other compressors emit;
  the wire decodes them to int16 too, like every BITS field of up to 15 bits (``wire.bits.decoded_dtype``).

``random_dithering`` — standard random dithering D_sta^{p,s} (QSGD for p = 2): y_i = |x_i|/||x||_p in
[0, 1] is rounded to one of the uniform levels l/s (l = 0..s), up with probability y_i·s − floor(y_i·s), and
the output is ||x||_p · sign(x_i) · l/s.

``natural_dithering`` — natural dithering D_nat^{p,s}: the levels are 0, 2^(1−s), 2^(2−s), …, 1/2, 1
(s + 1 of them); y_i in [2^(j−1−s), 2^(j−s)] is rounded to one of those two adjacent levels, y_i below
2^(1−s) between 0 and 2^(1−s), each unbiasedly. Level index j means 2^(j−s) for j >= 1 and 0 for j = 0.

Dithering wire layout (both): field 0 is the norm ||x||_p — one F32 value (``norm_codec="f32"``, the
default) or its 9-bit C_nat code (``norm_codec="cnat"``: one BITS field of width 9, count 1, rounded with its
own random draw, independent of the levels, so the product stays unbiased and the variance grows by at most
the factor 9/8); field 1 is one BITS field of width w = 1 + ceil(log2(s + 1)) and count d, each code
sign·2^(w−1) + level index (sign in the top bit, as in C_nat's codes). Natural and standard dithering with
the same ``levels`` s therefore cost exactly the same bits. A zero vector (norm 0) sends norm 0 and all-zero
codes. The paper's "31 + d(2 + log2 s)" bits count a variable-length level code; we use fixed-width codes.
At equal code width (same s) natural dithering has far lower variance for p = 2 and for heavy-tailed
vectors, but not always: for a Gaussian with p = inf most y_i lie in [0.1, 1], where the uniform step 1/s
wins for s >= 7 (d = 1000, s = 7: E||C(x) − x||²/||x||² = 0.083 natural vs 0.043 standard).

Dithering variance (class B(ω(d)); it depends on d, so ``omega`` is None and ``omega_bound(d)`` gives it).
One entry rounded between levels lo <= y <= hi has variance ||x||²_p·(y − lo)(hi − y). Standard: that is
<= ||x||_p²·min(1/(4s²), y/s); summed with ||x||_p <= ||x||_2 and ||y||_1 <= sqrt(d)·||x||_2/||x||_p it is
<= min(d/(4s²), sqrt(d)/s)·||x||_2², so the QSGD bound ω = min(d/s², sqrt(d)/s) holds for p = 2 and p = inf.
Natural: for y in [a, 2a], (y − a)(2a − y) <= y²/8; below b = 2^(1−s), y(b − y) <= min(y·b, b²/4); summed,
ω = 1/8 + min(sqrt(d)·2^(1−s), d·4^(1−s)) for p = 2 and p = inf (the form of the paper's theorem with
r = min(p, 2) = 2). With ``norm_codec="cnat"``, ω' = (9/8)(1 + ω) − 1.

Dithering choices: ``levels`` defaults to s = 7 for both (4-bit codes; natural levels down to 1/64);
``norm`` accepts 2, 2.0, "2", inf, "inf" (``params()`` reports "2" / "inf"); the norm is
computed in float32 as max|x|·||x/max|x|||_p so squares never overflow, and a norm that is still not finite
(NaN/Inf input, or ||x||_2 above 3.4e38) raises NonFiniteGradientError; y_i is computed in float32, so
entries below about 2^-149·||x||_p become y_i = 0 and always round to 0, and rounding of y_i·s can push an
entry past level s, which is clamped to s (a relative bias of at most one float32 ulp). ``levels`` is at
most 2^24 − 1 for standard dithering (the level index must be exact in float32) and at most 126 for natural
dithering (2^(1−s) must be a normal float32). Randomness as in C_nat, salted with the method's name; the
rounding-up probability is compared with ``torch.rand`` draws (multiples of 2^-24), so it is exact for
natural dithering's in-octave probabilities (multiples of 2^-23) and within 2^-24 otherwise.

``terngrad`` — per tensor: optional clipping of x to [−c·σ, c·σ] (σ the population standard deviation of
the tensor's entries, computed scale-safe; ``clip`` c = 2.5 by default, 0 turns it off; skipped where σ = 0,
a one-entry tensor or one whose entries are all equal, which a bound of 0 would zero), scale s = max|x|
after clipping, output s·sign(x_i)·b_i with b_i ~ Bernoulli(|x_i|/s). Wire: field 0 the scale (F32, 1
value), field 1 one BITS field of width 2 and count d: code 0 = 0, 1 = +s, 2 = −s (3 is never sent and
decodes to 0). Unbiased only with ``clip=0`` (up to the 2^-24 granularity of the ``torch.rand`` draws the
keep probabilities are compared with, as for the ditherings): clipping shrinks the large entries, a deliberate bias that
the paper trades for lower variance (``unbiased`` is then False). With clip = 0, E||C(x)||² = s·||x||_1 <=
sqrt(d)·||x||², so ``omega_bound(d)`` = sqrt(d) − 1. Here each worker sends its own s; the paper's scaler
sharing (one s = the max over workers, agreed in a max-allreduce round first) needs a second round and is
the scheme ``terngrad_shared`` (``gradcomp.schemes.terngrad_shared``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from gradcomp import kernels
from gradcomp.compressors.base import (
    Capabilities,
    Compressor,
    Fields,
    Slot,
    add_decompressed,
    check_int,
    shared_generator,
    shared_seed,
)
from gradcomp.compressors.sparse import workspace
from gradcomp.errors import ConfigError, NonFiniteGradientError
from gradcomp.wire import Codec, FieldSpec
from gradcomp.wire.bits import decoded_dtype, host_path
from gradcomp.wire.refusals import check_received_range

__all__ = ["NaturalCompression", "RandomDithering", "NaturalDithering", "TernGrad", "cnat_encode", "cnat_decode"]

CNAT_WIDTH = 9
_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_MAX_EXPONENT = 254  # largest finite biased exponent of float32
_INF_BITS = 0x7F800000  # the bit pattern of +Inf: a magnitude's pattern at least this is NaN or Inf


def _flat_f32(x: Tensor) -> Tensor:
    return x.reshape(-1).to(torch.float32)


def _check_seed(seed: object) -> int:
    return check_int("seed", seed, minimum=0)


_CHUNK = 1 << 17  # entries per step of the chunked CPU loops below (their scratch stays in cache)


def _cpu_loop(flat: Tensor) -> bool:
    """Whether the chunked CPU loops below run (CPU tensors) or whole-tensor torch ops (any device; the same
    codes: tests switch the loops off to check the whole-tensor path on the CPU)."""
    return host_path(flat)


def _as_int64(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value`` (torch has no full uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 words (torch's is arithmetic): the sign-extended bits masked off."""
    return torch.bitwise_right_shift(z, bits).bitwise_and_((1 << (64 - bits)) - 1)


def uniform23(key: int, start: int, count: int, device: torch.device | str = "cpu") -> Tensor:
    """C_nat's random numbers for entries ``start .. start + count − 1`` (int64 in [0, 2^23)).

    Entry i draws the top 23 bits of SplitMix64(key + (i + 1)·γ) mod 2^64: a counter-based generator, so any
    piece of a tensor can be coded on its own, on any device, with the same numbers, and the compiled kernel
    (gradcomp.kernels.cnat_kernel) computes exactly these. int64 arithmetic wraps modulo 2^64 in torch on every
    backend, as the generator needs.
    """
    z = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device)
    z.mul_(_as_int64(kernels.SPLITMIX_GAMMA)).add_(_as_int64(key & ((1 << 64) - 1)))
    z.bitwise_xor_(_shift_right(z, 30)).mul_(_as_int64(kernels.SPLITMIX_MIX1))
    z.bitwise_xor_(_shift_right(z, 27)).mul_(_as_int64(kernels.SPLITMIX_MIX2))
    z.bitwise_xor_(_shift_right(z, 31))
    return _shift_right(z, 41)


def _codes_from_draws(bits: Tensor, u: Tensor, keep_non_finite: bool = False) -> Tensor:
    """int16 codes of int32 bit patterns ``bits`` given their draws ``u`` (the kernel's formula, in torch).

    ``keep_non_finite``: a NaN or Inf entry gets exponent code 255, which decodes to ±Inf (the device path, which
    reads nothing back: the non-finite value travels in the message instead of being clamped to a finite one)."""
    carry = torch.neg(u.to(torch.int32)).add_(_MANTISSA_MASK)  # 2^23 − 1 − u: carries into the exponent iff u < m
    magnitude = torch.bitwise_and(bits, 0x7FFFFFFF)
    code = magnitude.add(carry).bitwise_right_shift_(_MANTISSA_BITS)
    code = code.clamp_(max=_MAX_EXPONENT)  # exponent 254 never rounds up to Inf
    if keep_non_finite:
        code = torch.where(magnitude >= _INF_BITS, _MAX_EXPONENT + 1, code)
    negative = (bits < 0).logical_and_(code != 0)  # a zero code carries no sign
    return code.bitwise_or_(negative.to(torch.int32).bitwise_left_shift_(8)).to(torch.int16)


def cnat_encode(x: Tensor, key: int, where: str = "tensor", check: bool = True) -> Tensor:
    """The 9-bit C_nat codes (int16, sign·256 + exponent code) of the float32 tensor ``x``, with random numbers
    ``uniform23(key, 0, d)``.

    With ``check`` (the default) raises NonFiniteGradientError for NaN/Inf: one host synchronisation, on the host
    path only. On the device path (``wire.bits.host_path`` False) nothing is read back: a NaN or Inf entry gets
    exponent code 255 and decodes to ±Inf, so the non-finite value reaches the receivers' sums, whose finiteness
    the step reads anyway, instead of a finite code standing in for it (without ``check``, codes are clamped to
    finite ones on either path, as before).

    The exponent is rounded up with probability mantissa / 2^23 by one integer addition: adding
    (2^23 − 1 − u), u uniform in [0, 2^23), to |x|'s bit pattern carries into the exponent field exactly when
    u < mantissa. A code of 0 (the value 0) never carries a sign.

    On the CPU the compiled kernel (``gradcomp.kernels.cnat_kernel``) does everything in one pass, the range
    check included; without it (and on other devices) the same formula runs as torch operations, in chunks of
    ``_CHUNK`` entries on the CPU so the int64 temporaries stay small: the same codes either way.
    """
    flat = _flat_f32(x).contiguous()
    bits = flat.view(torch.int32)
    d = flat.numel()
    cpu = _cpu_loop(flat)
    kernel = kernels.cnat() if cpu else None
    if kernel is not None:
        out = torch.empty(d, dtype=torch.int16)
        worst = int(kernel.cnat_codes(bits.numpy(), key & ((1 << 64) - 1), 0, out.numpy())) if d else 0
        finite = worst < 0x7F800000  # NaN/Inf: the magnitude's bit pattern is at least that of Inf
    else:
        finite = not check or not cpu or bool(torch.isfinite(flat).all())  # the device path reads nothing back
        step = _CHUNK if cpu else max(1, d)
        pieces = [
            _codes_from_draws(bits[s : s + step], uniform23(key, s, min(step, d - s), flat.device), check and not cpu)
            for s in range(0, d, step)
        ]
        if len(pieces) == 1:
            out = pieces[0]
        else:  # (no pieces for an empty tensor)
            out = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int16, device=flat.device)
    if check and not finite:
        raise NonFiniteGradientError(f"non-finite (NaN or Inf) value in {where}; cannot compress with cnat")
    return out


def cnat_decode(codes: Tensor) -> Tensor:
    """Float32 values of 9-bit C_nat codes: ±2^(exponent code − 127), 0 for exponent code 0.

    A code is the float's top 9 bits (sign bit 8, biased exponent bits 0-7), so shifting it left by the 23
    mantissa bits gives the float's bit pattern: one int32 shift (on the CPU one compiled pass from any integer
    dtype, ``gradcomp.kernels.cnat_kernel``). (Code 256, a sign on exponent 0, which the encoder never makes,
    reads as −0.0.) Codes outside [0, 512) are the caller's error: the wire's 9-bit fields cannot hold them.
    """
    flat = codes.reshape(-1)
    kernel = kernels.cnat() if _cpu_loop(flat) else None
    if kernel is not None:
        bits = torch.empty(flat.numel(), dtype=torch.int32)
        kernel.cnat_bit_patterns(flat.contiguous().numpy(), bits.numpy())
        return bits.view(torch.float32)
    bits = flat.to(torch.int32) if flat.dtype != torch.int32 else flat.clone()
    return bits.bitwise_left_shift_(_MANTISSA_BITS).view(torch.float32)


class NaturalCompression(Compressor):
    """C_nat: every entry randomly rounded to one of its two neighbouring signed powers of two, 9 bits each."""

    capabilities = Capabilities(accumulate=True)
    name = "cnat"
    unbiased = True
    omega = 1.0 / 8.0

    def __init__(self, seed: int = 0):
        self.seed = _check_seed(seed)

    def params(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [FieldSpec(Codec.BITS, count=slot.numel, width=CNAT_WIDTH)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        return [cnat_encode(x, shared_seed(self.seed, step, slot.index, salt=f"cnat:{self.worker}"), slot.name)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return cnat_decode(fields[0])

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        """``out += decompress(fields)``; on the CPU one compiled pass without the d-sized float32 message (the
        same float32 addition per entry, so the same sums)."""
        codes = fields[0].reshape(-1)
        same_size = codes.numel() == out.numel()  # the kernel does not check bounds; out += t raises otherwise
        kernel = kernels.cnat() if _cpu_loop(out) and out.is_contiguous() and same_size else None
        if kernel is None:
            return add_decompressed(self, fields, slot, step, out)
        kernel.cnat_accumulate(codes.contiguous().numpy(), out.view(-1).numpy())


# ----------------------------------------------------------------------------------------------- dithering

_LOOKUP_MAX_BITS = 16  # the ditherings' compiled decoder holds a float32 per possible level index


def _lookup_target(out: Tensor | None) -> bool:
    """Whether the compiled lookup decoder can write into ``out`` (None: it makes its own)."""
    return out is None or (out.is_contiguous() and out.dtype == torch.float32 and host_path(out))


def _run_lookup(
    kernel, codes: Tensor, mask: int, sign_shift: int, table: Tensor, scale: Tensor, out: Tensor | None, add: bool
) -> Tensor:
    """±scale · table[code & mask] for every code (``kernels.lookup_kernel``), into ``out`` or a new tensor."""
    if out is None:
        out = torch.empty(codes.numel(), dtype=torch.float32)
    elif out.numel() != codes.numel():  # the kernel does not check bounds: refuse here, as out += t would
        raise ConfigError(f"{codes.numel()} codes cannot be added into a tensor of {out.numel()} entries")
    scale = scale.to(torch.float32).reshape(1)
    kernel.lookup(codes.contiguous().numpy(), mask, sign_shift, table.numpy(), scale.numpy(), out.view(-1).numpy(), add)
    return out


def _check_norm(norm: object) -> str:
    if isinstance(norm, bool):
        raise ConfigError(f"norm must be 2 or 'inf', got {norm!r}")
    if isinstance(norm, str):
        key = norm.strip().lower()
        if key in ("2", "2.0"):
            return "2"
        if key in ("inf", "infinity"):
            return "inf"
    elif isinstance(norm, (int, float)):
        if norm == 2:
            return "2"
        if norm == math.inf:
            return "inf"
    raise ConfigError(f"norm must be 2 or 'inf', got {norm!r}")


NORM_CODECS = ("f32", "cnat")


def _check_norm_codec(norm_codec: object) -> str:
    if norm_codec not in NORM_CODECS:
        raise ConfigError(f"norm_codec must be one of {list(NORM_CODECS)}, got {norm_codec!r}")
    return norm_codec


def _peak(flat: Tensor) -> Tensor:
    """max|x| (NaN if there is one) without a d-sized |x|: the larger magnitude of the minimum and the maximum."""
    low, high = torch.aminmax(flat)
    return torch.maximum(low.abs(), high.abs())


def _scaled(flat: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(max|x|, x / max|x|) with the division guarded for the zero vector (then x itself); into ``out``."""
    peak = _peak(flat)
    safe = torch.where(peak > 0, peak, torch.ones_like(peak))
    return peak, torch.div(flat, safe, out=out)


class _Dithering(Compressor):
    """Shared machinery: [norm field, sign+level codes]; subclasses map y in [0, 1] to level indices."""

    capabilities = Capabilities(accumulate=True)
    unbiased = True
    omega = None
    max_levels = 1

    def __init__(self, levels: int = 7, norm: int | str = 2, seed: int = 0, norm_codec: str = "f32"):
        self.levels = check_int("levels", levels, minimum=1)
        if self.levels > self.max_levels:
            raise ConfigError(f"{self.name}: levels must be <= {self.max_levels}, got {self.levels}")
        self.norm = _check_norm(norm)
        self.seed = _check_seed(seed)
        self.norm_codec = _check_norm_codec(norm_codec)
        self.level_bits = self.levels.bit_length()  # = ceil(log2(s + 1))
        self.width = 1 + self.level_bits
        self._table: Tensor | None = None  # every level index's value, for the compiled decoder (``_lookup``)

    def params(self) -> dict[str, Any]:
        return {"levels": self.levels, "norm": self.norm, "seed": self.seed, "norm_codec": self.norm_codec}

    def specs(self, slot: Slot) -> list[FieldSpec]:
        if self.norm_codec == "f32":
            norm_spec = FieldSpec(Codec.F32, count=1)
        else:
            norm_spec = FieldSpec(Codec.BITS, count=1, width=CNAT_WIDTH)
        return [norm_spec, FieldSpec(Codec.BITS, count=slot.numel, width=self.width)]

    def _omega(self, numel: int) -> float:
        raise NotImplementedError

    def omega_bound(self, numel: int) -> float:
        """ω(d) of class B(ω) for a tensor of ``numel`` entries (see the module docstring)."""
        w = self._omega(numel)
        return (1.0 + w) * 9.0 / 8.0 - 1.0 if self.norm_codec == "cnat" else w

    def _level_index(self, y: Tensor, u: Tensor) -> Tensor:
        raise NotImplementedError

    def _level_value(self, index: Tensor) -> Tensor:
        raise NotImplementedError

    # the dither_kernel function that reproduces this class's _level_index and _codes, declared in the class's
    # own body; not inherited (__init_subclass__): a subclass that quantises otherwise must not run it
    _CODES_KERNEL: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_CODES_KERNEL" not in cls.__dict__:
            cls._CODES_KERNEL = None

    def _codes_kernel(self, numel: int):
        """The compiled codes of this method for ``numel`` entries on the CPU, or None: the kernel the class
        declares (``_CODES_KERNEL``), which a subclass that does not declare one never inherits."""
        name = self._CODES_KERNEL
        module = kernels.dither(numel) if name else None
        return getattr(module, name) if module is not None else None

    def _codes(self, y: Tensor, u: Tensor, x: Tensor, out: Tensor, cpu: bool) -> None:
        """out (integer) = the codes of one chunk: sign·2^level_bits + level index of y (u: its uniform draws,
        x: the entries themselves, for the sign). ``y`` and ``u`` may be overwritten."""
        index = self._level_index(y, u).clamp_(0, self.levels).to(torch.int64)
        negative = (x < 0).logical_and_(index > 0)
        out.copy_(index.bitwise_or_(negative.to(torch.int64).bitwise_left_shift_(self.level_bits)))

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = _flat_f32(x)
        device = flat.device
        if flat.numel() == 0:
            norm = torch.zeros(1, dtype=torch.float32, device=device)
            codes = torch.zeros(0, dtype=decoded_dtype(self.width), device=device)
        else:
            # on the CPU x / max|x| goes to a reused buffer (it must exist whole: the 2-norm is one reduction)
            cpu = _cpu_loop(flat)
            peak, scaled = _scaled(flat, workspace("dithering", flat.numel(), torch.float32) if cpu else None)
            if self.norm == "2":
                scaled_norm = torch.linalg.vector_norm(scaled)
            else:
                scaled_norm = torch.where(peak > 0, torch.ones_like(peak), torch.zeros_like(peak))
            norm = (peak * scaled_norm).reshape(1)
            # the device path reads nothing back: a non-finite norm is sent as it is and every decoded entry is
            # then NaN or ±Inf (0 · Inf is NaN), which the receivers' finiteness check of the sums sees
            if cpu and not bool(torch.isfinite(norm).all()):
                raise NonFiniteGradientError(
                    f"{self.name}: the {self.norm}-norm of {slot.name} is not finite (NaN/Inf input or overflow)"
                )
            divisor = torch.where(scaled_norm > 0, scaled_norm, torch.ones_like(scaled_norm))
            gen = shared_generator(self.seed, step, slot.index, device, salt=f"{self.name}:{self.worker}")
            # the narrowest dtype of the codes' width, as the wire decodes them (int16 up to 15 bits): a quarter
            # of int64's memory, and of the page faults of a fresh d-sized buffer
            codes = torch.empty(flat.numel(), dtype=decoded_dtype(self.width), device=device)
            # Everything from here is elementwise, so chunks give the codes of the whole tensor, and drawing u
            # chunk by chunk from the generator draws the same numbers in the same order: bit-identical codes,
            # with chunk-sized temporaries (reused by the allocator) instead of a dozen d-sized ones.
            step_size = _CHUNK if cpu else max(1, flat.numel())
            width = min(step_size, flat.numel())
            y_buf = workspace("dithering-y", width, torch.float32) if cpu else None
            u_buf = workspace("dithering-u", width, torch.float32) if cpu else None
            compiled = self._codes_kernel(flat.numel()) if cpu else None
            for start in range(0, flat.numel(), step_size):
                piece = scaled[start : start + step_size]
                n = piece.numel()
                y = torch.abs(piece, out=None if y_buf is None else y_buf[:n]).div_(divisor)
                # torch.rand(n, generator=gen) is uniform_ on a fresh tensor: the same draws
                u = torch.rand(n, generator=gen, device=device) if u_buf is None else u_buf[:n].uniform_(generator=gen)
                x = flat[start : start + step_size]
                if compiled is not None:  # one pass, the same float32 operations: the same codes
                    out = codes[start : start + n].numpy()
                    compiled(y.numpy(), u.numpy(), x.numpy(), self.levels, self.level_bits, out)
                else:
                    self._codes(y, u, x, codes[start : start + n], cpu)
        if self.norm_codec == "cnat":
            key = shared_seed(self.seed, step, slot.index, salt=f"{self.name}:norm:{self.worker}")
            # checked finite already on the host path; on the device path a NaN / Inf norm becomes code 255 (±Inf)
            norm = cnat_encode(norm, key, slot.name, check=not _cpu_loop(norm))
        return [norm, codes]

    def _norm_value(self, norm: Tensor) -> Tensor:
        return norm.to(torch.float32) if self.norm_codec == "f32" else cnat_decode(norm)

    def _decode_compiled(self, fields: Fields, out: Tensor | None = None, add: bool = False) -> Tensor | None:
        """The message decoded into a new float32 tensor (``out`` None), into ``out``, or added to it (``add``) by
        the compiled table-lookup decoder, on the CPU; None (nothing done) where it does not apply.

        The table covers every index the mask lets through, 2^level_bits entries, so at most ``_LOOKUP_MAX_BITS``
        level bits (random dithering allows 24); it is computed by ``_level_value`` itself, once per instance.
        """
        norm, codes = fields
        codes = codes.reshape(-1)
        if not _cpu_loop(codes) or self.level_bits > _LOOKUP_MAX_BITS or not _lookup_target(out):
            return None
        kernel = kernels.lookup(codes.numel())
        if kernel is None:
            return None
        if self._table is None:
            self._table = self._level_value(torch.arange(1 << self.level_bits)).to(torch.float32).contiguous()
        mask = (1 << self.level_bits) - 1
        return _run_lookup(kernel, codes, mask, self.level_bits, self._table, self._norm_value(norm), out, add)

    def check_message(self, norm: Tensor, codes: Tensor | None, slot: Slot) -> None:
        """WireError (through ``wire.refusals.check_received``: on the device path with the step's one read) for
        what no sender makes and a checksum cannot catch when the sender itself is wrong: a norm below 0 (every
        decoded entry's sign flipped) or a level index above ``levels``, which the code's width allows unless
        ``levels`` is 2^b − 1 (QSGD's 16 levels take 5 bits: indices up to 31 would decode above the norm). The
        index check is one pass over the codes, made only where such an index fits."""
        where = f"{self.name}: {slot.name}"
        check_received_range(self._norm_value(norm).reshape(-1), 0.0, None, f"{where}: a negative norm")
        if codes is not None and self.levels != (1 << self.level_bits) - 1:
            index = codes.reshape(-1) & ((1 << self.level_bits) - 1)
            check_received_range(index, None, self.levels, f"{where}: a level index above levels = {self.levels}")

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        self.check_message(fields[0], fields[1], slot)
        return self._values(fields)

    def _values(self, fields: Fields) -> Tensor:
        """The message's values, unchecked (``check_message``)."""
        decoded = self._decode_compiled(fields)  # one compiled pass, the same values (kernels.lookup_kernel)
        if decoded is not None:
            return decoded
        norm, codes = fields
        norm = self._norm_value(norm)
        codes = codes.reshape(-1)
        index = codes & ((1 << self.level_bits) - 1)
        magnitude = norm.reshape(()) * self._level_value(index)
        return torch.where((codes >> self.level_bits) & 1 == 1, -magnitude, magnitude)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        """``out += decompress(fields)``; on the CPU one compiled pass without the d-sized message (the same
        float32 addition per entry). A subclass that does not declare ``accumulate`` among its capabilities gets
        ``out += decompress(...)``."""
        if not self.capabilities.accumulate:
            add_decompressed(self, fields, slot, step, out)
            return
        self.check_message(fields[0], fields[1], slot)
        if self._decode_compiled(fields, out, add=True) is None:
            out += self._values(fields)


class RandomDithering(_Dithering):
    """Standard random dithering D_sta^{p,s} (QSGD for p = 2): uniform levels l/s on |x_i|/||x||_p."""

    capabilities = _Dithering.capabilities
    name = "random_dithering"
    max_levels = (1 << 24) - 1
    _CODES_KERNEL = "random_codes"

    def _omega(self, numel: int) -> float:
        s = self.levels
        return min(numel / s**2, math.sqrt(numel) / s)

    def _level_index(self, y: Tensor, u: Tensor) -> Tensor:
        scaled = y * float(self.levels)
        lower = torch.floor(scaled)
        return (lower + (u < scaled - lower).to(torch.float32)).to(torch.int64)

    def _codes(self, y: Tensor, u: Tensor, x: Tensor, out: Tensor, cpu: bool) -> None:
        """``_level_index`` and the sign, op for op the same float32 arithmetic, into reused scratch (CPU)."""
        if not cpu:
            return super()._codes(y, u, x, out, cpu)
        n = y.numel()
        lower = workspace("dithering-lower", n, torch.float32)
        up = workspace("dithering-up", n, torch.bool)
        negative = workspace("dithering-negative", n, torch.bool)
        scaled = y.mul_(float(self.levels))  # y·s
        torch.floor(scaled, out=lower)
        torch.lt(u, scaled.sub_(lower), out=up)  # u < y·s − floor(y·s)
        index = lower.add_(up).clamp_(0, self.levels)  # floor + 0 or 1: an exact small integer in float32
        torch.gt(index, 0, out=negative)
        negative.logical_and_(torch.lt(x, 0, out=up))
        out.copy_(index)  # the integer, exactly
        out.add_(negative, alpha=1 << self.level_bits)  # the sign bit, where the level is not 0

    def _level_value(self, index: Tensor) -> Tensor:
        return index.to(torch.float32) / float(self.levels)


class NaturalDithering(_Dithering):
    """Natural dithering D_nat^{p,s}: levels 0, 2^(1−s), …, 1/2, 1 on |x_i|/||x||_p."""

    capabilities = _Dithering.capabilities
    name = "natural_dithering"
    max_levels = 126
    _CODES_KERNEL = "natural_codes"

    def _omega(self, numel: int) -> float:
        b = 2.0 ** (1 - self.levels)
        return 1.0 / 8.0 + min(math.sqrt(numel) * b, numel * b * b)

    def _level_index(self, y: Tensor, u: Tensor) -> Tensor:
        s = self.levels
        mantissa, exponent = torch.frexp(y)  # y = mantissa · 2^exponent, mantissa in [1/2, 1)
        # y in [2^(j−1−s), 2^(j−s)) with j = exponent + s; levels j − 1 (value a) and j (value 2a)
        upper = exponent.add_(s)
        p_up = mantissa.mul_(2.0).sub_(1.0)  # (y − a) / a, exact
        small = (upper <= 1).logical_or_(y == 0)  # y < 2^(1−s): between level 0 and level 1 (value 2^(1−s))
        p_up = torch.where(small, y * float(2.0 ** (s - 1)), p_up)
        upper.masked_fill_(small, 1)
        return upper.sub_((u >= p_up).to(upper.dtype))

    def _level_value(self, index: Tensor) -> Tensor:
        # 2^(j − s) built from its float32 bits (j − s + 127 in [1, 127] since s <= 126); 0 for j = 0
        biased = (index - self.levels + 127).clamp(min=1).to(torch.int32)
        value = (biased << _MANTISSA_BITS).view(torch.float32)
        return torch.where(index > 0, value, torch.zeros_like(value))


# ------------------------------------------------------------------------------------------------ terngrad

# TernGrad's codes as the compiled lookup decoder reads them: code & 3 indexes ±1 (code 3 is never sent and
# reads as 0, as in the torch path), and no code has a sign bit (bit 62: codes are 0, 1 or 2)
_TERNARY = torch.tensor([0.0, 1.0, -1.0, 0.0], dtype=torch.float32)
_TERNARY_CODES = decoded_dtype(2)  # TernGrad's codes in memory, as the wire decodes them: int16
_NO_SIGN_BIT = 62


def _ternary_chunks(
    scaled: Tensor, gen: torch.Generator, prob: Tensor | None = None, divisor: Tensor | None = None
) -> Tensor:
    """TernGrad's int16 codes of the 1-D CPU tensor ``scaled``, made in chunks of ``_CHUNK`` entries with reused
    scratch: entry i is kept where u_i < p_i (u_i uniform from ``gen``), p = ``prob`` or else |scaled| /
    ``divisor``, and its code is keep + (keep and scaled_i < 0). The same float32 operations and the same draws
    in the same order as the whole-tensor path of ``TernGrad.ternary_codes``, so the same codes; the last three
    steps are one compiled pass (``kernels.dither_kernel.ternary_codes``) where numba is in use."""
    d = scaled.numel()
    out = torch.empty(d, dtype=_TERNARY_CODES)
    width = min(d, _CHUNK)
    p_buf = workspace("terngrad-p", width, torch.float32)
    u_buf = workspace("terngrad-u", width, torch.float32)
    module = kernels.dither(d)
    if module is None:  # the torch operations' scratch
        keep_buf = workspace("terngrad-keep", width, torch.bool)
        negative_buf = workspace("terngrad-negative", width, torch.bool)
    for start in range(0, d, _CHUNK):
        piece = scaled[start : start + _CHUNK]
        n = piece.numel()
        p = torch.abs(piece, out=p_buf[:n]).div_(divisor) if prob is None else prob[start : start + n]
        # torch.rand(d, generator=gen) is uniform_ on a fresh tensor: chunk by chunk, the same draws
        u = u_buf[:n].uniform_(generator=gen)
        if module is not None:
            module.ternary_codes(p.contiguous().numpy(), u.numpy(), piece.numpy(), out[start : start + n].numpy())
            continue
        keep = torch.lt(u, p, out=keep_buf[:n])
        negative = torch.lt(piece, 0, out=negative_buf[:n]).logical_and_(keep)
        torch.add(keep.view(torch.uint8), negative.view(torch.uint8), out=out[start : start + n])  # 0, 1 or 2
    return out


class TernGrad(Compressor):
    """TernGrad: s·sign(x_i)·Bernoulli(|x_i|/s) with s = max|x| after optional clipping at c·σ.

    Steps: max|x| from one min/max pass; x / max|x| (whole: σ is one reduction over it, as always); clipping
    at ±c·σ in place; the clipped max from a second min/max pass; then per entry p = |clipped| / max|clipped|,
    a uniform draw u, keep where u < p, code keep + (keep and clipped < 0).

    Speed (CPU): ``compress`` writes x / max|x| into a reused scratch buffer (``clipped``, which
    ``terngrad_shared`` holds across slots, still returns a fresh tensor), and ``_ternary_chunks`` makes p, u
    and the codes in chunks of ``_CHUNK`` entries with reused scratch, straight into the int16 output. The
    draws come chunk by chunk from the same generator, the same numbers in the same order as one whole-tensor
    ``torch.rand``, and every step is the same float32 operation, so the codes are bit-identical to the
    whole-tensor path that other devices run (``_cpu_loop``).
    """

    capabilities = Capabilities(accumulate=True)
    name = "terngrad"
    omega = None

    def __init__(self, clip: float = 2.5, seed: int = 0):
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
            raise ConfigError(f"clip must be a finite number >= 0 (0 = no clipping), got {clip!r}")
        self.clip = float(clip)
        self.seed = _check_seed(seed)
        self.unbiased = self.clip == 0.0

    def params(self) -> dict[str, Any]:
        return {"clip": self.clip, "seed": self.seed}

    def omega_bound(self, numel: int) -> float | None:
        """ω(d) = sqrt(d) − 1 without clipping; None with clipping (biased)."""
        return math.sqrt(numel) - 1.0 if self.unbiased else None

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [FieldSpec(Codec.F32, count=1), FieldSpec(Codec.BITS, count=slot.numel, width=2)]

    def clipped(self, x: Tensor, slot: Slot) -> tuple[Tensor, Tensor, Tensor]:
        """(max|x|, x / max|x| clipped at c·σ, the clipped max / max|x|): this worker's scaler is their product.

        Raises NonFiniteGradientError for a NaN or Inf entry (before anything is sent) on the host path; on the
        device path, which reads nothing back, the max is then NaN or ±Inf (see ``_clip``)."""
        flat = _flat_f32(x)
        if flat.numel() == 0:
            nothing = torch.zeros((), dtype=torch.float32, device=flat.device)
            return nothing, flat, nothing
        return self._clip(flat, slot, None)

    def _clip(self, flat: Tensor, slot: Slot, out: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """``clipped`` of the non-empty float32 ``flat``: x / max|x| written into ``out`` (None: a fresh tensor)
        and clipped there in place; the clipped max from one min/max pass."""
        peak, scaled = _scaled(flat, out)
        # the device path reads nothing back: a NaN / Inf peak makes the scale s NaN or ±Inf, sent as it is, so every
        # decoded entry is non-finite (0 · Inf is NaN) and the receivers' finiteness check of the sums sees it
        if _cpu_loop(flat) and not bool(torch.isfinite(peak)):
            raise NonFiniteGradientError(f"terngrad: non-finite (NaN or Inf) value in {slot.name}")
        if self.clip > 0:
            sigma = torch.std(scaled, correction=0)  # σ / max|x|: one reduction over the whole tensor
            # σ = 0 (one entry, or all entries equal): no outlier to clip, and a bound of 0 would zero the slot
            # for good; |x / max|x|| <= 1, so a bound of 1 clips nothing (no host sync)
            bound = torch.where(sigma > 0, self.clip * sigma, torch.ones_like(sigma))
            torch.minimum(scaled, bound, out=scaled)
            torch.maximum(scaled, -bound, out=scaled)
        return peak, scaled, _peak(scaled)

    def _generator(self, slot: Slot, step: int, device: torch.device) -> torch.Generator:
        return shared_generator(self.seed, step, slot.index, device, salt=f"terngrad:{self.worker}")

    def ternary_codes(self, scaled: Tensor, prob: Tensor, slot: Slot, step: int) -> Tensor:
        """2-bit codes (0 = 0, 1 = +s, 2 = −s): entry i kept with probability ``prob[i]``, signed as ``scaled``."""
        if prob.numel() != scaled.numel():
            raise ConfigError(f"terngrad: {prob.numel()} probabilities for {scaled.numel()} entries of {slot.name}")
        gen = self._generator(slot, step, scaled.device)
        if _cpu_loop(scaled):
            return _ternary_chunks(scaled.reshape(-1), gen, prob=prob.reshape(-1))
        keep = torch.rand(scaled.shape, generator=gen, device=scaled.device) < prob
        return (keep.to(torch.int64) * torch.where(scaled < 0, 2, 1)).to(_TERNARY_CODES)

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        if x.numel() == 0:
            empty = torch.zeros(0, dtype=_TERNARY_CODES, device=x.device)
            return [torch.zeros(1, dtype=torch.float32, device=x.device), empty]
        flat = _flat_f32(x)
        cpu = _cpu_loop(flat)
        # on the CPU the clipped x / max|x| goes to a reused buffer (nothing holds it after this call)
        buf = workspace("terngrad", flat.numel(), torch.float32) if cpu else None
        peak, scaled, top = self._clip(flat, slot, buf)  # top = s / max|x|
        scale = (peak * top).reshape(1)
        divisor = torch.where(top > 0, top, torch.ones_like(top))
        if not cpu:
            return [scale, self.ternary_codes(scaled, scaled.abs() / divisor, slot, step)]
        return [scale, _ternary_chunks(scaled, self._generator(slot, step, flat.device), divisor=divisor)]

    def _decode_compiled(self, fields: Fields, out: Tensor | None = None, add: bool = False) -> Tensor | None:
        """As ``_Dithering._decode_compiled``: code & 3 indexes [0, +1, −1, 0], no sign bit."""
        scale, codes = fields
        codes = codes.reshape(-1)
        kernel = kernels.lookup(codes.numel()) if _cpu_loop(codes) and _lookup_target(out) else None
        if kernel is None:
            return None
        return _run_lookup(kernel, codes, 3, _NO_SIGN_BIT, _TERNARY, scale, out, add)

    def check_message(self, fields: Fields, slot: Slot) -> None:
        """WireError (``wire.refusals.check_received``) for what no sender makes: a scale below 0 (every entry's
        sign flipped) or code 3, which the 2-bit code allows and no sender writes (one pass over the codes)."""
        scale, codes = fields
        where = f"terngrad: {slot.name}"
        check_received_range(scale.reshape(-1).to(torch.float32), 0.0, None, f"{where}: a negative scale")
        check_received_range(codes.reshape(-1), None, 2, f"{where}: code 3, which no sender writes")

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        self.check_message(fields, slot)
        return self._values(fields)

    def _values(self, fields: Fields) -> Tensor:
        """The message's values, unchecked (``check_message``)."""
        decoded = self._decode_compiled(fields)  # one compiled pass, the same values (kernels.lookup_kernel)
        if decoded is not None:
            return decoded
        scale, codes = fields
        codes = codes.reshape(-1)
        unit = (codes == 1).to(torch.float32) - (codes == 2).to(torch.float32)
        return scale.to(torch.float32).reshape(()) * unit

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        """``out += decompress(fields)``; on the CPU one compiled pass without the d-sized message. A subclass
        that does not declare ``accumulate`` among its capabilities gets ``out += decompress(...)``."""
        if not self.capabilities.accumulate:
            add_decompressed(self, fields, slot, step, out)
            return
        self.check_message(fields, slot)
        if self._decode_compiled(fields, out, add=True) is None:
            out += self._values(fields)
