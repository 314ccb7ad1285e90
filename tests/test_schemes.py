"""The scheme layer: requests, the blocking driver, the new collectives, and honest aggregation.

A scheme yields collective requests and receives their results; every request is counted by the transport
and runs the same on the simulated cluster and on gloo.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

import gradcomp
from gradcomp import ConfigError, SimulatedCluster
from gradcomp.compressors.base import Slot
from gradcomp.schemes import Scheme, SingleRound
from gradcomp.schemes.single_round import message_nbytes
from gradcomp.train.exchange import GradientExchange, build_scheme
from gradcomp.transport import AllGather, AllReduce, AllToAll, Broadcast, Gather, drive
from gradcomp.transport.dist import DistTransport

W = 4


def chunks_for(rank: int, world: int, per: int) -> torch.Tensor:
    """W chunks of ``per`` values; chunk j of worker r holds 100·r + j (who sent it to whom)."""
    return torch.cat([torch.full((per,), 100.0 * rank + j) for j in range(world)])


def collectives(t) -> dict:
    """Every request kind once, through the driver; returns results and counters."""

    def rounds():
        mx = yield AllReduce(torch.tensor([float(t.rank), -float(t.rank)]), op="max")
        sm = yield AllReduce(torch.tensor([1.0, float(t.rank)]), inplace=True)
        a2a = yield AllToAll(chunks_for(t.rank, t.world_size, 3))
        gathered = yield AllGather(torch.tensor([t.rank], dtype=torch.int64))
        at_root = yield Gather(torch.tensor([t.rank * 2], dtype=torch.int64), root=1)
        bc = yield Broadcast(torch.tensor([7 if t.rank == 1 else 0], dtype=torch.int64), root=1)
        return mx, sm, a2a, [int(g) for g in gathered], at_root, int(bc)

    mx, sm, a2a, gathered, at_root, bc = drive(t, rounds())
    return {"max": mx, "sum": sm, "a2a": a2a, "gathered": gathered,
            "root": None if at_root is None else [int(x) for x in at_root], "bc": bc,
            "counter": t.counter.snapshot()}


def check_collectives(results: list[dict], world: int) -> None:
    for rank, r in enumerate(results):
        assert r["max"].tolist() == [world - 1, 0.0]
        assert r["sum"].tolist() == [float(world), float(sum(range(world)))]
        # chunk i of what rank r received came from worker i and was meant for r
        expected = torch.cat([torch.full((3,), 100.0 * i + rank) for i in range(world)])
        assert torch.equal(r["a2a"], expected)
        assert r["gathered"] == list(range(world))
        assert r["root"] == ([2 * i for i in range(world)] if rank == 1 else None)
        assert r["bc"] == 7
        c = r["counter"]
        # max 8 B + sum 8 B; all-to-all: 3 of 4 chunks of 12 B cross; all-gather 8 B up, 3·8 down; gather 8 up;
        # broadcast 8 down
        assert c.up_payload == 8 + 8 + (world - 1) * 12 + 8 + 8
        assert c.down_payload == 8 + 8 + (world - 1) * 12 + (world - 1) * 8 + 8
        assert c.ops["all_to_all"] == [1, world * 12]
        assert c.ops["all_reduce"] == [2, 16]


def test_every_request_through_the_simulated_cluster():
    with SimulatedCluster(W) as cluster:
        check_collectives(cluster.run(collectives), W)


def _gloo_collectives(rank, world):
    return collectives(DistTransport())


@pytest.mark.slow
def test_every_request_through_gloo():
    check_collectives(run_workers(_gloo_collectives, W, timeout=120), W)


def test_driver_refuses_something_that_is_not_a_request():
    def rounds():
        yield "allreduce please"

    with SimulatedCluster(1) as cluster, pytest.raises(TypeError, match="not a collective request"):
        cluster.run(lambda t: drive(t, rounds()))


def test_all_to_all_needs_whole_chunks():
    with SimulatedCluster(2) as cluster, pytest.raises(ValueError, match="multiple of 2"):
        cluster.run(lambda t: t.all_to_all(torch.zeros(3)))


# ----------------------------------------------------------------------------------------------- a custom scheme


class MaxOfMeans(Scheme):
    """Two rounds: the mean, then the max over workers of (mean + rank) — a scheme that owns its rule."""

    name = "max-of-means-test"

    def run(self, slots, tensors, step):
        flat = torch.cat([t.reshape(-1) for t in tensors]) / self.world_size
        mean = yield AllReduce(flat)
        top = yield AllReduce(mean + self.rank, op="max")
        return list(torch.split(top, [s.numel for s in slots]))


def test_a_scheme_runs_through_the_exchange_and_is_counted():
    slots = [Slot("a", 0, 3), Slot("b", 1, 2)]

    def fn(t):
        ex = GradientExchange(MaxOfMeans(), t)
        out = ex.exchange(slots, [torch.full((3,), float(t.rank)), torch.ones(2)], step=0)
        return out, t.counter.snapshot()

    with SimulatedCluster(W) as cluster:
        results = cluster.run(fn)
    for out, counter in results:
        assert torch.equal(out[0], torch.full((3,), 1.5 + W - 1))
        assert torch.equal(out[1], torch.full((2,), 1.0 + W - 1))
        assert counter.ops["all_reduce"] == [2, 40] and counter.bytes_up == 40


def test_a_scheme_takes_no_topology():
    with pytest.raises(ConfigError, match="owns its rounds"):
        build_scheme(MaxOfMeans(), topology="allgather")
    with pytest.raises(ConfigError, match="compressor or a scheme"):
        build_scheme("topk")


# ----------------------------------------------------------------------------------------------- honest bits


def test_two_workers_sending_near_fp32_max_through_topk_average_to_a_finite_value():
    slots = [Slot("w", 0, 8)]

    def fn(t):
        x = torch.zeros(8)
        x[2] = 3e38
        x[5] = -3e38 if t.rank == 0 else 1.0
        return GradientExchange(gradcomp.make("topk", k=2), t).exchange(slots, [x], 0)[0]

    with SimulatedCluster(2) as cluster:
        out = cluster.run(fn)
    assert torch.isfinite(out[0]).all()
    assert out[0][2].item() == pytest.approx(3e38, rel=1e-6)
    assert out[0][5].item() == pytest.approx(-1.5e38, rel=1e-6)
    assert torch.equal(out[0], out[1])


def test_overflow_fallback_keeps_the_majority_rule():
    # a compressor whose rule is not the mean still sees the right sign after the fallback
    class SignOfSum(gradcomp.compressors.sparse.TopK):
        def aggregate(self, total, count):
            return torch.sign(total)

    slots = [Slot("w", 0, 4)]

    def fn(t):
        x = torch.tensor([3e38, -3e38, 1.0, 0.0])
        return GradientExchange(SignOfSum(k=3), t).exchange(slots, [x], 0)[0]

    with SimulatedCluster(3) as cluster:
        out = cluster.run(fn)
    assert out[0].tolist() == [1.0, -1.0, 1.0, 0.0]


class _WrongDtype(gradcomp.compressors.dense.NoCompression):
    name = "wrong-dtype-test"

    def compress(self, x, slot, step):
        return [x.reshape(-1).to(torch.float64)]


def test_summed_fields_are_checked_against_their_specs():
    slots = [Slot("w", 0, 4)]
    with SimulatedCluster(1) as cluster, pytest.raises(ConfigError, match="float64"):
        cluster.run(lambda t: GradientExchange(_WrongDtype(), t).exchange(slots, [torch.ones(4)], 0))


def test_message_size_from_specs():
    topk = gradcomp.make("topk", k=10)
    # 10 positions of ceil(log2 1000) = 10 bits, 10 fp32 values
    assert message_nbytes(topk.specs(Slot("w", 0, 1000))) == 13 + 40
    assert message_nbytes(gradcomp.make("threshold").specs(Slot("w", 0, 1000))) is None


def test_min_compression_rate_sends_small_tensors_uncompressed():
    slots = [Slot("bias", 0, 4), Slot("weight", 1, 1000)]

    def fn(t):
        gen = torch.Generator().manual_seed(t.rank)
        tensors = [torch.randn(4, generator=gen), torch.randn(1000, generator=gen)]
        ex = GradientExchange(gradcomp.make("topk", density=0.3), t, min_compression_rate=2.0)
        return tensors, ex.exchange(slots, tensors, 0), t.counter.snapshot()

    with SimulatedCluster(2) as cluster:
        results = cluster.run(fn)
    (a, out, counter), (b, _, _) = results
    # the bias (2 of 4 kept: 1 B of positions + 8 B of values, not half of its 16 B) is the exact mean
    assert torch.allclose(out[0], (a[0] + b[0]) / 2)
    # the weight (300 of 1000: 375 + 1200 B, less than half of 4000 B) went through topk
    assert int((out[1] != 0).sum()) <= 600
    assert counter.ops["all_reduce"] == [1, 16]


def test_min_compression_rate_must_be_positive():
    with pytest.raises(ConfigError, match="min_compression_rate"):
        SingleRound(gradcomp.make("topk"), min_compression_rate=0)


def test_a_server_compressors_limits_are_checked_before_anything_is_sent():
    slots = [Slot("a", 0, 50)]

    def fn(t):
        ex = GradientExchange(gradcomp.make("topk", k=5), t, topology="ps",
                              server_compressor=gradcomp.make("topk", k=100))
        with pytest.raises(ConfigError, match="k=100 exceeds"):
            ex.exchange(slots, [torch.ones(50)], 0)
        return t.counter.collectives

    with SimulatedCluster(3) as cluster:
        assert cluster.run(fn) == [0, 0, 0]


def test_the_server_compressor_must_be_its_own_instance():
    c = gradcomp.make("topk", density=0.1, error_feedback=True)
    with pytest.raises(ConfigError, match="own instance"):
        SingleRound(c, "ps", server_compressor=c)


@pytest.mark.parametrize("rate", ["2", True, float("inf"), float("nan"), -1])
def test_bad_min_compression_rates_are_config_errors(rate):
    with pytest.raises(ConfigError, match="min_compression_rate"):
        SingleRound(gradcomp.make("topk"), "allgather", min_compression_rate=rate)
