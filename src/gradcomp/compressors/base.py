"""The compressor interface that every method implements.

A compressor is pure tensor math. It turns one flat float tensor into a *message*: a list of field tensors
whose wire layout it describes with `FieldSpec`s (see `gradcomp.wire`). It never talks to a process group.

What a compressor declares (class attributes):

- ``summable``: messages of different workers can be added field by field and the sum decompresses to the sum
  of the decompressed messages (fp32, fp16, random-k with a shared seed, random-block). The exchange then uses
  a plain allreduce on the fields instead of gathering encoded buffers.
- ``unbiased``: E[decompress(compress(x))] = x.
- ``omega``: the variance parameter of class B(omega), E||C(x)||^2 <= (omega + 1)||x||^2, where the paper gives
  one; None otherwise.
- ``capabilities``: which optional shortcuts (``accumulate``, ``sent_entries``, ``subtract_sent``,
  ``compress_sum``, ``new_tally``) the class's own code provides (:class:`Capabilities`). Declared by each class
  for itself, never inherited: a class that does not set it has none, so a subclass that decodes differently
  cannot run a shortcut written for its parent's decoding.

State that must survive a checkpoint (residuals, momentum, RNG position) lives behind
``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

import torch
from torch import Tensor

from gradcomp.errors import ConfigError
from gradcomp.wire import FieldSpec
from gradcomp.wire.format import length_on_device

Fields = list[Tensor]


class Tally(ABC):
    """A running aggregate of one slot's messages from several workers, in a compressor's own compact form."""

    @abstractmethod
    def add(self, fields: Fields) -> None:
        """Add one worker's decoded message (workers in rank order)."""

    @abstractmethod
    def result(self, count: int) -> Tensor:
        """The update from the ``count`` messages added: what ``aggregate`` gives for their float sum."""


@dataclass(frozen=True)
class Slot:
    """One tensor that is compressed, identified the same way on every worker.

    ``index`` is the tensor's position in the model's parameter order; together with the run seed and the step
    it derives shared randomness, so workers draw the same random positions without talking. ``shape`` is the
    parameter's shape where a method needs it (PowerSGD views a conv weight as a matrix); None for a flat
    vector (a whole-model slot).
    """

    name: str
    index: int
    numel: int
    shape: tuple[int, ...] | None = None


def shared_seed(seed: int, step: int, index: int, salt: str = "") -> int:
    """A 63-bit seed derived from (run seed, step, tensor index): identical on every worker, fresh each step."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}:{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def shared_generator(seed: int, step: int, index: int, device: torch.device, salt: str = "") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(shared_seed(seed, step, index, salt))
    return gen


def check_density(density: float) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise ConfigError(f"density must be a number in (0, 1], got {density!r}")
    density = float(density)
    if not (0.0 < density <= 1.0):
        raise ConfigError(f"density must lie in (0, 1], got {density}")
    return density


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


@functools.lru_cache(maxsize=4096)
def kept_count(density: float, numel: int) -> int:
    """k = ceil(p * d), at least 1 for a non-empty tensor and never more than d.

    Cached: every message's specs ask for it, and the exact decimal product costs a ``Fraction`` each time
    (with all-gather, W decodes per worker per step: most of a simulated cluster's decoding time went here)."""
    if numel == 0:
        return 0
    # ceil of the decimal product the user wrote: 0.07 * 100 is 7.000000000000001 in binary floating point
    k = math.ceil(Fraction(repr(density)) * numel)
    return max(1, min(numel, k))


@dataclass(frozen=True)
class Capabilities:
    """The optional shortcuts a compressor class opts into. Each flag names a method the class then defines,
    written for the class's own ``compress`` / ``decompress`` / ``aggregate``, that gives what the generic route
    gives (the same values, bit for bit), only faster or smaller. The signatures, and the generic routes taken
    where a class does not opt in, are this module's functions of the same names, the only way callers reach
    them (``accumulate``, ``compress_slots``, ``compress_sum``, ``sent_entries``, ``subtract_sent``,
    ``new_tally``, ``select_sized``); the Compressor base defines none of them.

    A class declares its capabilities in its own body (``capabilities = Capabilities(...)``), and
    ``Compressor.__init_subclass__`` checks that it defines each method it declares. One that declares nothing has
    none, even if its parent has some (a parent's shortcuts were written for the parent's decoding); a subclass
    that keeps its parent's decoding and wants its shortcuts says so: ``capabilities = Parent.capabilities``.
    """

    accumulate: bool = False  # accumulate(fields, slot, step, out): out += decompress(...), no dense message
    sent_entries: bool = False  # sent_entries(fields, slot, step): a sparse message's (positions, values)
    subtract_sent: bool = False  # subtract_sent(fields, slot, step, out): out -= decompress(...) in place
    compress_sum: bool = False  # compress_sum(x, into, slot, step): into += x fused with compress (chunk by chunk)
    tally: bool = False  # new_tally(slot, device): a compact running aggregate (majority vote's count of sign bits)
    select_sized: bool = False  # select_sized(tensors, slots, step): selections with their sizes left on the device
    compress_slots: bool = False  # compress_slots(tensors, slots, step): a message's slots compressed together


_CAPABILITY_METHODS = {"accumulate": "accumulate", "sent_entries": "sent_entries", "subtract_sent": "subtract_sent",
                       "compress_sum": "compress_sum", "tally": "new_tally", "select_sized": "select_sized",
                       "compress_slots": "compress_slots"}


NO_CAPABILITIES = Capabilities()


@dataclass
class SizedSelection:
    """The selections of one message's slots, made before their sizes are read (``select_sized``).

    ``counts``: per slot, per field, the field's element count: an int where it does not depend on the data, a
    0-d int64 tensor on the device where it does (not read). ``finish(values)`` makes the messages, given the
    values of those device counts in the same order (read by the caller, with whatever else it reads: the size
    exchange); they are ``compress_slots``'s messages, byte for byte, and the compressor's state moves as it does.
    ``stream_bits``: where the messages have GOLOMB fields, the lengths in bits of their streams, in field order,
    an int64 tensor on the device (not read; the caller reads them with the counts and hands them to the encoder).
    """

    counts: list[list[int | Tensor]]
    finish: Any  # Callable[[list[int]], list[Fields]]
    stream_bits: Tensor | None = None

    @classmethod
    def made(cls, compressor: Compressor, slots: Sequence[Slot], messages: list[Fields]) -> SizedSelection:
        """The selection of messages already made (a compressor that declined to leave its sizes on the device):
        their counts known, their GOLOMB streams' lengths computed on the device (not read)."""
        specs = [spec for slot in slots for spec in compressor.specs(slot)]
        bits = length_on_device([f for message in messages for f in message], specs)[2]
        return cls([[int(f.numel()) for f in message] for message in messages], lambda _: messages, bits)

    def device_counts(self) -> list[Tensor]:
        """The counts still on the device, in the order ``finish`` takes their values."""
        return [c for per_slot in self.counts for c in per_slot if isinstance(c, Tensor)]


class Compressor(ABC):
    """Base class: subclasses set ``name`` and implement compress / decompress / specs."""

    name: ClassVar[str] = ""
    summable: ClassVar[bool] = False
    # summable, keeps no state, and a NaN anywhere in a summed message decodes to a NaN in the result: a step that
    # a bad worker spoiled shows in every worker's result, so under a GradScaler no verdict need be read
    # (Scheme.verdict_in_result). Declared by each class: subclasses that keep state must not inherit it blindly.
    nan_in_result: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    omega: float | None = None
    default_error_feedback: ClassVar[bool] = False  # what make() does when error_feedback is not given
    # a compressor that applies momentum itself (signum): the outer optimizer must run without momentum
    owns_momentum: ClassVar[bool] = False
    # a compressor that keeps its own residual (DGC's momentum correction): make() refuses a second one
    owns_feedback: ClassVar[bool] = False
    # this worker's rank, set by the exchange through bind_worker() (the server gets its own number). Randomness
    # every worker must share (random-k positions, random blocks, hash functions) ignores it; randomness that must
    # be independent per worker (stochastic rounding) mixes it into its seed.
    worker: int = 0
    # the attributes holding the compressors this one wraps: bind_worker() gives them the same rank
    wraps: ClassVar[tuple[str, ...]] = ()
    # the optional shortcuts this class provides; set in each class's own body, never inherited
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "capabilities" not in cls.__dict__:
            cls.capabilities = NO_CAPABILITIES  # a parent's shortcuts were written for the parent's decoding
        elif not isinstance(cls.__dict__["capabilities"], Capabilities):
            raise TypeError(f"{cls.__qualname__}.capabilities must be a Capabilities, got {cls.capabilities!r}")
        if "bind_worker" in cls.__dict__:  # the method the base had: the exchange no longer calls it
            raise TypeError(f"{cls.__qualname__}.bind_worker is never called: the exchange sets .worker through "
                            "compressors.base.bind_worker; name the attributes of wrapped compressors in `wraps`")
        for flag, method in _CAPABILITY_METHODS.items():
            if getattr(cls.capabilities, flag) and not callable(getattr(cls, method, None)):
                raise TypeError(f"{cls.__qualname__} declares Capabilities({flag}=True) but defines no {method}()")

    def params(self) -> dict[str, Any]:
        """The constructor arguments, for reports and for rebuilding the same compressor."""
        return {}

    @abstractmethod
    def specs(self, slot: Slot) -> list[FieldSpec]:
        """The wire layout of this slot's message; the receiver calls it too, to validate what it decodes."""

    @abstractmethod
    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        """Compress the flat float tensor ``x`` (``x.numel() == slot.numel``) into message fields.

        Not checked here, on the hot path: that ``x`` is finite, floating point and of the slot's size.
        ``GradientAggregator``, the DDP hook and every exchange check it once per step before anything is sent
        (``gradcomp.train.exchange.check_gradients``); a caller of ``compress`` itself checks it first. Some
        compressors refuse NaN/Inf anyway (QSGD, C_nat, TernGrad, the ditherings); others pass them on.
        """

    @abstractmethod
    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        """The dense flat float32 tensor a message stands for. Pure: never changes the compressor's state."""

    def aggregate(self, total: Tensor, count: int) -> Tensor:
        """How the sum of ``count`` workers' decompressed messages becomes the update: their mean.

        Majority vote (signSGD) overrides it with the sign of the sum. May work in place on ``total``.
        """
        return total.div_(count)

    def retain(self, slots: list[Slot]) -> None:  # noqa: B027 - optional hook, nothing kept by default
        """Drop per-slot state (residuals, momentum) of every slot not in ``slots``."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ConfigError(f"compressor {self.name!r} keeps no state but got keys {sorted(state)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


# ------------------------------------------------------------ the optional shortcuts, where a class declares them


def bind_worker(compressor: Compressor, worker: int) -> None:
    """Give ``compressor`` and every compressor it wraps (``Compressor.wraps``) the rank ``worker``."""
    compressor.worker = int(worker)
    for name in compressor.wraps:
        bind_worker(getattr(compressor, name), worker)


def accumulate(compressor: Compressor, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
    """``out += compressor.decompress(fields, slot, step)``, by the compressor's own ``accumulate`` where its class
    declares it (``Capabilities.accumulate``: sparse ones scatter-add, C_nat decodes in one compiled pass)."""
    if compressor.capabilities.accumulate:
        compressor.accumulate(fields, slot, step, out)
    else:
        add_decompressed(compressor, fields, slot, step, out)


def add_decompressed(compressor: Compressor, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
    """The generic route of :func:`accumulate`: ``out += decompress(...)``, the dense message built."""
    out += compressor.decompress(fields, slot, step)


def compress_slots(compressor: Compressor, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int
                   ) -> list[Fields]:
    """``[compressor.compress(x, slot, step) for ...]`` over the slots of one message (a bucket), by the
    compressor's own ``compress_slots`` where its class declares it (``Capabilities.compress_slots``: a
    compressor whose message sizes depend on the data reads all the slots' sizes back from a GPU at once instead
    of one slot at a time); the messages are those of ``compress``, byte for byte."""
    if compressor.capabilities.compress_slots:
        return compressor.compress_slots(tensors, slots, step)
    return compress_each(compressor, tensors, slots, step)


def compress_each(compressor: Compressor, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int
                  ) -> list[Fields]:
    """The generic route of :func:`compress_slots`: ``compress`` slot by slot."""
    return [compressor.compress(x, slot, step) for x, slot in zip(tensors, slots)]


def new_tally(compressor: Compressor, slot: Slot, device: torch.device) -> Tally | None:
    """A compact running aggregate of this slot's messages where the compressor's class declares one
    (``Capabilities.tally``: majority vote's count of sign bits, ``sign.VoteTally``, the same update bit for bit
    without decoding every message into floats); else None: the receiver adds the messages up in float32
    (:func:`accumulate`) and finishes with ``aggregate``."""
    if not compressor.capabilities.tally:
        return None
    return compressor.new_tally(slot, device)


def sent_entries(compressor: Compressor, fields: Fields, slot: Slot, step: int) -> tuple[Tensor, Tensor] | None:
    """(positions, float32 values) such that ``decompress`` gives +0.0 everywhere except ``values[j]`` at the
    distinct ``positions[j]``, bit for bit, where the compressor's class declares it (``Capabilities.sent_entries``:
    sparse compressors, next to their ``decompress``); else None. Error feedback uses it to update a residual at
    the sent positions only (a - (+0.0) is a for every a, signed zeros and NaN included)."""
    if not compressor.capabilities.sent_entries:
        return None
    return compressor.sent_entries(fields, slot, step)


def subtract_sent(compressor: Compressor, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
    """``out -= compressor.decompress(fields, slot, step)`` in place (``out`` flat float32, not sharing memory with
    ``fields``), with the same subtraction per entry: by the compressor's own ``subtract_sent`` where its class
    declares one (``Capabilities.subtract_sent``), else :func:`subtract_decompressed`."""
    if compressor.capabilities.subtract_sent:
        compressor.subtract_sent(fields, slot, step, out)
    else:
        subtract_decompressed(compressor, fields, slot, step, out)


def subtract_decompressed(compressor: Compressor, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
    """The generic route of :func:`subtract_sent`: at the sent entries only where the message is sparse
    (:func:`sent_entries`), else ``out -= decompress(...)``."""
    entries = sent_entries(compressor, fields, slot, step)
    if entries is not None:
        subtract_at(out, *entries)
    else:
        out.sub_(compressor.decompress(fields, slot, step))


def select_sized(
    compressor: Compressor, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int
) -> SizedSelection | None:
    """:func:`compress_slots` in two halves, for the device path of a message whose size depends on the data: the
    selections with their counts left on the device, then (``SizedSelection.finish``) the messages once the
    caller has read those counts with its size exchange, so that sizing the message costs no read of its own.
    The compressor's own ``select_sized`` where its class declares it (``Capabilities.select_sized``; it may
    still return None at run time), else None (then :func:`compress_slots`)."""
    if not compressor.capabilities.select_sized or not tensors:
        return None
    return compressor.select_sized(tensors, slots, step)


def compress_sum(compressor: Compressor, x: Tensor, into: Tensor, slot: Slot, step: int) -> Fields:
    """``into += x`` in place (``torch.add(x, into, out=into)``: x's operand first), then ``compress(into)``: error
    feedback's a = x + r, m = C(a); ``x`` and ``into`` flat float32 of the slot's size, ``into`` contiguous. By the
    compressor's own fused route where its class declares one (``Capabilities.compress_sum``: a compressor that
    reads its input in chunks adds each chunk just before reading it, while it is in cache; the same sums)."""
    if compressor.capabilities.compress_sum:
        return compressor.compress_sum(x, into, slot, step)
    return add_then_compress(compressor, x, into, slot, step)


def add_then_compress(compressor: Compressor, x: Tensor, into: Tensor, slot: Slot, step: int) -> Fields:
    """The generic route of :func:`compress_sum`."""
    torch.add(x, into, out=into)
    return compressor.compress(into, slot, step)


def subtract_at(out: Tensor, positions: Tensor, values: Tensor) -> None:
    """out[positions] = out[positions] - values (distinct positions): ``out -= D(m)`` for a message whose
    decompression is +0.0 everywhere else."""
    if positions.numel():
        out.index_copy_(0, positions, torch.index_select(out, 0, positions).sub_(values))
