"""Sharded topology: every worker serves 1/W of every slot (all-to-all up, all-gather down).

Results are checked against hand computations over the shards (shard bounds from ``torch.tensor_split``,
shard slots named and numbered independently of the module), bytes against exact expectations, and a gloo
run against the simulated one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_workers
from gradients import rank_order_mean, worker_gradients

import gradcomp
from gradcomp import ConfigError, GradientExchange, SimulatedCluster, Slot
from gradcomp.compressors.base import bind_worker
from gradcomp.compressors.dense import NoCompression
from gradcomp.protocols import alltoall_buffers
from gradcomp.schemes.sharded import Sharded, shard_bounds
from gradcomp.train.exchange import build_scheme
from gradcomp.transport.dist import DistTransport
from gradcomp.transport.requests import drive
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES, bits_needed

# slots smaller than W (1, 3), one empty, one not a multiple of W
SIZES = [1, 3, 0, 37, 300]
SLOTS = [Slot(f"layer{i}.weight", i, n) for i, n in enumerate(SIZES)]


def grads(rank: int, step: int = 0, sizes=SIZES) -> list[torch.Tensor]:
    return worker_gradients(rank, step, sizes, stride=1000)


def run_sharded(world, make, steps=1, slots=SLOTS, inputs=grads, make_server=None, extra=None):
    """One GradientExchange per worker, topology sharded; returns (results per step per worker, extra per worker)."""

    def fn(t):
        server = make_server() if make_server is not None else None
        ex = GradientExchange(make(), t, topology="sharded", server_compressor=server)
        outs = [ex.exchange(slots, inputs(t.rank, s), s) for s in range(steps)]
        return outs, (extra(ex, t) if extra is not None else t.counter.snapshot())

    with SimulatedCluster(world, timeout=60.0) as cluster:
        per_worker = cluster.run(fn)
    return [[per_worker[r][0][s] for r in range(world)] for s in range(steps)], [x for _, x in per_worker]


def assert_identical(per_worker: list[list[torch.Tensor]]) -> None:
    for worker in per_worker[1:]:
        assert len(worker) == len(per_worker[0])
        for a, b in zip(worker, per_worker[0]):
            assert a.dtype == torch.float32
            assert torch.equal(a, b)


def hand_shards(slot: Slot, world: int) -> list[tuple[Slot, int, int]]:
    """(shard slot, start, stop) computed without the module: tensor_split bounds, name/index by the doc's rule."""
    out, start = [], 0
    for j, piece in enumerate(torch.tensor_split(torch.arange(slot.numel), world)):
        stop = start + piece.numel()
        out.append((Slot(f"{slot.name}/shard{j}", slot.index * world + j, piece.numel()), start, stop))
        start = stop
    return out


def hand_sharded(world, make, inputs, step=0, make_server=NoCompression, slots=SLOTS) -> list[torch.Tensor]:
    """What the sharded exchange should give, computed shard by shard with fresh compressors."""
    workers = []
    for r in range(world):
        c = make()
        bind_worker(c, r)
        workers.append(c)
    results = []
    for slot, per in zip(slots, zip(*[inputs(r, step, [s.numel for s in slots]) for r in range(world)])):
        out = torch.zeros(slot.numel)
        for j, (shard, start, stop) in enumerate(hand_shards(slot, world)):
            if start == stop:
                continue
            total = torch.zeros(stop - start)
            for r in range(world):
                total += workers[r].decompress(workers[r].compress(per[r][start:stop], shard, step), shard, step)
            aggregate = workers[0].aggregate(total, world)
            server = make_server()
            bind_worker(server, world + j)
            out[start:stop] = server.decompress(server.compress(aggregate, shard, step), shard, step)
        results.append(out)
    return results


# ----------------------------------------------------------------------------------------------- results


@pytest.mark.parametrize("world", [4, 5])
def test_none_gives_the_plain_mean(world):
    (results,), _ = run_sharded(world, lambda: gradcomp.make("none"))
    assert_identical(results)
    for i, slot in enumerate(SLOTS):
        expected = rank_order_mean([grads(r)[i] for r in range(world)])
        assert results[0][i].shape == (slot.numel,)
        torch.testing.assert_close(results[0][i], expected)


def test_shard_bounds_match_tensor_split():
    for n in [0, 1, 3, 4, 5, 37, 300]:
        for w in [1, 4, 5, 16]:
            got = shard_bounds(n, w)
            want = [(s, e) for _, s, e in hand_shards(Slot("x", 0, n), w)]
            assert got == want
            assert max(e - s for s, e in got) - min(e - s for s, e in got) <= 1


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("topk", {"density": 0.1}), ("topk", {"k": 1}), ("cnat", {}), ("sbc", {"density": 0.1}),
        ("threshold", {"threshold": 1.0}),
    ],
    ids=["topk", "topk-k1", "cnat", "sbc", "threshold"],
)
@pytest.mark.parametrize("world", [4, 5])
def test_result_is_the_hand_computation_over_shards(name, params, world):
    make = lambda: gradcomp.make(name, **params)  # noqa: E731
    (results,), _ = run_sharded(world, make)
    assert_identical(results)
    expected = hand_sharded(world, make, grads)
    for got, want in zip(results[0], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_server_compressor_rounds_independently_per_owner():
    """cnat on both sides: the owner of shard j rounds as worker W + j (its randomness is not any worker's)."""
    make = lambda: gradcomp.make("cnat")  # noqa: E731
    (results,), _ = run_sharded(4, make, make_server=make)
    assert_identical(results)
    expected = hand_sharded(4, make, grads, make_server=make)
    for got, want in zip(results[0], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class MajorityVote(NoCompression):
    """fp32 messages, aggregated by the sign of their sum (the rule signSGD's majority vote uses)."""

    name = "vote"
    summable = False

    def compress(self, x, slot, step):
        return [torch.sign(x.reshape(-1).to(torch.float32))]

    def aggregate(self, total, count):
        return torch.sign(total)


def test_majority_vote_aggregation_rule_is_applied_by_the_owner():
    (results,), _ = run_sharded(5, MajorityVote)
    assert_identical(results)
    for i in range(len(SLOTS)):
        votes = sum(torch.sign(grads(r)[i]) for r in range(5))
        assert torch.equal(results[0][i], torch.sign(votes))


def test_slot_with_no_shard_for_some_owners_and_single_slot():
    """Only owner 0 has anything to serve: the other owners send and receive empty buffers."""
    slots = [Slot("tiny", 7, 1)]
    (results,), counters = run_sharded(
        4, lambda: gradcomp.make("topk", k=1), slots=slots, inputs=lambda r, s: grads(r, s, [1])
    )
    assert_identical(results)
    expected = rank_order_mean([grads(r, 0, [1])[0] for r in range(4)])
    torch.testing.assert_close(results[0][0], expected)
    # only the one 1-entry shard travels: 3 workers → owner 0 up, owner 0's buffer down
    assert counters[1].up_payload == HEADER_BYTES + topk_bytes(1, 1)
    assert counters[1].down_payload == HEADER_BYTES + SECTION_HEADER_BYTES + 4


# ----------------------------------------------------------------------------------------------- bytes


def cnat_bytes(n: int) -> int:
    return SECTION_HEADER_BYTES + (9 * n + 7) // 8


def topk_bytes(n: int, k: int) -> int:
    return 2 * SECTION_HEADER_BYTES + (k * bits_needed(n) + 7) // 8 + 4 * k


@pytest.mark.parametrize("world", [4, 5])
@pytest.mark.parametrize("method", ["cnat", "topk-k1"])
def test_counters_match_the_exact_expectation(world, method):
    if method == "cnat":
        make, up_field = (lambda: gradcomp.make("cnat")), cnat_bytes
    else:
        make, up_field = (lambda: gradcomp.make("topk", k=1)), (lambda n: topk_bytes(n, 1))
    sizes = [5, 37, 300, 2]  # every shard non-empty for k = 1 except slot 3's at world 4, 5
    slots = [Slot(f"s{i}", i, n) for i, n in enumerate(sizes)]
    _, counters = run_sharded(world, make, slots=slots, inputs=lambda r, s, sz=sizes: grads(r, s, sz))
    up, down = [], []  # bytes of the buffer for owner j, and of owner j's downstream buffer (fp32)
    for j in range(world):
        shards = [stop - start for n in sizes for start, stop in [shard_bounds(n, world)[j]] if stop > start]
        up.append(HEADER_BYTES + sum(up_field(n) for n in shards))
        down.append(HEADER_BYTES + sum(SECTION_HEADER_BYTES + 4 * n for n in shards))
    for r, c in enumerate(counters):
        others = [j for j in range(world) if j != r]
        assert c.up_payload == sum(up[j] for j in others) + down[r]
        assert c.down_payload == (world - 1) * up[r] + sum(down[j] for j in others)
        assert c.up_padding == sum(max(up) - up[j] for j in others) + max(down) - down[r]
        assert c.down_padding == (world - 1) * (max(up) - up[r]) + sum(max(down) - down[j] for j in others)
        # fixed-width messages: every worker computes every length from the specs, no size rounds
        assert c.up_control == 0 and c.down_control == 0
        assert c.server_in == 0 and c.server_out == 0
        assert c.ops["all_to_all"][0] == 1 and c.ops["all_gather"][0] == 1
        assert set(c.ops) == {"all_to_all", "all_gather"}


@pytest.mark.parametrize("world", [4, 5])
def test_messages_whose_size_depends_on_the_data_exchange_their_sizes(world):
    """threshold keeps as many entries as pass it, up and down: a control all-to-all of (length for you, my
    longest) per destination before the all-to-all, and 1 int64 per worker before the downstream all-gather."""
    sizes = [5, 37, 300, 2]
    slots = [Slot(f"s{i}", i, n) for i, n in enumerate(sizes)]
    make = lambda: gradcomp.make("threshold", threshold=0.5)  # noqa: E731

    def fn(t):
        ex = GradientExchange(make(), t, topology="sharded", server_compressor=make())
        out = ex.exchange(slots, grads(t.rank, 0, sizes), 0)
        return out, t.counter.snapshot()

    with SimulatedCluster(world, timeout=60.0) as cluster:
        results = cluster.run(fn)
    for out, c in results:
        assert all(torch.equal(a, b) for a, b in zip(out, results[0][0]))
        assert c.up_control == 16 * (world - 1) + 8
        assert c.down_control == 16 * (world - 1) + 8 * (world - 1)
        assert c.ops["all_to_all"][0] == 2 and c.ops["all_gather"][0] == 2


def test_a_buffer_that_contradicts_the_known_lengths_is_refused_before_sending():
    def fn(t):
        buffers = [torch.zeros(6 if (t.rank, j) == (1, 2) else 5, dtype=torch.uint8) for j in range(3)]
        if t.rank != 1:
            return t.counter.snapshot()
        with pytest.raises(gradcomp.WireError, match="worker 1's buffer for worker 2 is 6 bytes but its specs fix 5"):
            drive(t, alltoall_buffers(t.rank, buffers, [5, 5, 5]))
        return t.counter.snapshot()

    with SimulatedCluster(3, timeout=60.0) as cluster:
        assert cluster.run(fn)[1].collectives == 0


def bytes_per_worker(world: int, topology: str, n: int = 20000) -> tuple[float, float]:
    slots = [Slot("w", 0, n), Slot("b", 1, 10)]

    def fn(t):
        ex = GradientExchange(
            gradcomp.make("cnat"), t, topology=topology,
            server_compressor=gradcomp.make("cnat") if topology != "allgather" else None,
        )
        ex.exchange(slots, grads(t.rank, 0, [n, 10]), 0)
        return t.counter.bytes_up, t.counter.bytes_down

    with SimulatedCluster(world, timeout=60.0) as cluster:
        counts = cluster.run(fn)
    return sum(u for u, _ in counts) / world, sum(d for _, d in counts) / world


def test_bytes_per_worker_stay_flat_as_workers_grow():
    """cnat both ways, one message M = 9/8 bytes per entry: up = (W-1)/W·M of shards + M/W of aggregate ≈ M;
    down = (W-1)/W·M of shards + (W-1)/W·M of aggregates ≈ 2M; both flat in W apart from framing."""
    (up4, down4), (up16, down16) = bytes_per_worker(4, "sharded"), bytes_per_worker(16, "sharded")
    message = 20000 * 9 / 8
    assert up16 < 1.1 * up4 and down16 < 1.3 * down4  # down: 2·3/4 → 2·15/16 of a message
    for up in (up4, up16):
        assert 0.95 * message < up < 1.1 * message
    assert 1.45 * message < down4 < 1.6 * message and 1.8 * message < down16 < 2.0 * message
    _, gather4 = bytes_per_worker(4, "allgather")
    _, gather16 = bytes_per_worker(16, "allgather")
    assert gather16 > 4.5 * gather4  # the contrast: an all-gather brings W - 1 messages down


# ----------------------------------------------------------------------------------------------- error feedback, state


def residual_of(state: dict, slot: Slot, j: int, world: int) -> torch.Tensor:
    start, stop = shard_bounds(slot.numel, world)[j]
    found = state["residuals"].get(f"{slot.name}/shard{j}#{stop - start}")
    return found if found is not None else torch.zeros(stop - start)


def test_error_feedback_on_both_sides_accounts_for_every_entry():
    """sum_t result_t = mean_r sum_t g_r,t - mean_r e_r - e_server, shard by shard (both residual identities)."""
    world, steps = 4, 5

    def extra(ex, t):
        return ex.scheme.state_dict()

    results, states = run_sharded(
        world, lambda: gradcomp.make("topk", density=0.1, error_feedback=True), steps=steps,
        make_server=lambda: gradcomp.make("topk", density=0.2, error_feedback=True), extra=extra,
    )
    for s in range(steps):
        assert_identical(results[s])
    for i, slot in enumerate(SLOTS):
        sent = sum(results[s][0][i] for s in range(steps))
        wanted = sum(rank_order_mean([grads(r, s)[i] for r in range(world)]) for s in range(steps))
        parts = []
        for j in range(world):
            worker_residual = sum(residual_of(states[r]["compressor"], slot, j, world) for r in range(world)) / world
            parts.append(worker_residual + residual_of(states[j]["server"], slot, j, world))
        torch.testing.assert_close(sent + torch.cat(parts), wanted, rtol=1e-5, atol=1e-5)
        if slot.numel >= 20:
            assert any(float(p.abs().max()) > 0 for p in parts)  # the residuals are really used
    # an owner keeps server residuals only for its own shards
    for r, state in enumerate(states):
        assert all(f"/shard{r}#" in key for key in state["server"]["residuals"])


def test_state_round_trip_continues_exactly():
    world = 4
    make = lambda: gradcomp.make("topk", density=0.1, error_feedback=True)  # noqa: E731
    make_server = lambda: gradcomp.make("cnat", error_feedback=True)  # noqa: E731

    def fn(t):
        a = GradientExchange(make(), t, topology="sharded", server_compressor=make_server())
        for s in range(3):
            a.exchange(SLOTS, grads(t.rank, s), s)
        state = copy.deepcopy(a.state_dict())
        b = GradientExchange(make(), t, topology="sharded", server_compressor=make_server())
        b.load_state_dict(state)
        return a.exchange(SLOTS, grads(t.rank, 3), 3), b.exchange(SLOTS, grads(t.rank, 3), 3), state

    with SimulatedCluster(world, timeout=60.0) as cluster:
        out = cluster.run(fn)
    for cont, resumed, state in out:
        for x, y in zip(cont, resumed):
            assert torch.equal(x, y)
        assert state["compressor"]["residuals"] and state["server"]["residuals"]
    with pytest.raises(ConfigError, match="unexpected"):
        Sharded(make()).load_state_dict({"compressor": {}, "bogus": 1})


def test_retain_drops_the_shards_of_slots_no_longer_exchanged():
    def fn(t):
        ex = GradientExchange(
            gradcomp.make("topk", density=0.1, error_feedback=True), t, topology="sharded",
            server_compressor=gradcomp.make("topk", density=0.5, error_feedback=True),
        )
        ex.exchange(SLOTS, grads(t.rank), 0)
        before = copy.deepcopy(ex.state_dict())
        ex.scheme.retain([SLOTS[4]])
        return before, ex.state_dict()

    with SimulatedCluster(4, timeout=60.0) as cluster:
        out = cluster.run(fn)
    for rank, (before, after) in enumerate(out):
        assert any(k.startswith("layer3.weight/") for k in before["compressor"]["residuals"])
        assert any(k.startswith("layer3.weight/") for k in before["server"]["residuals"])
        assert after["compressor"]["residuals"]
        assert all(k.startswith("layer4.weight/") for k in after["compressor"]["residuals"])
        assert set(after["server"]["residuals"]) == {f"layer4.weight/shard{rank}#75"}


# ----------------------------------------------------------------------------------------------- bad input


def test_bad_configuration_raises_config_error():
    topk = gradcomp.make("topk", density=0.1)
    with pytest.raises(ConfigError, match="own instance"):
        Sharded(topk, server_compressor=topk)
    with pytest.raises(ConfigError, match="compressor"):
        Sharded("topk")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="server compressor"):
        Sharded(topk, server_compressor="none")  # type: ignore[arg-type]
    scheme = build_scheme(gradcomp.make("cnat"), topology="sharded", server_compressor=gradcomp.make("cnat"))
    assert isinstance(scheme, Sharded) and scheme.topology == "sharded"
    assert scheme.server_compressor.name == "cnat"


@pytest.mark.parametrize("side", ["worker", "server"])
def test_k_larger_than_a_shard_fails_before_anything_is_sent(side):
    slots = [Slot("w", 0, 20)]  # shards of 5 at W = 4
    too_big = lambda: gradcomp.make("topk", k=6)  # noqa: E731
    fits = lambda: gradcomp.make("topk", k=2)  # noqa: E731
    # check_slots before bind sees the whole slot; bound to W = 4 it sees the shards
    scheme = Sharded(too_big() if side == "worker" else fits(), too_big() if side == "server" else None)
    scheme.check_slots(slots)
    scheme.bind(0, 4)
    with pytest.raises(ConfigError, match="k=6 exceeds the 5 elements of w/shard0"):
        scheme.check_slots(slots)

    def fn(t):
        ex = GradientExchange(
            too_big() if side == "worker" else fits(), t, topology="sharded",
            server_compressor=too_big() if side == "server" else None,
        )
        try:
            ex.exchange(slots, [torch.randn(20)], 0)
        except ConfigError as e:
            return str(e), t.counter.snapshot()
        return None, t.counter.snapshot()

    with SimulatedCluster(4, timeout=60.0) as cluster:
        out = cluster.run(fn)
    for message, counter in out:
        assert message is not None and "exceeds" in message
        assert counter.collectives == 0 and counter.bytes_up == 0


# ----------------------------------------------------------------------------------------------- gloo


GLOO_STEPS = 3


def _exchange_steps(t) -> list[list[torch.Tensor]]:
    ex = GradientExchange(
        gradcomp.make("topk", density=0.1, error_feedback=True), t, topology="sharded",
        server_compressor=gradcomp.make("cnat", error_feedback=True),
    )
    return [ex.exchange(SLOTS, grads(t.rank, s), s) for s in range(GLOO_STEPS)]


def _gloo_worker(rank, world):
    t = DistTransport()
    return _exchange_steps(t), t.counter.snapshot()


@pytest.mark.slow
def test_gloo_replicas_identical_and_equal_to_the_simulated_run(single_thread):
    gloo = run_workers(_gloo_worker, 4, timeout=180)
    with SimulatedCluster(4, timeout=60.0) as cluster:
        sim = cluster.run(lambda t: (_exchange_steps(t), t.counter.snapshot()))
    for s in range(GLOO_STEPS):
        assert_identical([outs[s] for outs, _ in gloo])
        for a, b in zip(gloo[0][0][s], sim[0][0][s]):
            assert torch.equal(a, b)
    for (_, g), (_, m) in zip(gloo, sim):
        assert (g.up_payload, g.down_payload, g.up_padding, g.down_padding, g.up_control, g.down_control) == (
            m.up_payload, m.down_payload, m.up_padding, m.down_padding, m.up_control, m.down_control
        )
