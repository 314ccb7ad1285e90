"""Sketched SGD (schemes/sketch.py) and its count sketch (compressors/countsketch.py): linearity, heavy-hitter
recovery, identical candidates on every worker, bytes per step, momentum/error zeroing, bad parameters, state."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

import gradcomp
from gradcomp.compressors.base import Slot
from gradcomp.compressors.countsketch import CountSketch
from gradcomp.errors import ConfigError
from gradcomp.schemes.sketch import SketchedSGD
from gradcomp.train.exchange import GradientExchange, build_scheme
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES


def framed(sections: int) -> int:
    """Bytes a container message adds to its sections' data (the parameter server's messages are framed)."""
    return HEADER_BYTES + sections * SECTION_HEADER_BYTES

WORLD = 4


def randn(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def planted(d, heavy, magnitude, seed):
    """Shared heavy coordinates (positions, values) for a planted-signal test."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randperm(d, generator=gen)[:heavy]
    signs = torch.randint(0, 2, (heavy,), generator=gen).float().mul(2).sub(1)
    return pos, signs * magnitude


def run_cluster(world, make_scheme, slots, grads_for, steps):
    """Every worker exchanges grads_for(rank, step); per worker, per step: (outputs, selection, state, bytes)."""

    def worker(t):
        scheme = make_scheme()
        ex = GradientExchange(scheme, t)
        history = []
        for step in steps:
            before = t.counter.snapshot()
            out = ex.exchange(slots, grads_for(t.rank, step), step)
            after = t.counter
            counts = (
                after.collectives - before.collectives,
                after.ops.get("all_reduce", [0, 0])[0] - before.ops.get("all_reduce", [0, 0])[0],
                after.up_payload - before.up_payload,
                after.down_payload - before.down_payload,
            )
            selection = {k: (c.clone(), s.clone()) for k, (c, s) in getattr(scheme, "last_selection", {}).items()}
            history.append(([o.clone() for o in out], selection, scheme.state_dict(), counts))
        return history

    with gradcomp.SimulatedCluster(world, timeout=60) as cluster:
        return cluster.run(worker)


# -- the count sketch --------------------------------------------------------------------------------------------


def test_count_sketch_is_linear():
    cs = CountSketch(5000, rows=5, cols=300, seed=3, index=1)
    xs = [randn(5000, seed=i) for i in range(4)]
    total = sum(cs.sketch(x) for x in xs)
    assert torch.allclose(total, cs.sketch(sum(xs)), rtol=0, atol=1e-4)
    assert torch.allclose(cs.sketch(2.5 * xs[0]), 2.5 * cs.sketch(xs[0]), rtol=1e-6, atol=1e-5)
    # every coordinate lands once in every row, with its sign: the rows' sums of sign·x agree
    table = cs.sketch(xs[0]).view(5, 300)
    assert torch.allclose(table.sum(dim=1), (cs.signs * xs[0]).sum(dim=1), atol=1e-3)


def test_count_sketch_tables_come_from_the_seed():
    a, b = CountSketch(1000, 3, 50, seed=7, index=2), CountSketch(1000, 3, 50, seed=7, index=2)
    assert torch.equal(a.positions, b.positions) and torch.equal(a.signs, b.signs)
    c = CountSketch(1000, 3, 50, seed=7, index=3)
    assert not torch.equal(a.positions, c.positions)
    assert set(a.signs.unique().tolist()) == {-1.0, 1.0}
    rows = (a.positions.view(3, 1000) // 50).to(torch.int64)
    assert torch.equal(rows, torch.arange(3).unsqueeze(1).expand(3, 1000))


def test_count_sketch_estimates_a_heavy_coordinate_and_a_sparse_vector_exactly():
    cs = CountSketch(2000, rows=5, cols=400, seed=0, index=0)
    x = torch.zeros(2000)
    x[[3, 99, 1500]] = torch.tensor([5.0, -2.0, 7.0])
    assert torch.allclose(cs.estimate(cs.sketch(x)), x)  # 3 coordinates rarely collide in 3 of 5 rows


# -- the algorithm ------------------------------------------------------------------------------------------------


def test_planted_heavy_coordinates_are_recovered_exactly_with_the_default_sizes():
    d = 20_000
    k = SketchedSGD().plan(Slot("w", 0, d)).k
    assert k == 200
    pos, values = planted(d, k, 20.0, seed=1)
    slots = [Slot("w", 0, d)]

    def grads(rank, step):
        g = randn(d, seed=100 + rank)
        g[pos] += values
        return [g]

    runs = run_cluster(WORLD, SketchedSGD, slots, grads, [0])
    out = runs[0][0][0][0]
    assert set(torch.nonzero(out).reshape(-1).tolist()) == set(pos.tolist())
    mean = sum(grads(r, 0)[0] for r in range(WORLD)) / WORLD
    assert torch.allclose(out[pos], mean[pos], atol=1e-5)  # the exact mean at the selected coordinates
    for history in runs[1:]:
        assert torch.equal(history[0][0][0], out)


def test_one_round_takes_the_sketch_estimates_of_the_heavy_coordinates():
    # with rounds=1 a light coordinate that shares buckets with heavy ones in 3 of 5 rows looks heavy (about
    # 1 % of them when k heavy coordinates fill 10 % of every row): round 2 is what removes those; here
    # fewer heavy coordinates than k are planted and must all be among the k sent
    d = 20_000
    pos, values = planted(d, 20, 20.0, seed=2)
    slots = [Slot("w", 0, d)]

    def grads(rank, step):
        g = randn(d, seed=200 + rank)
        g[pos] += values
        return [g]

    runs = run_cluster(WORLD, lambda: SketchedSGD(rounds=1), slots, grads, [0])
    out = runs[0][0][0][0]
    support = set(torch.nonzero(out).reshape(-1).tolist())
    assert len(support) == 200 and set(pos.tolist()) <= support
    mean = sum(grads(r, 0)[0] for r in range(WORLD)) / WORLD
    assert torch.allclose(out[pos], mean[pos], atol=3.0)  # estimates, not exact values
    for history in runs[1:]:
        assert torch.equal(history[0][0][0], out)


def test_candidates_are_identical_on_every_worker():
    slots = [Slot("a", 0, 4000), Slot("b", 1, 3000, (30, 100)), Slot("bias", 2, 50)]

    def grads(rank, step):
        return [randn(s.numel, seed=1000 * step + 10 * rank + s.index) for s in slots]

    runs = run_cluster(WORLD, lambda: SketchedSGD(density=0.02, seed=5), slots, grads, range(3))
    for step in range(3):
        ref_out, ref_sel, _, _ = runs[0][step]
        assert set(ref_sel) == {"a", "b"}
        for name, (cand, chosen) in ref_sel.items():
            k = 80 if name == "a" else 60
            assert cand.numel() == 10 * k and chosen.numel() == k
            assert len(set(cand.tolist())) == cand.numel()
            assert set(chosen.tolist()) <= set(cand.tolist())
        for history in runs[1:]:
            out, sel, _, _ = history[step]
            for o, r in zip(out, ref_out):
                assert torch.equal(o, r)
            for name, (cand, chosen) in sel.items():
                assert torch.equal(cand, ref_sel[name][0]) and torch.equal(chosen, ref_sel[name][1])


def test_two_allreduces_with_the_formula_bytes_per_step():
    slots = [Slot("a", 0, 4000), Slot("b", 1, 3000, (30, 100)), Slot("bias", 2, 50), Slot("c", 3, 1200)]
    rows, cols, p, k = 4, 100, 3, 20
    sketch_elems = 3 * rows * cols
    dense = 50
    round2 = 3 * p * k

    def grads(rank, step):
        return [randn(s.numel, seed=1000 * step + 10 * rank + s.index) for s in slots]

    def make():
        return gradcomp.make("sketch", k=k, rows=rows, cols=cols, candidates=p)

    for history in run_cluster(WORLD, make, slots, grads, range(3)):
        for _, _, _, counts in history:
            assert counts == (2, 2, 4 * (sketch_elems + dense) + 4 * round2, 4 * (sketch_elems + dense) + 4 * round2)
    # one round with rounds=1
    for history in run_cluster(2, lambda: SketchedSGD(k=k, rows=rows, cols=cols, rounds=1), slots, grads, [0]):
        assert history[0][3] == (1, 1, 4 * (sketch_elems + dense), 4 * (sketch_elems + dense))
    # uncompressed slots are exact means; P·k is capped at d
    slots2 = [Slot("bias", 0, 50), Slot("w", 1, 1000)]

    def grads2(rank, step):
        return [randn(s.numel, seed=10 * rank + s.index) for s in slots2]

    runs = run_cluster(2, lambda: SketchedSGD(k=300, cols=10, momentum=0.0), slots2, grads2, [0])
    assert runs[0][0][3] == (1, 1, 4 * (50 + 1000), 4 * (50 + 1000))  # P·k >= d: v whole, no sketch, no round 2
    mean = (grads2(0, 0)[0] + grads2(1, 0)[0]) / 2
    assert torch.allclose(runs[0][0][0][0], mean, atol=1e-6)


def test_momentum_and_error_are_zeroed_where_sent_and_kept_elsewhere():
    d, k, rho = 2000, 20, 0.5
    slots = [Slot("w", 0, d), Slot("bias", 1, 10)]

    def grads(rank, step):
        return [randn(d, seed=10 * step + rank), randn(10, seed=500 + 10 * step + rank)]

    runs = run_cluster(2, lambda: SketchedSGD(k=k, momentum=rho), slots, grads, range(3))
    for rank, history in enumerate(runs):
        u = torch.zeros(d)
        v = torch.zeros(d)
        u_bias = torch.zeros(10)
        for step, (out, sel, state, _) in enumerate(history):
            g = grads(rank, step)
            u = rho * u + g[0]
            v = v + u
            u_bias = rho * u_bias + g[1]
            _, chosen = sel["w"]
            sent = torch.zeros(d, dtype=torch.bool)
            sent[chosen] = True
            assert torch.equal(torch.nonzero(out[0]).reshape(-1).sort().values, chosen.sort().values)
            assert torch.all(state["momentum"]["w#2000"][sent] == 0) and torch.all(state["error"]["w#2000"][sent] == 0)
            assert torch.allclose(state["momentum"]["w#2000"][~sent], u[~sent], atol=1e-5)
            assert torch.allclose(state["error"]["w#2000"][~sent], v[~sent], atol=1e-5)
            assert torch.allclose(state["momentum"]["bias#10"], u_bias, atol=1e-6)
            assert "bias#10" not in state["error"]
            u[sent] = 0
            v[sent] = 0
    # the update is the mean of the workers' v at the sent coordinates: step 0, v = u = g
    _, chosen = runs[0][0][1]["w"]
    mean = (grads(0, 0)[0] + grads(1, 0)[0]) / 2
    assert torch.allclose(runs[0][0][0][0][chosen], mean[chosen], atol=1e-6)
    # and they are the k largest |mean| among the candidates
    cand = runs[0][0][1]["w"][0]
    assert set(chosen.tolist()) == set(cand[mean[cand].abs().argsort(descending=True)[:k]].tolist())


@pytest.mark.parametrize(("rounds", "topology"), [(2, "allreduce"), (2, "ps"), (1, "allreduce"), (1, "ps")])
def test_momentum_and_error_stay_where_the_selected_sum_is_exactly_zero(rounds, topology):
    # SPEC 5: u and v are zeroed at g̃'s nonzero positions. Coordinate 5 holds +3 on worker 0 and -3 on
    # worker 1: their sum (and its sketch, bucket by bucket) is exactly 0, every other coordinate but 2 is 0,
    # so the k = 10 selected are 0..9 (ties to the lower index) and only coordinate 2 carries an update.
    d, k, rho = 1000, 10, 0.5
    slots = [Slot("w", 0, d)]

    def grads(rank, step):
        g = torch.zeros(d)
        g[5] = 3.0 if rank == 0 else -3.0
        g[2] = 1.0
        return [g]

    def make():
        return build_scheme(SketchedSGD(k=k, rounds=rounds, momentum=rho), topology=topology)

    for rank, history in enumerate(run_cluster(2, make, slots, grads, [0])):
        out, sel, state, _ = history[0]
        assert sorted(sel["w"][1].tolist()) == list(range(10))
        assert out[0].nonzero().reshape(-1).tolist() == [2] and out[0][2] == 1.0
        u, v = state["momentum"]["w#1000"], state["error"]["w#1000"]
        assert u[2] == 0 and v[2] == 0
        assert u[5] == grads(rank, 0)[0][5] and v[5] == grads(rank, 0)[0][5]  # selected, nothing applied: kept


def test_momentum_kept_at_a_selected_zero_reaches_a_later_update():
    # one worker, rho = 0.5; coordinate 5: g = 2 (not selected: ten coordinates of 100 win), then -3 (v = 0
    # exactly, selected among ties at 0, u = -2), then 0: u = -1, v = -1 goes out. Zeroing u at every selected
    # coordinate sent 0 at step 2 instead.
    d, k = 1000, 10
    slots = [Slot("w", 0, d)]

    def grads(rank, step):
        g = torch.zeros(d)
        if step == 0:
            g[100:110] = 100.0
            g[5] = 2.0
        if step == 1:
            g[5] = -3.0
        return [g]

    history = run_cluster(1, lambda: SketchedSGD(k=k, momentum=0.5), slots, grads, range(3))[0]
    assert 5 in history[1][1]["w"][1].tolist() and history[1][0][0][5] == 0
    assert history[1][2]["momentum"]["w#1000"][5] == -2.0 and history[1][2]["error"]["w#1000"][5] == 0
    assert history[2][0][0][5] == -1.0


def test_tensors_too_small_for_a_sketch_go_dense():
    # with min_size below 2·rows, a tensor of d < 2·rows coordinates has no sketch of at most ⌊d / (2·rows)⌋ = 0
    # columns: it goes dense (momentum SGD on the mean), as tensors under min_size do
    sizes = (1, 3, 7, 9, 10)
    slots = [Slot(f"t{d}", i, d) for i, d in enumerate(sizes)]
    scheme = SketchedSGD(min_size=0, candidates=2, momentum=0.9)
    plans = [scheme.plan(s) for s in slots]
    assert [p.compressed for p in plans] == [False, False, False, False, True]
    assert (plans[-1].cols, plans[-1].candidates, plans[-1].whole) == (1, 2, False)
    scheme.check_slots(slots)
    with pytest.raises(ConfigError, match="larger than the 3"):  # a cols given explicitly is still checked
        SketchedSGD(min_size=0, cols=1).plan(slots[1])

    def grads(rank, step):
        return [randn(s.numel, seed=100 * step + 10 * rank + s.index) for s in slots]

    runs = run_cluster(2, lambda: SketchedSGD(min_size=0, candidates=2, momentum=0.9), slots, grads, range(2))
    u = [torch.zeros(d) for d in sizes[:4]]
    for step in range(2):
        for i in range(4):
            u[i] = 0.9 * u[i] + (grads(0, step)[i] + grads(1, step)[i]) / 2
        for history in runs:
            out, _, state, counts = history[step]
            assert counts == (2, 2, 4 * (1 + 3 + 7 + 9 + 5 + 2), 4 * (1 + 3 + 7 + 9 + 5 + 2))
            for i in range(4):
                torch.testing.assert_close(out[i], u[i], rtol=0, atol=1e-6)
            assert set(state["error"]) == {"t10#10"}


@pytest.mark.parametrize("topology", ["allreduce", "ps"])
def test_every_coordinate_a_candidate_sends_v_instead_of_a_sketch(topology):
    # w: P·k = 2000 >= d = 1500, so round 2 would read every coordinate: w sends v in round 1 and takes the
    # true top k at once; a (P·k = 2000 < 4000) is sketched as before
    w, a, bias = Slot("w", 0, 1500), Slot("a", 1, 4000), Slot("bias", 2, 30)
    k, rows, cols, p = 200, 2, 100, 10

    def grads(rank, step):
        return [randn(s.numel, seed=1000 * step + 10 * rank + s.index) for s in (w, a, bias)]

    def grads_of(*which):
        return lambda rank, step: [grads(rank, step)[s.index] for s in which]

    def sketch():
        return build_scheme(SketchedSGD(k=k, rows=rows, cols=cols, candidates=p, momentum=0.7), topology=topology)

    mixed = run_cluster(3, sketch, [w, a, bias], grads, range(4))
    alone = run_cluster(3, sketch, [a, bias], grads_of(a, bias), range(4))
    true = run_cluster(3, lambda: gradcomp.make("true_topk", k=k, momentum=0.7), [w, bias], grads_of(w, bias), range(4))
    only_w = run_cluster(3, sketch, [w, bias], grads_of(w, bias), range(4))
    if topology == "allreduce":
        up = down = 4 * (1500 + rows * cols + 30) + 4 * p * k
        collectives = 2
    else:  # no candidates are broadcast for w: k values and positions come down, as for a; four framed messages
        up = 4 * (1500 + rows * cols + 30) + 4 * p * k + 2 * framed(1)
        down = 4 * p * k + 4 * 30 + 8 * 2 * k + framed(1) + framed(2)
        collectives = 4
    for rank in range(3):
        for step in range(4):
            out, sel, state, counts = mixed[rank][step]
            assert counts[0] == collectives and counts[2:] == (up, down)
            assert torch.equal(sel["w"][0], torch.arange(1500))
            assert torch.equal(out[0], true[rank][step][0][0])  # the true top k, bit for bit
            assert torch.equal(out[1], alone[rank][step][0][0]) and torch.equal(out[2], alone[rank][step][0][1])
            assert torch.equal(state["error"]["w#1500"], true[rank][step][2]["error"]["w#1500"])
            # with no sketched slot, sketch costs what true top-k does: one allreduce of v and the dense u
            counts = only_w[rank][step][3]
            if topology == "allreduce":
                assert counts == true[rank][step][3] == (1, 1, 4 * 1530, 4 * 1530)
            else:
                assert counts[0] == 2 and counts[2:] == (4 * 1530 + framed(1), 4 * 30 + 8 * k + framed(2))
            assert torch.equal(only_w[rank][step][0][0], out[0])


# -- construction and state ----------------------------------------------------------------------------------------


def test_registered_and_owns_momentum():
    scheme = gradcomp.make("sketch", k=50, rows=3)
    assert isinstance(scheme, SketchedSGD) and scheme.owns_momentum
    assert scheme.params()["k"] == 50 and scheme.params()["rows"] == 3
    assert gradcomp.make("sketch").params()["density"] == 0.01


@pytest.mark.parametrize(
    "params",
    [
        {"rows": 0},
        {"cols": 0},
        {"candidates": 0},
        {"k": 0},
        {"k": 5, "density": 0.1},
        {"density": 0.0},
        {"density": 1.5},
        {"momentum": 1.0},
        {"momentum": -0.1},
        {"rounds": 3},
        {"rounds": 0},
        {"seed": -1},
        {"min_size": -1},
        {"rows": 2.0},
        {"k": True},
    ],
)
def test_bad_parameters_raise_config_error(params):
    with pytest.raises(ConfigError):
        gradcomp.make("sketch", **params)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"k": 2001}, "larger than its"),
        ({"rows": 5, "cols": 401}, "larger than the"),
        ({"k": 10, "cols": 500}, "sketch"),
    ],
)
def test_sizes_that_cannot_work_raise_before_sending(params, match):
    slots = [Slot("w", 0, 2000)]

    def worker(t):
        ex = GradientExchange(SketchedSGD(**params), t)
        sent = t.counter.collectives
        with pytest.raises(ConfigError, match=match):
            ex.exchange(slots, [torch.zeros(2000)], 0)
        return t.counter.collectives - sent

    with gradcomp.SimulatedCluster(1) as cluster:
        assert cluster.run(worker) == [0]


def test_state_round_trip_and_retain():
    slots = [Slot("a", 0, 3000), Slot("bias", 1, 20)]
    grads = [randn(3000, seed=1), randn(20, seed=2)]
    scheme = SketchedSGD(density=0.01)
    with gradcomp.SimulatedCluster(1) as cluster:
        cluster.run(lambda t: GradientExchange(scheme, t).exchange(slots, grads, 0))
    state = scheme.state_dict()
    assert set(state["momentum"]) == {"a#3000", "bias#20"} and set(state["error"]) == {"a#3000"}
    other = SketchedSGD(density=0.01)
    other.load_state_dict(state)
    for part in ("momentum", "error"):
        for key, value in state[part].items():
            assert torch.equal(other.state_dict()[part][key], value)
    state["error"]["a#3000"].add_(1.0)  # a copy, not the live buffer
    assert not torch.equal(scheme.state_dict()["error"]["a#3000"], state["error"]["a#3000"])

    # the loaded scheme continues exactly like the original
    nxt = [randn(3000, seed=3), randn(20, seed=4)]
    with gradcomp.SimulatedCluster(1) as cluster:
        a = cluster.run(lambda t: GradientExchange(scheme, t).exchange(slots, nxt, 1))[0]
    with gradcomp.SimulatedCluster(1) as cluster:
        b = cluster.run(lambda t: GradientExchange(other, t).exchange(slots, nxt, 1))[0]
    for x, y in zip(a, b):
        assert torch.equal(x, y)

    scheme.retain([slots[1]])
    kept = scheme.state_dict()
    assert set(kept["momentum"]) == {"bias#20"} and kept["error"] == {}
    scheme.retain([])
    assert scheme.state_dict() == {"momentum": {}, "error": {}}


def test_bad_state_raises_config_error():
    with pytest.raises(ConfigError, match="keys"):
        SketchedSGD().load_state_dict({"residuals": {}})
    with pytest.raises(ConfigError, match="key"):
        SketchedSGD().load_state_dict({"error": {"w": torch.zeros(3)}})
    with pytest.raises(ConfigError, match=r"expected \(10,\)"):
        SketchedSGD().load_state_dict({"momentum": {"w#10": torch.zeros(3)}})
    scheme = SketchedSGD()
    scheme.load_state_dict({"momentum": {"w#10": torch.ones(10)}})
    with pytest.raises(ConfigError, match="float32"):  # refused as a whole: what was loaded before stays
        scheme.load_state_dict({"momentum": {"v#4": torch.ones(4)}, "error": {"w#10": torch.ones(10).double()}})
    state = scheme.state_dict()
    assert set(state["momentum"]) == {"w#10"} and state["error"] == {}
    assert torch.equal(state["momentum"]["w#10"], torch.ones(10))
    with pytest.raises(ConfigError, match="tensor"):
        SketchedSGD().load_state_dict({"momentum": {"w#10": [0.0] * 10}})


# -- the median and the selection ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 10, 11])
def test_estimate_is_the_lower_median_over_rows(rows):
    cs = CountSketch(3000, rows=rows, cols=64, seed=1, index=0)
    table = randn(rows * 64, seed=rows)
    per_row = table[cs.positions.long()].view(rows, 3000) * cs.signs
    assert torch.equal(cs.estimate(table), per_row.median(dim=0).values)


def test_largest_is_the_stable_sort_cut_with_ties_to_the_lower_index():
    from gradcomp.schemes.accumulation import largest

    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, 0.5, -2.0])
    assert largest(x, 2).tolist() == [1, 3]
    assert largest(x, 3).tolist() == [1, 3, 2]  # three |x| = 2 tie: the lowest index goes
    assert sorted(largest(x, 5).tolist()) == [1, 2, 3, 4, 5]
    assert largest(x, 8).tolist() == list(range(8)) and largest(x, 20).tolist() == list(range(8))
    y = torch.randint(-5, 6, (5000,), generator=torch.Generator().manual_seed(0)).float()  # many ties
    for n in (1, 17, 999, 2500):
        ref = torch.sort(y.abs(), descending=True, stable=True).indices[:n]
        assert set(largest(y, n).tolist()) == set(ref.tolist())


# -- one round: error accumulation of estimates -------------------------------------------------------------------


def test_one_round_subtracts_the_applied_estimate_from_the_error_and_zeroes_momentum():
    d, k = 3000, 30
    slots = [Slot("w", 0, d)]

    def grads(rank, step):
        return [randn(d, seed=50 * step + rank)]

    runs = run_cluster(2, lambda: SketchedSGD(k=k, rows=3, cols=100, rounds=1, momentum=0.5), slots, grads, range(2))
    for rank, history in enumerate(runs):
        u = torch.zeros(d)
        v = torch.zeros(d)
        for step, (out, sel, state, _) in enumerate(history):
            u = 0.5 * u + grads(rank, step)[0]
            v = v + u
            _, chosen = sel["w"]
            assert chosen.numel() == k and torch.equal(out[0].nonzero().reshape(-1).sort().values, chosen.sort().values)
            v[chosen] -= out[0][chosen]  # the applied mean estimate leaves every worker's v
            u[chosen] = 0
            assert torch.allclose(state["error"]["w#3000"], v, atol=1e-5)
            assert torch.allclose(state["momentum"]["w#3000"], u, atol=1e-6)
            assert not torch.all(state["error"]["w#3000"][chosen] == 0)  # estimates are not exact values


# -- the parameter-server topology -------------------------------------------------------------------------------


def _ps_slots():
    return [Slot("a", 0, 4000), Slot("b", 1, 3000, (30, 100)), Slot("bias", 2, 50)]


def _ps_grads(rank, step):
    return [randn(s.numel, seed=1000 * step + 10 * rank + s.index) for s in _ps_slots()]


@pytest.mark.parametrize("rounds", [1, 2])
def test_parameter_server_selects_like_the_allreduce_and_counts_its_bytes(rounds):
    slots, k, rows, cols, p = _ps_slots(), 20, 3, 200, 4

    def make(topology):
        def build():
            scheme = SketchedSGD(k=k, rows=rows, cols=cols, candidates=p, rounds=rounds, seed=3)
            return build_scheme(scheme, topology=topology, root=1)

        return build

    ps = run_cluster(WORLD, make("ps"), slots, _ps_grads, range(3))
    ar = run_cluster(WORLD, make("auto"), slots, _ps_grads, range(3))
    sketch, dense = 2 * rows * cols, 50
    up = 4 * (sketch + dense) + framed(1) + (4 * 2 * p * k + framed(1) if rounds == 2 else 0)
    down = 4 * dense + 8 * 2 * k + framed(2) + (4 * 2 * p * k + framed(1) if rounds == 2 else 0)
    collectives = 4 if rounds == 2 else 2
    for step in range(3):
        ref_out, ref_sel, _, _ = ar[0][step]
        for rank in range(WORLD):
            out, sel, state, counts = ps[rank][step]
            assert counts[0] == collectives and counts[2:] == (up, down)
            for name in ("a", "b"):
                assert set(sel[name][1].tolist()) == set(ref_sel[name][1].tolist())
            for o, r in zip(out, ref_out):  # the same update up to the order of the sums
                torch.testing.assert_close(o, r, rtol=0, atol=1e-6)
            for o, r in zip(out, ps[0][step][0]):  # identical on every worker
                assert torch.equal(o, r)


def test_topologies_a_scheme_can_take():
    assert build_scheme(SketchedSGD(), topology="ps").topology == "ps"
    assert build_scheme(SketchedSGD(), topology="allreduce").topology == "allreduce"
    for topology in ("allgather", "sharded"):
        with pytest.raises(ConfigError, match="runs over allreduce, ps"):
            build_scheme(SketchedSGD(), topology=topology)
    with pytest.raises(ConfigError, match="no topology"):
        build_scheme(gradcomp.make("powersgd"), topology="ps")
    scheme = build_scheme(SketchedSGD(), topology="ps", root=4)
    with pytest.raises(ConfigError, match="root 4"):
        scheme.bind(0, 4)


# -- real gloo workers -------------------------------------------------------------------------------------------


GLOO_SLOTS = [Slot("a", 0, 4000), Slot("b", 1, 3000, (30, 100)), Slot("bias", 2, 50)]
GLOO_STEPS = 4


def _candidates_worker(rank: int, world_size: int, topology: str) -> list:
    from gradcomp.transport.dist import DistTransport

    scheme = build_scheme(SketchedSGD(density=0.02, seed=5), topology=topology)
    ex = GradientExchange(scheme, DistTransport())
    history = []
    for step in range(GLOO_STEPS):
        grads = [randn(s.numel, seed=1000 * step + 10 * rank + s.index) for s in GLOO_SLOTS]
        out = ex.exchange(GLOO_SLOTS, grads, step)
        history.append(({k: (c.clone(), s.clone()) for k, (c, s) in scheme.last_selection.items()}, out))
    return history


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["allreduce", "ps"])
def test_candidates_are_identical_on_4_gloo_workers_and_on_the_simulated_cluster(single_thread, topology):
    real = run_workers(_candidates_worker, WORLD, topology, timeout=240)

    def sim_grads(rank, step):
        return [randn(s.numel, seed=1000 * step + 10 * rank + s.index) for s in GLOO_SLOTS]

    sim = run_cluster(
        WORLD,
        lambda: build_scheme(SketchedSGD(density=0.02, seed=5), topology=topology),
        GLOO_SLOTS,
        sim_grads,
        range(GLOO_STEPS),
    )
    for step in range(GLOO_STEPS):
        ref_sel, ref_out = real[0][step]
        for rank in range(WORLD):
            sel, out = real[rank][step]
            for name, (cand, chosen) in sel.items():
                assert torch.equal(cand, ref_sel[name][0]), f"gloo rank {rank} step {step}: other candidates"
                assert torch.equal(chosen, ref_sel[name][1])
            for o, r in zip(out, ref_out):
                assert torch.equal(o, r)
            sim_sel = sim[rank][step][1]
            for name, (cand, chosen) in sel.items():
                assert torch.equal(cand, sim_sel[name][0]) and torch.equal(chosen, sim_sel[name][1])
            for o, s in zip(out, sim[rank][step][0]):
                torch.testing.assert_close(o, s, rtol=0, atol=1e-6)
