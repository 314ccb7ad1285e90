"""Majority vote by bit-sliced counting (sign.VoteTally) against the float path it replaces.

The exchange aggregates signsgd / signum messages with ``Compressor.new_tally``; the result must equal, bit for
bit, sign() of the float32 sum of the workers' ±1 (``accumulate`` + ``aggregate``), ties (+0.0) included.
"""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp import ConfigError, Slot, WireError
from gradcomp.compressors import sign
from gradcomp.compressors import base
from gradcomp.compressors.base import new_tally
from gradcomp.schemes.single_round import aggregate_buffers, encode_slots


def bitmaps(world: int, numel: int, seed: int) -> list[torch.Tensor]:
    """Each worker's vector with many exact ties between workers: entries from {-1, 0, +1} (0 sends +)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-1, 2, (numel,), generator=g).to(torch.float32) for _ in range(world)]


def float_vote(compressor, slot, messages) -> torch.Tensor:
    total = torch.zeros(slot.numel, dtype=torch.float32)
    for fields in messages:
        base.accumulate(compressor, fields, slot, 0, total)
    return compressor.aggregate(total, len(messages))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("numpy_bits", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("world", range(1, 17))
@pytest.mark.parametrize("numel", [1, 7, 8, 63, 64, 65, 1000, 4099])
def test_tally_equals_the_float_vote_bit_for_bit(monkeypatch, numpy_bits, world, numel):
    monkeypatch.setattr(sign, "_numpy_bits", lambda t: numpy_bits)
    compressor = gradcomp.make("signsgd")
    slot = Slot("w", 0, numel)
    messages = [compressor.compress(x, slot, 0) for x in bitmaps(world, numel, seed=world * 10_000 + numel)]
    tally = compressor.new_tally(slot, torch.device("cpu"))
    for fields in messages:
        tally.add(fields)
    got = tally.result(world)
    expected = float_vote(compressor, slot, messages)
    assert got.shape == (numel,)
    assert same_bits(got, expected)
    if world % 2 == 0 and numel >= 64:
        assert (got == 0).any()  # ties occurred and came out as +0.0, as the float path gives them


def test_signum_exchange_uses_the_tally_and_gives_the_float_result(monkeypatch):
    """aggregate_buffers (all-gather, ps and sharded all use it) through the tally, against the float path."""
    world, sizes = 4, [5, 300, 64]
    slots = [Slot(f"s{i}", i, n) for i, n in enumerate(sizes)]
    compressor = gradcomp.make("signum")
    buffers = []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        messages = [compressor.compress(torch.randn(n, generator=g), s, 0) for s, n in zip(slots, sizes)]
        buffers.append(encode_slots(compressor, slots, messages))
    tallied = aggregate_buffers(compressor, slots, buffers, 0, torch.device("cpu"))
    monkeypatch.setattr(type(compressor), "new_tally", lambda self, slot, device: None)
    floated = aggregate_buffers(compressor, slots, buffers, 0, torch.device("cpu"))
    assert all(same_bits(a, b) for a, b in zip(tallied, floated))


def test_a_count_that_does_not_match_the_messages_added_is_refused():
    compressor = gradcomp.make("signsgd")
    slot = Slot("w", 0, 10)
    tally = compressor.new_tally(slot, torch.device("cpu"))
    tally.add(compressor.compress(torch.randn(10), slot, 0))
    with pytest.raises(ConfigError, match="a vote of 2 workers, but 1 messages were added"):
        tally.result(2)


def test_a_bitmap_with_padding_bits_set_is_refused():
    compressor = gradcomp.make("signsgd")
    slot = Slot("w", 0, 10)
    packed = compressor.compress(torch.ones(10), slot, 0)[0].clone()
    packed[-1] = 0b1000_0000  # entry 15 of a 10-entry bitmap
    with pytest.raises(WireError, match="nonzero padding bits"):
        compressor.new_tally(slot, torch.device("cpu")).add([packed])


def test_compressors_that_average_have_no_tally():
    slot = Slot("w", 0, 10)
    for name in ("efsignsgd", "onebit", "topk", "cnat", "none"):
        assert new_tally(gradcomp.make(name), slot, torch.device("cpu")) is None


def test_a_subclass_that_aggregates_or_decodes_otherwise_does_not_inherit_the_tally():
    """The tally is used only where it was written for the class's decoding and aggregation (base.new_tally)."""

    class Averaged(sign.SignSGD):
        def aggregate(self, total, count):
            return total.div_(count)

    class Scaled(sign.SignSGD):
        def _decode_values(self, fields, slot):
            one = torch.full((), 0.5)
            return one, -one

    slot, cpu = Slot("w", 0, 100), torch.device("cpu")
    assert new_tally(gradcomp.make("signsgd"), slot, cpu) is not None
    assert new_tally(Averaged(), slot, cpu) is None
    assert new_tally(Scaled(), slot, cpu) is None
    messages = [Averaged().compress(x, slot, 0) for x in bitmaps(4, 100, seed=3)]
    buffers = [encode_slots(Averaged(), [slot], [m]) for m in messages]
    (mean,) = aggregate_buffers(Averaged(), [slot], buffers, 0, cpu)
    total = torch.zeros(100)
    for m in messages:
        total += sign.unpack_signs(m[0], 100)
    assert same_bits(mean, total / 4)  # the subclass's mean, not a vote


def test_error_feedback_forwards_the_inner_tally():
    compressor = gradcomp.make("signum", error_feedback=True)
    slot, cpu = Slot("w", 0, 100), torch.device("cpu")
    assert isinstance(new_tally(compressor, slot, cpu), sign.VoteTally)
