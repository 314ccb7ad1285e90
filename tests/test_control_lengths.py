"""The lengths a size round brings are checked before anything is allocated for them.

Size rounds carry plain int64 lengths, not container messages (protocols/sizes.py says why). A length that no
message can have (negative, or beyond the container's u32 body length) must raise WireError on the worker that
received it, naming the round, instead of reaching ``torch.empty`` (RuntimeError, or an allocation of exabytes)
or a pad of the wrong size. Each protocol is driven by hand with the answers a corrupted round would give; one
test corrupts a real size round of the simulated cluster under GradientAggregator.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradcomp
from gradcomp.compressors.base import bind_worker
from gradcomp.errors import WireError
from gradcomp.protocols import allgather_buffers, alltoall_buffers, broadcast_buffer
from gradcomp.protocols.sizes import received_lengths
from gradcomp.wire import MAX_MESSAGE_BYTES

BAD = [-1, -(2**63), MAX_MESSAGE_BYTES + 1, 2**62]


def _first_request(rounds):
    return next(rounds)


@pytest.mark.parametrize("good", [[0, 20, MAX_MESSAGE_BYTES], [37]])
def test_possible_lengths_pass(good):
    assert received_lengths(torch.tensor(good, dtype=torch.int64).tolist(), "a round") == good


@pytest.mark.parametrize("bad", BAD)
def test_an_all_gathers_size_round_refuses_an_impossible_length(bad):
    buffer = torch.zeros(40, dtype=torch.uint8)
    rounds = allgather_buffers(0, buffer)
    _first_request(rounds)  # the size round
    with pytest.raises(WireError, match=rf"size round brought length {bad} for worker 1's message"):
        rounds.send([40, bad])


@pytest.mark.parametrize("bad", BAD)
def test_a_length_broadcast_refuses_before_allocating(bad, monkeypatch):
    allocated = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or empty(*a, **k))
    rounds = broadcast_buffer(None, root=0, device=torch.device("cpu"))
    _first_request(rounds)  # the length
    with pytest.raises(WireError, match="length broadcast brought length"):
        rounds.send(torch.tensor([bad], dtype=torch.int64))
    assert allocated == []


def test_a_length_broadcast_of_a_possible_length_allocates_it():
    rounds = broadcast_buffer(None, root=0, device=torch.device("cpu"))
    _first_request(rounds)
    request = rounds.send(torch.tensor([33], dtype=torch.int64))
    assert request.tensor.numel() == 33 and request.tensor.dtype == torch.uint8


@pytest.mark.parametrize("column", [0, 1])  # the length for me, or a worker's longest
@pytest.mark.parametrize("bad", BAD)
def test_an_all_to_alls_length_round_refuses_an_impossible_length(bad, column):
    buffers = [torch.zeros(30, dtype=torch.uint8), torch.zeros(25, dtype=torch.uint8)]
    rounds = alltoall_buffers(0, buffers)
    _first_request(rounds)
    received = torch.tensor([[30, 30], [28, 28]], dtype=torch.int64)
    received[1, column] = bad
    with pytest.raises(WireError, match="all-to-all's length round"):
        rounds.send(received)


@pytest.mark.parametrize("topology", ["allgather", "ps", "sharded"])
@pytest.mark.parametrize("bit", [62, 26])
def test_a_corrupted_size_round_in_training_raises_wire_error_on_its_receiver(bit, topology):
    """threshold's message size varies, so every step has a size round (int64, control). Rank 1 receives rank 0's
    length with bit 62 flipped: rank 1 raises WireError (not an allocation of 4 EiB for the padded gather), and the
    simulated cluster reports it as the primary error. (A negative length is the step's non-finite mark,
    ``train.agreement._mark_unless``: a flipped sign bit reads as "not finite" and abandons the step.) Bit 26 gives
    a length a message could have, but not one of these specs (``wire.format.max_encoded_size``): refused too,
    in each topology's size round (the all-gather's, the parameter server's gather, the all-to-all's)."""
    def worker(transport):
        torch.manual_seed(0)
        model = nn.Linear(16, 4)
        method = gradcomp.make("threshold", threshold=0.01)
        aggregator = gradcomp.GradientAggregator(model, method, transport, topology=topology)
        if transport.rank == 1:
            gather, alltoall = transport._all_gather, transport._all_to_all

            def corrupted(t):
                got = gather(t)
                if t.dtype == torch.int64 and t.numel() == 1:  # the size round
                    got[0] = got[0] ^ (1 << bit)
                return got

            def corrupted_alltoall(t):
                got = alltoall(t)
                if t.dtype == torch.int64:  # the length round: the length worker 0 sends me
                    got[0, 0] = got[0, 0] ^ (1 << bit)
                return got

            transport._all_gather, transport._all_to_all = corrupted, corrupted_alltoall
        model(torch.randn(8, 16)).sum().backward()
        aggregator.step()

    with gradcomp.SimulatedCluster(2, timeout=30) as cluster:
        with pytest.raises(WireError, match=r"(size|length) round brought length \d+ for worker 0"):
            cluster.run(worker)


def test_a_limit_from_the_specs_bounds_every_round():
    """A corrupted length that a message *could* have (bit 26 flipped: 64 MiB) is refused where the receiver knows
    the specs: the most bytes they allow (``wire.format.max_encoded_size``) bounds each round, before the pad or
    the receive buffer is allocated (they were: 67 MB of padding for a message bounded to a few KB)."""
    with pytest.raises(WireError, match=r"\(0 to 100 bytes\)"):
        received_lengths([40, 101], "a round", limit=100)
    rounds = allgather_buffers(0, torch.zeros(40, dtype=torch.uint8), limit=100)
    _first_request(rounds)
    with pytest.raises(WireError, match="size round brought length 67108904"):
        rounds.send([40, 40 ^ (1 << 26)])
    rounds = broadcast_buffer(None, root=0, device=torch.device("cpu"), limit=100)
    _first_request(rounds)
    with pytest.raises(WireError, match="length broadcast"):
        rounds.send(torch.tensor([40 ^ (1 << 26)], dtype=torch.int64))
    rounds = alltoall_buffers(0, [torch.zeros(30, dtype=torch.uint8)] * 2, limits=[100, 50])
    _first_request(rounds)
    with pytest.raises(WireError, match="all-to-all's length round"):  # the longest, bounded by any owner's limit
        rounds.send(torch.tensor([[30, 30], [28, 101]], dtype=torch.int64))


def test_max_encoded_size_bounds_every_message_of_its_specs():
    """Variable-size methods' real messages fit the bound, and a fixed-size message equals it."""
    from gradcomp.compressors.base import Slot
    from gradcomp.schemes.single_round import encode_slots, fixed_buffer_size
    from gradcomp.wire.format import max_encoded_size

    slot = Slot("w", 0, 3000)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    x[:1500] = 0.0  # sparse input: many small and empty selections
    for name, params in [("threshold", {"threshold": 0.01}), ("topk", {"density": 0.3, "positions": "golomb"}),
                         ("sbc", {"density": 0.1}), ("dgc", {}), ("qsgd", {"coding": "elias", "levels": 255}),
                         ("stc", {"density": 0.5}), ("topk", {"density": 0.01})]:
        compressor = gradcomp.make(name, **params)
        bind_worker(compressor, 0)
        bound = max_encoded_size(compressor.specs(slot))
        for scale in (1e-3, 1.0, 1e3):
            assert encode_slots(compressor, [slot], [compressor.compress(x * scale, slot, 0)]).numel() <= bound, name
        fixed = fixed_buffer_size(compressor, [slot])
        assert fixed is None or fixed == bound, name


def test_a_corrupted_longest_length_that_reached_one_worker_is_a_wire_error():
    """The all-to-all's chunk is every worker's longest buffer; a worker that received a corrupted longest (within
    the bound) pads to another chunk than the others. What comes back is then not W of its chunks: WireError, not
    torch's reshape error."""
    rounds = alltoall_buffers(0, [torch.zeros(30, dtype=torch.uint8)] * 2)
    _first_request(rounds)
    rounds.send(torch.tensor([[30, 30], [28, 40]], dtype=torch.int64))  # this worker pads to 40; the other to 30
    with pytest.raises(WireError, match="the all-to-all brought 60 bytes where 2 chunks of 40 were agreed"):
        rounds.send(torch.zeros(60, dtype=torch.uint8))
