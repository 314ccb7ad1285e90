"""Tests for GradientExchange and GradientAggregator over a simulated cluster of W = 4 workers."""

from __future__ import annotations

import pytest
import torch
from gradients import rank_order_mean, worker_gradients
from torch import nn

import gradcomp
from gradcomp import (
    ByteCounter,
    ConfigError,
    GradientAggregator,
    GradientExchange,
    NonFiniteGradientError,
    SimulatedCluster,
    Slot,
)
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES, bits_needed

W = 4
SIZES = [1, 37, 300, 64]
SLOTS = [Slot(f"layer{i}.weight", i, n) for i, n in enumerate(SIZES)]

CONFIGS = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("topk", {"density": 0.1}),
    ("topk", {"density": 0.1, "positions": "golomb"}),
    ("randomk", {"density": 0.1}),
    ("randomk", {"density": 0.1, "scale": True}),
    ("threshold", {"threshold": 1.0}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in p.items()) for name, p in CONFIGS]


@pytest.fixture(scope="module")
def cluster():
    with SimulatedCluster(W, timeout=60.0) as c:
        yield c


@pytest.fixture(autouse=True)
def fresh_counters(cluster):
    for t in cluster.transports:
        t.counter.reset()


def grads(rank: int, step: int = 0, sizes=SIZES) -> list[torch.Tensor]:
    return worker_gradients(rank, step, sizes, stride=100)


def run_exchange(cluster, make_compressor, steps=1, slots=SLOTS, inputs=grads, **kwargs):
    """One GradientExchange per worker; returns per step, per worker, the list of averaged tensors."""

    def fn(t):
        ex = GradientExchange(make_compressor(), t, **kwargs)
        return [ex.exchange(slots, inputs(t.rank, step), step) for step in range(steps)]

    per_worker = cluster.run(fn)
    return [[per_worker[r][s] for r in range(W)] for s in range(steps)]


def assert_identical_on_all_workers(results):
    for worker in results[1:]:
        assert len(worker) == len(results[0])
        for a, b in zip(worker, results[0]):
            assert a.dtype == torch.float32
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- all compressors


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
def test_every_worker_gets_the_same_result(cluster, name, params, error_feedback):
    if error_feedback and params.get("scale"):
        with pytest.raises(gradcomp.ConfigError, match="contractive"):
            gradcomp.make(name, error_feedback=True, **params)
        return
    steps = 3
    results = run_exchange(cluster, lambda: gradcomp.make(name, error_feedback=error_feedback, **params), steps)
    for step in range(steps):
        assert_identical_on_all_workers(results[step])
        for out, slot in zip(results[step][0], SLOTS):
            assert out.shape == (slot.numel,)
            assert torch.isfinite(out).all()


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("topology", ["auto", "allgather", "ps"])
def test_result_is_the_mean_of_the_decompressed_messages(cluster, name, params, topology):
    """Whatever the topology, the average is the mean of what each worker's compressor made of its input."""
    reference = gradcomp.make(name, **params)
    (results,) = run_exchange(cluster, lambda: gradcomp.make(name, **params), topology=topology)
    assert_identical_on_all_workers(results)
    for i, slot in enumerate(SLOTS):
        per_worker = [reference.decompress(reference.compress(grads(r)[i], slot, 0), slot, 0) for r in range(W)]
        expected = rank_order_mean(per_worker)
        # Summable compressors on allreduce add the fields before decompressing; fp16 / bf16 fields are summed
        # at their own precision, each of the W - 1 additions rounding by at most u * (sum of |values|).
        u = {"fp16": 2**-11, "bf16": 2**-8}.get(name, 2**-24)
        magnitude = float(torch.stack(per_worker).abs().sum(0).max())
        tol = 1.5 * (W - 1) * u * magnitude / W + 1e-7
        torch.testing.assert_close(results[0][i], expected, rtol=0, atol=tol)


def test_none_gives_the_true_mean(cluster):
    (results,) = run_exchange(cluster, lambda: gradcomp.make("none"))
    assert_identical_on_all_workers(results)
    for i in range(len(SLOTS)):
        true_mean = torch.stack([grads(r)[i].double() for r in range(W)]).mean(0)
        torch.testing.assert_close(results[0][i].double(), true_mean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("name", "u"), [("fp16", 2**-11), ("bf16", 2**-8)])
def test_half_precision_is_close_to_the_true_mean(cluster, name, u):
    (results,) = run_exchange(cluster, lambda: gradcomp.make(name))
    for i in range(len(SLOTS)):
        stacked = torch.stack([grads(r)[i] for r in range(W)])
        true_mean = stacked.mean(0)
        # casting: at most u * max|x| per worker, hence on the mean; summing at that precision: W - 1 roundings
        # of partial sums bounded by W * max|x|, divided by W. Together at most W * u * max|x|.
        bound = 1.5 * W * u * float(stacked.abs().max())
        torch.testing.assert_close(results[0][i], true_mean, rtol=0, atol=bound)
    # and it is a lossy cast: not the exact mean
    assert any(
        not torch.equal(results[0][i], torch.stack([grads(r)[i] for r in range(W)]).mean(0)) for i in range(1, 3)
    )


@pytest.mark.parametrize("positions", ["fixed", "golomb"])
def test_topk_allgather_is_the_mean_of_each_workers_topk(cluster, positions):
    density = 0.1
    (results,) = run_exchange(cluster, lambda: gradcomp.make("topk", density=density, positions=positions))
    assert_identical_on_all_workers(results)
    for i, n in enumerate(SIZES):
        k = -(-n // 10)  # ceil(0.1 n) for these sizes
        sparsified = []
        for r in range(W):
            x = grads(r)[i]
            keep = torch.argsort(x.abs(), descending=True)[:k]
            dense = torch.zeros(n)
            dense[keep] = x[keep]
            sparsified.append(dense)
        torch.testing.assert_close(results[0][i], rank_order_mean(sparsified), rtol=1e-6, atol=1e-7)


def test_topk_allgather_counters(cluster):
    steps = 2
    run_exchange(cluster, lambda: gradcomp.make("topk", density=0.1), steps)
    # one buffer per worker: header + per slot (positions section + values section), all the same size, which
    # every worker computes from the specs: no size round, one collective per step
    size = HEADER_BYTES
    for n in SIZES:
        k = -(-n // 10)
        size += 2 * SECTION_HEADER_BYTES + (k * bits_needed(n) + 7) // 8 + 4 * k
    for t in cluster.transports:
        c = t.counter
        assert c.up_payload == steps * size
        assert c.down_payload == steps * (W - 1) * size
        assert c.up_padding == 0 and c.down_padding == 0
        assert c.up_control == 0 and c.down_control == 0
        assert c.collectives == steps


def test_randomk_uses_one_allreduce_of_the_values_only(cluster):
    run_exchange(cluster, lambda: gradcomp.make("randomk", density=0.1))
    k_total = sum(-(-n // 10) for n in SIZES)
    for t in cluster.transports:
        assert t.counter == ByteCounter(
            up_payload=4 * k_total, down_payload=4 * k_total, collectives=1, seconds=t.counter.seconds,
            ops={"all_reduce": [1, 4 * k_total]},
        )


# ----------------------------------------------------------------------------------------------- parameter server


def test_ps_with_topk_server_compressor_gives_topk_of_the_average(cluster):
    density = 0.1
    (results,) = run_exchange(
        cluster,
        lambda: gradcomp.make("none"),
        topology="ps",
        server_compressor=gradcomp.make("topk", density=density),
    )
    assert_identical_on_all_workers(results)
    for i, n in enumerate(SIZES):
        average = rank_order_mean([grads(r)[i] for r in range(W)])
        k = -(-n // 10)
        keep = torch.argsort(average.abs(), descending=True)[:k]
        expected = torch.zeros(n)
        expected[keep] = average[keep]
        torch.testing.assert_close(results[0][i], expected, rtol=1e-6, atol=1e-7)
        assert int((results[0][i] != 0).sum()) == k


@pytest.mark.parametrize("root", [0, 2, 3])
def test_ps_counters(cluster, root):
    (results,) = run_exchange(
        cluster,
        lambda: gradcomp.make("none"),
        topology="ps",
        root=root,
        server_compressor=gradcomp.make("topk", density=0.1),
    )
    assert_identical_on_all_workers(results)
    up = HEADER_BYTES + sum(SECTION_HEADER_BYTES + 4 * n for n in SIZES)
    down = HEADER_BYTES
    for n in SIZES:
        k = -(-n // 10)
        down += 2 * SECTION_HEADER_BYTES + (k * bits_needed(n) + 7) // 8 + 4 * k
    for rank, t in enumerate(cluster.transports):
        c = t.counter
        assert c.up_payload == up and c.up_padding == 0
        assert c.down_payload == down
        assert c.up_control == 0 and c.down_control == 0  # both sizes follow from the specs: no size rounds
        assert c.collectives == 2  # gather, broadcast
        if rank == root:
            assert c.server_in == W * up
            assert c.server_out == W * down  # the server sends its buffer once per worker, nothing else
        else:
            assert c.server_in == 0 and c.server_out == 0


def test_ps_without_server_compressor_equals_allgather(cluster):
    make = lambda: gradcomp.make("topk", density=0.1)  # noqa: E731
    (ps,) = run_exchange(cluster, make, topology="ps")
    (ag,) = run_exchange(cluster, make, topology="allgather")
    assert_identical_on_all_workers(ps)
    for a, b in zip(ps[0], ag[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_ps_server_error_feedback_lives_on_the_root(cluster):
    """The server compressor's residual makes the downstream sum over steps track the sum of the averages."""
    steps = 6

    def fn(t):
        ex = GradientExchange(
            gradcomp.make("none"),
            t,
            topology="ps",
            server_compressor=gradcomp.make("topk", density=0.1, error_feedback=True),
        )
        outs = [ex.exchange(SLOTS, grads(t.rank, s), s) for s in range(steps)]
        return outs, ex.server_compressor.state_dict()["residuals"]

    results = cluster.run(fn)
    for s in range(steps):
        assert_identical_on_all_workers([outs[s] for outs, _ in results])
    assert len(results[0][1]) == len(SLOTS)  # root keeps residuals
    assert all(len(res) == 0 for _, res in results[1:])  # the other workers' server role is idle
    for i in range(len(SLOTS)):
        sent = sum(results[0][0][s][i] for s in range(steps))
        averages = sum(rank_order_mean([grads(r, s)[i] for r in range(W)]) for s in range(steps))
        residual = next(v for k, v in results[0][1].items() if k.startswith(f"{SLOTS[i].name}#"))
        torch.testing.assert_close(sent + residual, averages, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("topology", ["auto", "allgather", "ps"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_raises_before_sending(cluster, topology, bad_value):
    bad_rank, bad_slot = 2, 1

    def inputs(rank, step):
        xs = grads(rank, step)
        if rank == bad_rank:
            xs[bad_slot][5] = bad_value
        return xs

    with pytest.raises(NonFiniteGradientError) as info:
        run_exchange(cluster, lambda: gradcomp.make("topk", density=0.1), inputs=inputs, topology=topology)
    assert SLOTS[bad_slot].name in str(info.value)
    for other in SLOTS:
        if other is not SLOTS[bad_slot]:
            assert other.name not in str(info.value)
    assert cluster.transports[bad_rank].counter == ByteCounter()  # not one byte, not one collective
    # the cluster is usable afterwards
    (results,) = run_exchange(cluster, lambda: gradcomp.make("none"))
    assert_identical_on_all_workers(results)


def test_non_finite_gradient_names_the_parameter_with_model_granularity(cluster):
    def fn(t):
        params = [(f"block{i}.w", nn.Parameter(torch.zeros(n))) for i, n in enumerate(SIZES)]
        for (_, p), g in zip(params, grads(t.rank)):
            p.grad = g.clone()
        if t.rank == 3:
            params[2][1].grad[0] = float("nan")
        try:
            GradientAggregator(params, gradcomp.make("none"), t, granularity="model").step()
        except NonFiniteGradientError as exc:
            return str(exc)

    # every worker raises at the same step (they agree on the step's first message); the one that holds the NaN
    # names the parameter
    messages = cluster.run(fn)
    assert all(m is not None and "exchange 0" in m for m in messages), messages
    assert "block2.w" in messages[3] and not any("block2.w" in m for m in messages[:3])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_tensor_raises_config_error(cluster, dtype):
    def inputs(rank, step):
        xs = grads(rank, step)
        xs[0] = torch.ones(SIZES[0], dtype=dtype)
        return xs

    with pytest.raises(ConfigError, match=SLOTS[0].name):
        run_exchange(cluster, lambda: gradcomp.make("none"), inputs=inputs)
    assert all(t.counter == ByteCounter() for t in cluster.transports)


def test_size_mismatch_raises_config_error(cluster):
    with pytest.raises(ConfigError):
        run_exchange(cluster, lambda: gradcomp.make("none"), inputs=lambda r, s: grads(r, s, sizes=[2, 37, 300, 64]))
    with pytest.raises(ConfigError):
        run_exchange(cluster, lambda: gradcomp.make("none"), inputs=lambda r, s: grads(r, s)[:3])


def test_bad_exchange_configuration_raises(cluster):
    t = cluster.transports[0]
    with pytest.raises(ConfigError):
        GradientExchange(gradcomp.make("none"), t, topology="ring")
    with pytest.raises(ConfigError):
        GradientExchange(gradcomp.make("topk"), t, topology="allreduce")
    with pytest.raises(ConfigError):
        GradientExchange(gradcomp.make("threshold"), t, topology="allreduce")
    with pytest.raises(ConfigError):
        GradientExchange(gradcomp.make("none"), t, server_compressor=gradcomp.make("topk"))
    with pytest.raises(ConfigError):
        GradientExchange(gradcomp.make("none"), t, topology="ps", root=W)
    with pytest.raises(ConfigError):
        GradientExchange(gradcomp.make("none"), t, topology="ps", root=-1)
    assert GradientExchange(gradcomp.make("topk"), t).topology == "allgather"
    assert GradientExchange(gradcomp.make("randomk"), t).topology == "allreduce"
    assert GradientExchange(gradcomp.make("fp16", error_feedback=True), t).topology == "allreduce"


def test_fp16_allreduce_of_large_finite_values_stays_finite(cluster):
    slots = [Slot("w", 0, 2)]
    (results,) = run_exchange(
        cluster, lambda: gradcomp.make("fp16"), slots=slots, inputs=lambda r, s: [torch.tensor([40000.0, -1.0])]
    )
    assert torch.isfinite(results[0][0]).all()
    torch.testing.assert_close(results[0][0], torch.tensor([40000.0, -1.0]))


# ----------------------------------------------------------------------------------------------- aggregator


def _aggregate(cluster, granularity, name="none", steps=2, **params):
    def fn(t):
        torch.manual_seed(0)  # same initial model on every worker
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        agg = GradientAggregator(model, gradcomp.make(name, **params), t, granularity=granularity)
        seen, got = [], []
        for step in range(steps):
            g = torch.Generator().manual_seed(10 * t.rank + step)
            model.zero_grad()
            model(torch.randn(8, 6, generator=g)).pow(2).sum().backward()
            seen.append([p.grad.clone() for p in model.parameters()])
            agg.step()
            got.append([p.grad.clone() for p in model.parameters()])
        return seen, got, agg.steps

    return cluster.run(fn)


def test_aggregator_layer_and_model_granularity_agree_for_none(cluster):
    layer = _aggregate(cluster, "layer")
    model = _aggregate(cluster, "model")
    for step in range(2):
        true_means = [
            torch.stack([layer[r][0][step][j] for r in range(W)]).mean(0) for j in range(len(layer[0][0][step]))
        ]
        for r in range(W):
            assert layer[r][2] == 2 and model[r][2] == 2
            for j, mean in enumerate(true_means):
                assert layer[r][1][step][j].shape == mean.shape
                torch.testing.assert_close(layer[r][1][step][j], model[r][1][step][j], rtol=0, atol=0)
                torch.testing.assert_close(layer[r][1][step][j], mean, rtol=1e-6, atol=1e-6)
    # both saw the same local gradients, so the comparison is meaningful
    for r in range(W):
        for a, b in zip(layer[r][0][0], model[r][0][0]):
            assert torch.equal(a, b)


def test_aggregator_model_granularity_topk_is_global(cluster):
    results = _aggregate(cluster, "model", "topk", steps=1, density=0.1)
    seen = [torch.cat([g.reshape(-1) for g in results[r][0][0]]) for r in range(W)]
    n = seen[0].numel()
    k = -(-n // 10)
    sparsified = []
    for x in seen:
        keep = torch.argsort(x.abs(), descending=True)[:k]
        dense = torch.zeros(n)
        dense[keep] = x[keep]
        sparsified.append(dense)
    got = torch.cat([g.reshape(-1) for g in results[0][1][0]])
    torch.testing.assert_close(got, rank_order_mean(sparsified), rtol=1e-6, atol=1e-7)


def test_aggregator_parameter_without_grad_contributes_zeros(cluster):
    def fn(t):
        a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
        a.grad = torch.full((3,), float(t.rank + 1))
        if t.rank == 0:
            b.grad = torch.full((2,), 4.0)
        GradientAggregator([("a", a), ("b", b)], gradcomp.make("none"), t).step()
        return a.grad.clone(), b.grad.clone()

    for a, b in cluster.run(fn):
        assert torch.equal(a, torch.full((3,), 2.5))
        assert torch.equal(b, torch.full((2,), 1.0))


@pytest.mark.parametrize("granularity", ["layer", "model"])
def test_none_allreduce_counts_four_bytes_per_element(cluster, granularity):
    steps = 3
    _aggregate(cluster, granularity, steps=steps)
    numel = 6 * 5 + 5 + 5 * 3 + 3
    for t in cluster.transports:
        c = t.counter
        assert c.up_payload == steps * 4 * numel
        assert c.down_payload == steps * 4 * numel
        assert c.up_padding == c.down_padding == c.up_control == c.down_control == 0
        assert c.server_in == c.server_out == 0
        assert c.collectives == steps  # one allreduce per step, whatever the number of layers


def test_aggregator_bad_arguments(cluster):
    t = cluster.transports[0]
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError):
        GradientAggregator(model, gradcomp.make("none"), t, granularity="bucket")
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError):
        GradientAggregator(frozen, gradcomp.make("none"), t)
    agg = GradientAggregator(model, gradcomp.make("none"), t)
    with pytest.raises(ConfigError):
        agg.aggregate([torch.zeros(2, 2)])


@pytest.mark.parametrize("name", ["none", "fp16", "topk", "randomk", "threshold"])
@pytest.mark.parametrize("topology", ["auto", "allgather", "ps"])
def test_zero_element_slot(cluster, name, topology):
    slots = [Slot("empty", 0, 0), Slot("w", 1, 5)]

    def inputs(rank, step):
        return [torch.zeros(0), torch.arange(5, dtype=torch.float32) * (rank + 1)]

    (results,) = run_exchange(
        cluster,
        lambda: gradcomp.make(name, density=1.0) if name in ("topk", "randomk") else gradcomp.make(name),
        slots=slots,
        inputs=inputs,
        topology=topology,
    )
    assert_identical_on_all_workers(results)
    assert results[0][0].shape == (0,)
    torch.testing.assert_close(results[0][1], torch.arange(5, dtype=torch.float32) * 2.5)


def test_exchange_of_no_slots_returns_an_empty_list(cluster):
    (results,) = run_exchange(cluster, lambda: gradcomp.make("none"), slots=[], inputs=lambda r, s: [])
    assert results == [[]] * W


def test_a_counter_prints_with_units_and_against_fp32(cluster):
    run_exchange(cluster, lambda: gradcomp.make("topk", density=0.1))
    counter = cluster.transports[0].counter
    text = str(counter)
    assert "ByteCounter(" not in text and text == counter.report()
    assert f"sent      {counter.bytes_up} B (payload {counter.up_payload} B + control {counter.up_control} B)" in text
    assert "received  " in text and "padding   " in text and "collectives" in text
    fp32 = 4 * sum(SIZES)  # what the dense all-reduce hands over in this one step
    assert f"x{fp32 / counter.bytes_up:,.1f} fewer than fp32 ({fp32 / 1e3:.2f} kB)" in counter.report(fp32_bytes=fp32)
    assert "more than fp32" in counter.report(fp32_bytes=counter.bytes_up // 2)
    big = ByteCounter(up_payload=13_400, down_payload=2_100_000)
    assert "sent      13.40 kB" in str(big) and "received  2.10 MB" in str(big)
