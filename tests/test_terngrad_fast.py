"""TernGrad's chunked CPU loop against its whole-tensor torch path (the one other devices run).

The CPU loop makes the codes in chunks of ``_CHUNK`` entries with reused scratch buffers, drawing the uniform
numbers chunk by chunk from the same generator; it must send exactly the codes (and scale) of the whole-tensor
path, which the tests reach on the CPU by switching ``_cpu_loop`` off, as tests/test_wire_stability.py does.
"""

from __future__ import annotations

import pytest
import torch

from gradcomp import Slot
from gradcomp.compressors import natural
from gradcomp.compressors.base import bind_worker
from gradcomp.compressors.natural import TernGrad
from gradcomp.schemes.terngrad_shared import TernGradShared

CHUNK = natural._CHUNK


def heavy(n: int, seed: int, zeros: float = 0.0) -> torch.Tensor:
    """Heavy-tailed entries (so that clipping at 2.5σ bites), a fraction ``zeros`` of them ±0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(2.0 * torch.randn(n, generator=gen))
    if zeros:
        hit = torch.rand(n, generator=gen) < zeros
        x[hit] = 0.0
        x[hit & (torch.rand(n, generator=gen) < 0.5)] = -0.0
    return x


INPUTS = {
    "several-chunks": lambda: heavy(3 * CHUNK + 1234, 1),
    "exact-chunks": lambda: heavy(2 * CHUNK, 2),
    "zeros": lambda: heavy(2 * CHUNK + 17, 3, zeros=0.4),
    "smaller-than-a-chunk": lambda: heavy(1001, 4),
    "one-entry": lambda: torch.tensor([-2.5]),
    "all-zero": lambda: torch.zeros(CHUNK + 5),
    "constant": lambda: torch.full((CHUNK + 3,), -0.75),  # σ = 0: everything clipped to 0
    "matrix": lambda: heavy(300 * 1000, 5).reshape(300, 1000),
    "strided": lambda: heavy(2 * (CHUNK + 99), 6)[::2],
    "float16": lambda: heavy(CHUNK + 77, 7).clamp(-6e4, 6e4).half(),
}


def compress_both(c: TernGrad, x: torch.Tensor, slot: Slot, step: int, monkeypatch):
    fast = c.compress(x, slot, step)
    with monkeypatch.context() as m:
        m.setattr(natural, "_cpu_loop", lambda t: False)
        whole = c.compress(x, slot, step)
    return fast, whole


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t  # the scale bit for bit (signed zeros too)


def assert_same(fast, whole):
    assert len(fast) == len(whole) == 2
    for a, b in zip(fast, whole):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("clip", [2.5, 0.0, 0.5])
@pytest.mark.parametrize("name", sorted(INPUTS))
def test_cpu_loop_sends_the_codes_of_the_whole_tensor_path(name, clip, monkeypatch, single_thread):
    x = INPUTS[name]()
    before = x.clone()
    c = TernGrad(clip=clip, seed=3)
    bind_worker(c, 1)
    slot = Slot("t", 2, x.numel())
    for step in (0, 7):
        fast, whole = compress_both(c, x, slot, step, monkeypatch)
        assert_same(fast, whole)
        assert fast[1].dtype == torch.int16 == whole[1].dtype and set(fast[1].unique().tolist()) <= {0, 1, 2}
    assert torch.equal(x, before)


def test_clipping_is_active_and_the_codes_follow_it(monkeypatch, single_thread):
    x = INPUTS["several-chunks"]()
    c = TernGrad()  # clip 2.5
    slot = Slot("t", 0, x.numel())
    fast, whole = compress_both(c, x, slot, 1, monkeypatch)
    assert_same(fast, whole)
    assert float(fast[0]) < float(x.abs().max()) / 10  # the heavy tail was clipped
    # entries clipped to ±s are kept with probability 1
    sigma = float(x.std(correction=0))
    big = x.abs() > 2.5 * sigma * 1.001
    assert int(big.sum()) > 100
    assert torch.equal(fast[1][big], torch.where(x[big] < 0, 2, 1))


def test_many_small_chunks(monkeypatch, single_thread):
    """A small chunk size: many chunks, a partial last one, the same codes as the whole-tensor path."""
    monkeypatch.setattr(natural, "_CHUNK", 1000)
    x = heavy(25_321, 8, zeros=0.1)
    c = TernGrad()
    slot = Slot("t", 0, x.numel())
    fast, whole = compress_both(c, x, slot, 3, monkeypatch)
    assert_same(fast, whole)


def test_empty_tensor(monkeypatch):
    c = TernGrad()
    slot = Slot("e", 0, 0)
    fast, whole = compress_both(c, torch.zeros(0), slot, 0, monkeypatch)
    assert_same(fast, whole)


def test_clipped_returns_a_fresh_tensor(single_thread):
    c = TernGrad()
    x, y = heavy(2 * CHUNK + 5, 9), heavy(2 * CHUNK + 5, 10)
    slot = Slot("t", 0, x.numel())
    peak, scaled, top = c.clipped(x, slot)
    kept = scaled.clone()
    peak2, scaled2, _ = c.clipped(y, slot)
    c.compress(y, slot, 0)  # the CPU loop's scratch must not be what clipped() returned
    c.compress(x, slot, 1)
    assert scaled.data_ptr() != scaled2.data_ptr()
    assert torch.equal(scaled, kept)
    assert float(top) == float(scaled.abs().max()) and float(peak) == float(x.abs().max())


def test_ternary_codes_with_a_given_probability(monkeypatch, single_thread):
    """terngrad_shared calls ternary_codes with its own probabilities: both paths give the same codes."""
    c = TernGrad(seed=2)
    x = heavy(3 * CHUNK + 11, 11, zeros=0.2)
    slot = Slot("t", 4, x.numel())
    peak, scaled, top = c.clipped(x, slot)
    prob = (scaled.abs() * 0.7).clamp_(max=1.0)
    fast = c.ternary_codes(scaled, prob, slot, 5)
    with monkeypatch.context() as m:
        m.setattr(natural, "_cpu_loop", lambda t: False)
        whole = c.ternary_codes(scaled, prob, slot, 5)
    assert fast.dtype == whole.dtype == torch.int16
    assert torch.equal(fast, whole)


def test_terngrad_shared_outputs_unchanged(monkeypatch, single_thread):
    """The scheme on one worker (its own scaler): the same outputs with the CPU loop on and off."""
    slots = [Slot("w", 0, 2 * CHUNK + 3), Slot("b", 1, 40)]
    tensors = [heavy(s.numel, 20 + s.index, zeros=0.1) for s in slots]

    def run():
        scheme = TernGradShared()
        scheme.bind(0, 1)
        gen = scheme.run(slots, tensors, 2)
        request = next(gen)
        reply = request.tensor.clone()
        request = gen.send(reply)
        try:
            gen.send([request.tensor.clone()])
        except StopIteration as stop:
            return stop.value
        raise AssertionError("terngrad_shared asked for a third round")

    fast = run()
    with monkeypatch.context() as m:
        m.setattr(natural, "_cpu_loop", lambda t: False)
        whole = run()
    assert all(torch.equal(a, b) for a, b in zip(fast, whole))
