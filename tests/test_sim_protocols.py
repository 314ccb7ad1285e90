"""Tests for the simulated cluster and the three protocols (allreduce_sum, allgather_buffers, parameter_server).

Contents must arrive exactly, and every byte must be booked where transport.base says: payload up/down,
padding apart, control (size exchanges) apart, server in/out for the parameter server's root.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import gradcomp
from gradcomp import ByteCounter, ConfigError, SimulatedCluster, WireError, WorkerLostError
from gradcomp.protocols import allgather_buffers, allreduce_sum, parameter_server
from gradcomp.transport.requests import drive

WORLDS = [1, 3, 5]


def rank_bytes(rank: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, 256, (size,), generator=g, dtype=torch.int64).to(torch.uint8)


# ----------------------------------------------------------------------------------------------- cluster basics


def test_world_size_must_be_positive():
    with pytest.raises(ConfigError):
        SimulatedCluster(0)
    with pytest.raises(ConfigError):
        SimulatedCluster(-2)


@pytest.mark.parametrize("world", WORLDS)
def test_run_returns_results_in_rank_order(world):
    with SimulatedCluster(world) as cluster:
        assert [t.rank for t in cluster.transports] == list(range(world))
        assert all(t.world_size == world for t in cluster.transports)
        assert cluster.run(lambda t: (t.rank, t.world_size)) == [(r, world) for r in range(world)]
        # workers run on separate threads
        names = cluster.run(lambda t: threading.current_thread().name)
        assert len(names) == world


# ----------------------------------------------------------------------------------------------- allreduce


@pytest.mark.parametrize("world", WORLDS)
def test_allreduce_sum(world):
    d = 37
    xs = [torch.randn(d, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    expected = xs[0].clone()
    for x in xs[1:]:
        expected += x  # rank order

    def fn(t):
        mine = xs[t.rank].clone()
        out = drive(t, allreduce_sum(mine))
        assert torch.equal(mine, xs[t.rank]), "the input must not be modified"
        return out, t.counter.snapshot()

    with SimulatedCluster(world) as cluster:
        results = cluster.run(fn)
    for out, counter in results:
        assert torch.equal(out, expected)
        assert counter == ByteCounter(
            up_payload=4 * d, down_payload=4 * d, collectives=1, seconds=counter.seconds, ops={"all_reduce": [1, 4 * d]}
        )
    # every worker has its own copy of the result
    assert len({id(out) for out, _ in results}) == world


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int64])
def test_allreduce_sum_other_dtypes(dtype):
    with SimulatedCluster(3) as cluster:
        outs = cluster.run(lambda t: drive(t, allreduce_sum(torch.full((4, 2), t.rank + 1, dtype=dtype))))
        counters = [t.counter for t in cluster.transports]
    for out in outs:
        assert out.dtype == dtype and out.shape == (8,)
        assert torch.equal(out, torch.full((8,), 6, dtype=dtype))
    nbytes = 8 * torch.empty(0, dtype=dtype).element_size()
    assert all(c.up_payload == nbytes and c.down_payload == nbytes for c in counters)


# ----------------------------------------------------------------------------------------------- allgather


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sizes_of", ["different", "equal", "with-empty"])
def test_allgather_buffers(world, sizes_of):
    sizes = {
        "different": [7 * r + 3 for r in range(world)][::-1],
        "equal": [11] * world,
        "with-empty": [0 if r % 2 == 0 else 5 + r for r in range(world)],
    }[sizes_of]
    buffers = [rank_bytes(r, s) for r, s in enumerate(sizes)]

    def fn(t):
        return drive(t, allgather_buffers(t.rank, buffers[t.rank].clone())), t.counter.snapshot()

    with SimulatedCluster(world) as cluster:
        results = cluster.run(fn)
    largest = max(sizes)
    for rank, (got, c) in enumerate(results):
        assert len(got) == world
        for b, expected in zip(got, buffers):
            assert b.dtype == torch.uint8
            assert torch.equal(b, expected)
        others = [s for r, s in enumerate(sizes) if r != rank]
        assert c.up_payload == sizes[rank]
        assert c.down_payload == sum(others)
        assert c.up_padding == largest - sizes[rank]
        assert c.down_padding == sum(largest - s for s in others)
        assert c.up_control == 8
        assert c.down_control == 8 * (world - 1)
        assert c.server_in == 0 and c.server_out == 0
        assert c.collectives == 2
        assert c.bytes_up == sizes[rank] + 8
        assert c.bytes_down == sum(others) + 8 * (world - 1)
        assert c.padding_bytes == c.up_padding + c.down_padding


def test_allgather_counters_accumulate_over_calls():
    world = 3
    with SimulatedCluster(world) as cluster:
        for call in range(1, 4):
            cluster.run(lambda t: drive(t, allgather_buffers(t.rank, rank_bytes(t.rank, 10 + t.rank))))
            for rank, t in enumerate(cluster.transports):
                assert t.counter.up_payload == call * (10 + rank)
                assert t.counter.up_control == call * 8
                assert t.counter.down_control == call * 8 * (world - 1)
                assert t.counter.collectives == call * 2
        cluster.transports[0].counter.reset()
        assert cluster.transports[0].counter == ByteCounter()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sizes_of", ["different", "equal", "with-empty"])
def test_allgather_buffers_with_known_sizes_skips_the_size_round(world, sizes_of):
    """Lengths every worker knows in advance: the same buffers arrive, one collective, no control bytes."""
    sizes = {
        "different": [7 * r + 3 for r in range(world)],
        "equal": [11] * world,
        "with-empty": [0 if r % 2 == 0 else 5 + r for r in range(world)],
    }[sizes_of]
    buffers = [rank_bytes(r, s) for r, s in enumerate(sizes)]

    def fn(t):
        return drive(t, allgather_buffers(t.rank, buffers[t.rank].clone(), sizes)), t.counter.snapshot()

    with SimulatedCluster(world) as cluster:
        results = cluster.run(fn)
    largest = max(sizes)
    for rank, (got, c) in enumerate(results):
        assert [torch.equal(b, e) for b, e in zip(got, buffers)] == [True] * world
        others = [s for r, s in enumerate(sizes) if r != rank]
        assert c.up_payload == sizes[rank] and c.down_payload == sum(others)
        assert c.up_padding == largest - sizes[rank]
        assert c.up_control == 0 and c.down_control == 0
        assert c.collectives == 1


def test_a_buffer_that_contradicts_its_known_size_is_refused_before_sending():
    world = 3

    def fn(t):
        wrong = rank_bytes(t.rank, 12 if t.rank == 1 else 10)
        with pytest.raises(WireError, match="worker 1's buffer is 12 bytes but its specs fix 10"):
            drive(t, allgather_buffers(t.rank, wrong, [10] * world))
            raise AssertionError("not refused")
        return t.counter.snapshot()

    with SimulatedCluster(world) as cluster:
        counters = cluster.run(lambda t: fn(t) if t.rank == 1 else t.counter.snapshot())
    assert counters[1].collectives == 0 and counters[1].bytes_up == 0


# ----------------------------------------------------------------------------------------------- parameter server


def _ps_run(world, root, sizes):
    buffers = [rank_bytes(r, s) for r, s in enumerate(sizes)]
    calls = []

    def aggregate(received):
        calls.append((threading.current_thread().name, [b.clone() for b in received]))
        # something the workers cannot compute on their own: the received lengths and a byte-wise xor
        out = torch.zeros(max(sizes) + world, dtype=torch.uint8)
        for r, b in enumerate(received):
            out[: b.numel()] ^= b
            out[max(sizes) + r] = b.numel()
        return out

    def fn(t):
        down = drive(t, parameter_server(t.rank, buffers[t.rank].clone(), aggregate, root=root))
        return down, t.counter.snapshot()

    with SimulatedCluster(world) as cluster:
        results = cluster.run(fn)
    return buffers, calls, aggregate, results


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("root_at", ["first", "last"])
def test_parameter_server_contents_and_counters(world, root_at):
    root = 0 if root_at == "first" else world - 1
    sizes = [5 * r + 2 for r in range(world)]
    buffers, calls, _, results = _ps_run(world, root, sizes)

    # the aggregate ran once, at the root, on every worker's exact buffer in rank order
    assert len(calls) == 1
    received = calls[0][1]
    assert len(received) == world
    for got, sent in zip(received, buffers):
        assert torch.equal(got, sent)
    expected = torch.zeros(max(sizes) + world, dtype=torch.uint8)
    for r, b in enumerate(buffers):
        expected[: b.numel()] ^= b
        expected[max(sizes) + r] = b.numel()

    largest = max(sizes)
    n_down = expected.numel()
    for rank, (down, c) in enumerate(results):
        assert down.dtype == torch.uint8
        assert torch.equal(down, expected)
        assert c.up_payload == sizes[rank]
        assert c.up_padding == largest - sizes[rank]
        assert c.down_payload == n_down
        assert c.down_padding == 0
        assert c.up_control == 8  # the size exchange
        assert c.down_control == 8 * (world - 1) + 8  # the size exchange, then the downstream length
        if rank == root:
            assert c.server_in == sum(sizes)  # padding is not server input
            assert c.server_out >= world * n_down
        else:
            assert c.server_in == 0 and c.server_out == 0


@pytest.mark.parametrize("world", WORLDS)
def test_parameter_server_with_known_sizes_skips_both_size_rounds(world):
    sizes = [5 * r + 2 for r in range(world)]
    buffers = [rank_bytes(r, s) for r, s in enumerate(sizes)]
    downstream = rank_bytes(99, 9)

    def aggregate(received):
        assert [torch.equal(b, e) for b, e in zip(received, buffers)] == [True] * world
        return downstream.clone()

    def fn(t):
        out = drive(t, parameter_server(t.rank, buffers[t.rank].clone(), aggregate, 0, sizes, downstream.numel()))
        return out, t.counter.snapshot()

    with SimulatedCluster(world) as cluster:
        results = cluster.run(fn)
    for down, c in results:
        assert torch.equal(down, downstream)
        assert c.up_control == 0 and c.down_control == 0
        assert c.collectives == 2  # gather, broadcast


def test_parameter_server_refuses_a_downstream_buffer_of_another_size():
    def fn(t):
        return drive(t, parameter_server(t.rank, rank_bytes(t.rank, 4), lambda b: rank_bytes(0, 7), 0, [4], 8))

    with SimulatedCluster(1) as cluster, pytest.raises(WireError, match="the root's downstream buffer is 7 bytes"):
        cluster.run(fn)


@pytest.mark.parametrize("world", [1, 3])
def test_parameter_server_server_out_is_payload_only(world):
    sizes = [5 * r + 2 for r in range(world)]
    _, _, _, results = _ps_run(world, 0, sizes)
    down, c = results[0]
    assert c.server_out == world * down.numel()


@pytest.mark.parametrize("world", [1, 3])
def test_parameter_server_with_empty_downstream(world):
    def fn(t):
        return drive(t, parameter_server(t.rank, rank_bytes(t.rank, 4), lambda bufs: torch.zeros(0, dtype=torch.uint8)))

    with SimulatedCluster(world) as cluster:
        for out in cluster.run(fn):
            assert out.dtype == torch.uint8 and out.numel() == 0


# ----------------------------------------------------------------------------------------------- failures


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("when", ["before", "between", "after"])
def test_a_failing_worker_fails_the_run_fast(world, when):
    bad = world // 2

    def fn(t):
        if when == "before" and t.rank == bad:
            raise Boom(f"worker {t.rank} failed")
        drive(t, allreduce_sum(torch.ones(3)))
        if when == "between" and t.rank == bad:
            raise Boom(f"worker {t.rank} failed")
        drive(t, allgather_buffers(t.rank, rank_bytes(t.rank, 3)))
        if when == "after" and t.rank == bad:
            raise Boom(f"worker {t.rank} failed")
        return t.rank

    with SimulatedCluster(world, timeout=30.0) as cluster:
        started = time.perf_counter()
        with pytest.raises(Boom, match=f"worker {bad} failed"):
            cluster.run(fn)
        assert time.perf_counter() - started < 5.0  # aborted, not timed out

        # the same cluster runs again, cleanly, after the failure
        def ok(t):
            summed = drive(t, allreduce_sum(torch.full((2,), float(t.rank))))
            return summed, drive(t, allgather_buffers(t.rank, rank_bytes(t.rank, t.rank)))

        for sums, gathered in cluster.run(ok):
            assert torch.equal(sums, torch.full((2,), float(sum(range(world)))))
            assert [g.numel() for g in gathered] == list(range(world))


def test_the_original_exception_object_is_re_raised():
    error = gradcomp.NonFiniteGradientError("layer3.bias is NaN")

    def fn(t):
        if t.rank == 2:
            raise error
        drive(t, allreduce_sum(torch.ones(1)))

    with SimulatedCluster(4, timeout=30.0) as cluster:
        with pytest.raises(gradcomp.NonFiniteGradientError) as info:
            cluster.run(fn)
    assert info.value is error
    assert not isinstance(info.value, WorkerLostError)


def test_failure_inside_a_combine_is_re_raised():
    # shapes that cannot be summed: the combining worker fails, the others are released
    def fn(t):
        return drive(t, allreduce_sum(torch.ones(2 + t.rank)))

    with SimulatedCluster(3, timeout=30.0) as cluster:
        started = time.perf_counter()
        with pytest.raises(RuntimeError) as info:
            cluster.run(fn)
        assert not isinstance(info.value, WorkerLostError)
        assert time.perf_counter() - started < 5.0
        assert cluster.run(lambda t: drive(t, allreduce_sum(torch.ones(1))))[0].item() == 3.0


def test_a_missing_worker_times_out_with_worker_lost_error():
    def fn(t):
        if t.rank == 0:
            drive(t, allreduce_sum(torch.ones(1)))  # worker 1 never comes

    with SimulatedCluster(2, timeout=0.5) as cluster:
        started = time.perf_counter()
        with pytest.raises(WorkerLostError):
            cluster.run(fn)
        assert time.perf_counter() - started < 5.0
        assert [x.item() for x in cluster.run(lambda t: drive(t, allreduce_sum(torch.ones(1))))] == [2.0, 2.0]
