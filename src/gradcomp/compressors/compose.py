"""Composition: a second compressor applied to the fp32 values carried by a first one's message.

``make("topk+cnat", density=0.01)`` keeps top-k's positions and sends its k values through C_nat (9 bits
each instead of 32); ``random_dithering+cnat`` sends the dithering's norm through C_nat; ``topk+fp16``
halves the values. Natural compression (Horváth et al.) shows that for unbiased C1 in B(ω1) and C2 in
B(ω2) the composition is in B(ω1ω2 + ω1 + ω2), so C_nat after an unbiased compressor costs a factor 9/8 in
variance at most.

Every fp32 field of the inner message with a known count becomes the value compressor's message for a
tensor of that many elements (its own slot, index derived from the tensor's and the field's, so the value
compressor's randomness differs per field). Fields of variable length (threshold's values) cannot be
composed: ConfigError. The composition is never summable: its value codes are not.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from gradcomp.compressors.base import Capabilities, Compressor, Fields, Slot, accumulate, sent_entries
from gradcomp.errors import ConfigError
from gradcomp.wire import Codec, FieldSpec

MAX_FIELDS = 16  # value-slot indices are slot.index * MAX_FIELDS + field position


PROBE_NUMEL = 1 << 20  # the slot size at which a composition is checked when it is built


class ComposedValues(Compressor):
    capabilities = Capabilities(accumulate=True, sent_entries=True)
    summable = False
    wraps = ("inner", "values")

    def __init__(self, inner: Compressor, values: Compressor):
        self.inner, self.values = inner, values
        self.name = f"{inner.name}+{values.name}"
        self.owns_momentum = inner.owns_momentum
        self.unbiased = bool(inner.unbiased and values.unbiased)
        w1, w2 = inner.omega, values.omega
        self.omega = w1 * w2 + w1 + w2 if (self.unbiased and w1 is not None and w2 is not None) else None
        try:  # refuse a pair with nothing to compose now, not at the first step (fp16+topk: no fp32 field)
            probe = inner.specs(Slot("probe", 0, PROBE_NUMEL))
        except ConfigError:  # a size the inner compressor refuses (a fixed k above it): checked per slot later
            probe = None
        if probe is not None and not any(spec.codec == Codec.F32 for spec in probe):
            raise ConfigError(f"{self.name}: {inner.name!r} sends no fp32 values to compress")

    def params(self) -> dict[str, Any]:
        return self.inner.params()

    def aggregate(self, total: Tensor, count: int) -> Tensor:
        return self.inner.aggregate(total, count)

    def retain(self, slots: list[Slot]) -> None:
        self.inner.retain(slots)

    def _value_slots(self, slot: Slot) -> list[tuple[FieldSpec, Slot | None]]:
        """Each inner field spec, with the value compressor's slot where the field is composed."""
        out: list[tuple[FieldSpec, Slot | None]] = []
        for i, spec in enumerate(self.inner.specs(slot)):
            if spec.codec != Codec.F32:
                out.append((spec, None))
                continue
            if spec.count is None:
                raise ConfigError(
                    f"{self.name}: field {i} of {self.inner.name!r} has a variable length; "
                    f"{self.values.name!r} can only compress fixed-length value fields"
                )
            out.append((spec, Slot(f"{slot.name}.values{i}", slot.index * MAX_FIELDS + i, spec.count)))
        if not any(v is not None for _, v in out):
            raise ConfigError(f"{self.name}: {self.inner.name!r} sends no fp32 values to compress")
        return out

    def specs(self, slot: Slot) -> list[FieldSpec]:
        specs: list[FieldSpec] = []
        for spec, vslot in self._value_slots(slot):
            specs.extend([spec] if vslot is None else self.values.specs(vslot))
        return specs

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        fields: Fields = []
        value_slots = self._value_slots(slot)  # refuses a composition first, before the inner state moves
        for field, (_, vslot) in zip(self.inner.compress(x, slot, step), value_slots):
            fields.extend([field] if vslot is None else self.values.compress(field, vslot, step))
        return fields

    def _inner_fields(self, fields: Fields, slot: Slot, step: int) -> Fields:
        remaining = iter(fields)
        inner: Fields = []
        for _, vslot in self._value_slots(slot):
            if vslot is None:
                inner.append(next(remaining))
            else:
                own = [next(remaining) for _ in self.values.specs(vslot)]
                inner.append(self.values.decompress(own, vslot, step))
        return inner

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return self.inner.decompress(self._inner_fields(fields, slot, step), slot, step)

    def sent_entries(self, fields: Fields, slot: Slot, step: int) -> tuple[Tensor, Tensor] | None:
        return sent_entries(self.inner, self._inner_fields(fields, slot, step), slot, step)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        accumulate(self.inner, self._inner_fields(fields, slot, step), slot, step, out)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "values": self.values.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self.values.load_state_dict(state.get("values", {}))

    def __repr__(self) -> str:
        return f"ComposedValues({self.inner!r}, {self.values!r})"
