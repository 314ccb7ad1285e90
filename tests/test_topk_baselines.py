"""Local top-k and true top-k, the sketched-SGD paper's baselines, on worker momentum + error accumulation."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp.compressors.base import Slot
from gradcomp.errors import ConfigError
from gradcomp.schemes.sketch import SketchedSGD
from gradcomp.schemes.topk_baselines import LocalTopK, TrueTopK
from gradcomp.train.exchange import GradientExchange
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES
from wire_paths import device_path

SLOTS = [Slot("w", 0, 3000), Slot("m", 1, 2000, (20, 100)), Slot("bias", 2, 40)]


def randn(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def grads(rank, step):
    return [randn(s.numel, seed=1000 * step + 10 * rank + s.index) for s in SLOTS]


def run_cluster(world, make_scheme, steps, slots=SLOTS, grads_for=grads):
    """Per worker, per step: (outputs, state, (collectives, up, down))."""

    def worker(t):
        scheme = make_scheme()
        ex = GradientExchange(scheme, t)
        history = []
        for step in steps:
            before = t.counter.snapshot()
            out = ex.exchange(slots, grads_for(t.rank, step), step)
            c = t.counter
            counts = (
                c.collectives - before.collectives,
                c.up_payload - before.up_payload,
                c.down_payload - before.down_payload,
            )
            history.append(([o.clone() for o in out], scheme.state_dict(), counts))
        return history

    with gradcomp.SimulatedCluster(world, timeout=60) as cluster:
        return cluster.run(worker)


def test_local_topk_sums_every_workers_own_top_k_and_each_clears_its_own():
    world, k, rho = 3, 25, 0.5
    runs = run_cluster(world, lambda: LocalTopK(k=k, momentum=rho), range(3))
    us = [[torch.zeros(s.numel) for s in SLOTS] for _ in range(world)]
    vs = [[torch.zeros(s.numel) for s in SLOTS[:2]] for _ in range(world)]
    for step in range(3):
        sent = []
        for r in range(world):
            g = grads(r, step)
            for i in range(3):
                us[r][i] = rho * us[r][i] + g[i]
            mine = []
            for i in range(2):
                vs[r][i] = vs[r][i] + us[r][i]
                mine.append(torch.sort(vs[r][i].abs(), descending=True, stable=True).indices[:k])
            sent.append(mine)
        for i in range(2):
            expected = torch.zeros(SLOTS[i].numel)
            for r in range(world):
                expected[sent[r][i]] += vs[r][i][sent[r][i]]
            expected /= world
            for r in range(world):
                torch.testing.assert_close(runs[r][step][0][i], expected, rtol=0, atol=1e-6)
        bias_mean = sum(us[r][2] for r in range(world)) / world
        for r in range(world):
            torch.testing.assert_close(runs[r][step][0][2], bias_mean, rtol=0, atol=1e-6)
            for i in range(2):
                vs[r][i][sent[r][i]] = 0
                us[r][i][sent[r][i]] = 0
                state = runs[r][step][1]
                torch.testing.assert_close(state["error"][f"{SLOTS[i].name}#{SLOTS[i].numel}"], vs[r][i])
                torch.testing.assert_close(state["momentum"][f"{SLOTS[i].name}#{SLOTS[i].numel}"], us[r][i])
        # the workers chose different coordinates: the union is larger than k
        assert len(set(sent[0][0].tolist()) | set(sent[1][0].tolist())) > k


@pytest.mark.parametrize("world", [2, 4])
def test_local_topk_sends_k_pairs_and_receives_every_other_workers(world):
    k = 25
    runs = run_cluster(world, lambda: LocalTopK(k=k), range(2))
    # (32-bit coordinate, fp32) per kept coordinate of 2 compressed slots, the bias dense; a container of 2 sections
    message = 8 * 2 * k + 4 * 40 + HEADER_BYTES + 2 * SECTION_HEADER_BYTES
    for history in runs:
        for _, _, counts in history:
            assert counts == (1, message, (world - 1) * message)
        for o, r in zip(history[-1][0], runs[0][-1][0]):
            assert torch.equal(o, r)  # the same sum, in rank order, on every worker


def test_true_topk_is_the_top_k_of_the_dense_sum_at_fp32_bytes():
    world, k, rho = 4, 30, 0.9
    runs = run_cluster(world, lambda: TrueTopK(k=k, momentum=rho), range(3))
    us = [[torch.zeros(s.numel) for s in SLOTS] for _ in range(world)]
    vs = [[torch.zeros(s.numel) for s in SLOTS[:2]] for _ in range(world)]
    dense_bytes = 4 * sum(s.numel for s in SLOTS)
    for step in range(3):
        for r in range(world):
            g = grads(r, step)
            for i in range(3):
                us[r][i] = rho * us[r][i] + g[i]
            for i in range(2):
                vs[r][i] = vs[r][i] + us[r][i]
        for i in range(2):
            total = sum(vs[r][i] for r in range(world))
            top = torch.sort(total.abs(), descending=True, stable=True).indices[:k]
            out = runs[0][step][0][i]
            assert set(out.nonzero().reshape(-1).tolist()) == set(top.tolist())
            torch.testing.assert_close(out[top], total[top] / world, rtol=0, atol=1e-5)
            for r in range(world):
                vs[r][i][top] = 0
                us[r][i][top] = 0
        for r in range(world):
            assert runs[r][step][2] == (1, dense_bytes, dense_bytes)  # an oracle: a dense allreduce
            for o, ref in zip(runs[r][step][0], runs[0][step][0]):
                assert torch.equal(o, ref)


def test_sketch_with_every_coordinate_a_candidate_is_true_topk():
    # P·k >= d: round 2 sums the exact v everywhere, so the selection is the true top k
    slots = [Slot("w", 0, 2000), Slot("bias", 1, 30)]

    def g(rank, step):
        return [randn(s.numel, seed=77 * step + 10 * rank + s.index) for s in slots]

    sketch = run_cluster(3, lambda: SketchedSGD(k=20, rows=3, cols=50, candidates=100), range(4), slots, g)
    true = run_cluster(3, lambda: TrueTopK(k=20), range(4), slots, g)
    for step in range(4):
        for a, b in zip(sketch[0][step][0], true[0][step][0]):
            assert set(a.nonzero().reshape(-1).tolist()) == set(b.nonzero().reshape(-1).tolist())
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["local_topk", "true_topk"])
def test_registered_own_momentum_and_refuse_bad_parameters(name):
    scheme = gradcomp.make(name, density=0.05)
    assert scheme.owns_momentum and scheme.params()["density"] == 0.05
    assert gradcomp.make(name).params()["density"] == 0.01
    for bad in ({"k": 0}, {"k": 3, "density": 0.1}, {"density": 2.0}, {"momentum": 1.0}, {"min_size": -1}):
        with pytest.raises(ConfigError):
            gradcomp.make(name, **bad)

    def worker(t):
        ex = GradientExchange(gradcomp.make(name, k=3001), t)
        with pytest.raises(ConfigError, match="larger than its"):
            ex.exchange(SLOTS, grads(0, 0), 0)
        return t.counter.collectives

    with gradcomp.SimulatedCluster(1) as cluster:
        assert cluster.run(worker) == [0]  # refused before anything was sent


def test_largest_takes_n_coordinates_even_when_a_value_is_nan():
    """A NaN (a corrupted sum the checksum could not see: a faulty sender) counts as the largest, as in
    torch.topk; before, the NaN threshold selected fewer than n and the parameter server's message failed."""
    from gradcomp.schemes.accumulation import largest

    x = torch.tensor([1.0, float("nan"), 3.0, -2.0, 0.5])
    assert largest(x, 2).tolist() == [1, 2]
    assert largest(torch.tensor([2.0, 1.0, 2.0]), 2).tolist() == [0, 2]  # ties by the lower index, no NaN


@pytest.mark.parametrize("seed", range(6))
def test_largest_on_the_device_path_is_the_host_paths_selection_without_a_host_read(seed, monkeypatch):
    """The device path's fixed-size selection (nonzero_static of a mask; no nonzero, no .item()) returns the same
    indices in the same order as the host path's, with ties and NaN, and reads nothing back."""
    from sync_counting import counting

    from gradcomp.schemes.accumulation import largest

    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (300,), generator=gen).to(torch.float32)  # many ties at every magnitude
    if seed % 2:
        x[torch.randint(0, 300, (3,), generator=gen)] = float("nan")
    x[7] = float("inf") if seed == 4 else x[7]
    for n in (1, 17, 150, 299):
        expected = largest(x, n)
        device_path(monkeypatch)
        with counting() as counter:
            got = largest(x, n)
        device_path(monkeypatch, False)
        assert counter.total == 0, counter
        assert got.tolist() == expected.tolist(), (n, got.tolist(), expected.tolist())
