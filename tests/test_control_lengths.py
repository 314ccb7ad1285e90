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


def test_a_corrupted_size_round_in_training_raises_wire_error_on_its_receiver():
    """threshold's message size varies, so every step has a size round (int64, control). Rank 1 receives rank 0's
    length with bit 62 flipped: rank 1 raises WireError (not an allocation of 4 EiB for the padded gather), and the
    simulated cluster reports it as the primary error. (A negative length is the step's non-finite mark,
    ``train.exchange._mark_unless``: a flipped sign bit reads as "not finite" and abandons the step.)"""
    def worker(transport):
        torch.manual_seed(0)
        model = nn.Linear(16, 4)
        aggregator = gradcomp.GradientAggregator(model, gradcomp.make("threshold", threshold=0.01), transport)
        if transport.rank == 1:
            gather = transport._all_gather

            def corrupted(t):
                got = gather(t)
                if t.dtype == torch.int64 and t.numel() == 1:  # the size round
                    got[0] = got[0] ^ (1 << 62)
                return got

            transport._all_gather = corrupted
        model(torch.randn(8, 16)).sum().backward()
        aggregator.step()

    with gradcomp.SimulatedCluster(2, timeout=30) as cluster:
        with pytest.raises(WireError, match=r"size round brought length 46116860184273\d{5} for worker 0"):
            cluster.run(worker)
