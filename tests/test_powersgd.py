"""PowerSGD (schemes/powersgd.py): low-rank recovery, error feedback, uncompressed tensors, batching, bytes,
replicas, real gloo workers, checkpoints, bad parameters."""

from __future__ import annotations

import hashlib
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers

import gradcomp
from gradcomp.compressors.base import Slot
from gradcomp.errors import ConfigError
from gradcomp.experiments.run.data import load_dataset, shard_indices
from gradcomp.experiments.run.models import build_model
from gradcomp.schemes.powersgd import PowerSGD, orthogonalise_
from gradcomp.train.exchange import GradientExchange
from gradcomp.transport.requests import execute

WORLD = 4


def slot(name: str, index: int, *shape: int) -> Slot:
    return Slot(name, index, math.prod(shape), tuple(shape))


def exchange_steps(world, make_scheme, slots, grads_for, steps):
    """On a simulated cluster: every worker exchanges ``grads_for(rank, step)`` for ``steps`` steps.

    Returns per worker: [(outputs, request sizes in elements, state after the step), ...] per step.
    """

    def worker(t):
        scheme = make_scheme()
        GradientExchange(scheme, t)  # binds the scheme to its worker
        history = []
        for step in steps:
            rounds = scheme.run(slots, grads_for(t.rank, step), step)
            sizes = []
            try:
                request = next(rounds)
                while True:
                    sizes.append(request.tensor.numel())
                    request = rounds.send(execute(t, request))
            except StopIteration as done:
                out = [o.clone() for o in done.value]
            history.append((out, sizes, scheme.state_dict()))
        return history

    with gradcomp.SimulatedCluster(world, timeout=60) as cluster:
        return cluster.run(worker)


def low_rank(n, m, r, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=gen) @ torch.randn(r, m, generator=gen)


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# -- the algorithm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("error_feedback", [True, False])
def test_rank_r_gradient_is_recovered_exactly(error_feedback):
    # a rank-2 conv gradient, the same on every worker: P̂ spans its column space, so P̂ Q̄ᵀ = P̂ P̂ᵀ M = M
    s = slot("conv", 0, 12, 3, 2, 2)  # a 12 x 12 matrix
    grad = low_rank(12, 12, 2, seed=1).reshape(12, 3, 2, 2)
    runs = exchange_steps(
        WORLD, lambda: PowerSGD(rank=2, start_iter=0, error_feedback=error_feedback), [s],
        lambda rank, step: [grad], range(3),
    )
    for out, sizes, state in runs[0]:
        torch.testing.assert_close(out[0], grad.reshape(-1), rtol=1e-4, atol=1e-5)
        assert sizes == [12 * 2, 12 * 2]  # it was compressed, not sent dense
        if error_feedback:
            assert state["error"]["conv#144"].abs().max() < 1e-4


@pytest.mark.parametrize("scale", [1e-30, 1e-24, 1e19, 1e25])
def test_a_rank_r_gradient_of_any_finite_size_is_recovered(scale):
    # float32 norms of these columns underflow to 0 or overflow to Inf unless each column is scaled first:
    # the update used to come back as exactly zero
    s = slot("w", 0, 16, 24)
    grad = low_rank(16, 24, 2, seed=3) * scale
    runs = exchange_steps(WORLD, lambda: PowerSGD(rank=2, start_iter=0), [s], lambda rank, step: [grad], range(2))
    for out, _, _ in runs[0]:
        assert torch.isfinite(out[0]).all()
        torch.testing.assert_close(out[0] / scale, grad.reshape(-1) / scale, rtol=1e-4, atol=1e-5)


def test_a_rank_r_mean_of_different_gradients_is_recovered():
    # the workers' gradients differ but share a 2-dimensional row space: their mean has rank 2
    s = slot("w", 0, 10, 16)
    left = [randn((10, 2), seed=10 + r) for r in range(WORLD)]
    right = randn((2, 16), seed=99)
    grads = [left[r] @ right for r in range(WORLD)]
    mean = torch.stack(grads).mean(0)
    runs = exchange_steps(WORLD, lambda: PowerSGD(rank=2, start_iter=0), [s], lambda rank, step: [grads[rank]], [0])
    for worker in runs:
        out, _, state = worker[0]
        torch.testing.assert_close(out[0], mean.reshape(-1), rtol=1e-4, atol=1e-5)
    # each worker's error is its own deviation from the mean (error = M - P̂ Q̄ᵀ)
    for rank, worker in enumerate(runs):
        torch.testing.assert_close(worker[0][2]["error"]["w#160"], grads[rank] - mean, rtol=1e-4, atol=1e-5)


def test_warm_start_converges_to_the_best_rank_r_approximation():
    # a fixed full-rank matrix without error feedback: one warm-started power iteration per step converges to
    # the truncated SVD; a fresh Q every step would not get there
    n, m, r = 20, 30, 2
    u, _ = torch.linalg.qr(randn((n, n), seed=3))
    v, _ = torch.linalg.qr(randn((m, m), seed=4))
    sigma = torch.tensor([10.0, 5.0] + [1.0 / (k + 1) for k in range(n - 2)])
    grad = (u * sigma) @ v[:, :n].T
    best = (u[:, :r] * sigma[:r]) @ v[:, :r].T
    runs = exchange_steps(
        2, lambda: PowerSGD(rank=r, start_iter=0, error_feedback=False), [slot("w", 0, n, m)],
        lambda rank, step: [grad], range(25),
    )
    first = (runs[0][0][0][0] - best.reshape(-1)).norm()
    last = (runs[0][-1][0][0] - best.reshape(-1)).norm()
    assert last < 1e-3 * best.norm()
    assert first > 100 * last


def test_error_feedback_identity_update_plus_new_error_is_m():
    s = slot("w", 0, 16, 24)
    runs = exchange_steps(
        WORLD, lambda: PowerSGD(rank=2, start_iter=1), [s],
        lambda rank, step: [randn((16, 24), seed=100 * step + rank)], range(5),
    )
    for rank, worker in enumerate(runs):
        error = torch.zeros(16, 24)
        for step, (out, _, state) in enumerate(worker):
            grad = randn((16, 24), seed=100 * step + rank)
            if step == 0:  # warm-up: dense mean, no error accumulated
                assert state["error"] == {}
                continue
            new_error = state["error"]["w#384"]
            torch.testing.assert_close(out[0].view(16, 24) + new_error, grad + error, rtol=1e-5, atol=1e-6)
            assert new_error.abs().max() > 0.1  # a full-rank gradient leaves an error
            error = new_error
    # the update is the same on every worker, the errors are not
    for step in range(5):
        assert all(torch.equal(w[step][0][0], runs[0][step][0][0]) for w in runs)


def test_uncompressed_tensors_are_exact_means():
    slots = [
        slot("w", 0, 16, 24),  # compressed
        slot("bias", 1, 16),  # 1-D
        slot("small", 2, 3, 4),  # (3 + 4) * 2 * 2 >= 12: would not shrink
        Slot("flat", 3, 7),  # no shape
    ]
    shapes = [(16, 24), (16,), (3, 4), (7,)]

    def grads(rank, step):
        return [randn(shape, seed=1000 * step + 10 * rank + i) for i, shape in enumerate(shapes)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = exchange_steps(WORLD, lambda: PowerSGD(rank=2, start_iter=0), slots, grads, range(3))
    assert any("flat" in str(w.message) and "uncompressed" in str(w.message) for w in caught)
    for step in range(3):
        for i in (1, 2, 3):
            mean = torch.zeros(slots[i].numel)
            for rank in range(WORLD):  # in rank order, as the simulator sums
                mean += grads(rank, step)[i].reshape(-1) / WORLD
            for worker in runs:
                torch.testing.assert_close(worker[step][0][i], mean, rtol=1e-6, atol=1e-7)
        # no error is kept for them
        assert set(runs[0][step][2]["error"]) == {"w#384"}


def test_batched_same_shape_matrices_give_the_unbatched_result():
    # rank 3: (8 + 32) * 3 * 2 < 8 * 32 and (12 + 20) * 3 * 2 < 12 * 20, so all four matrices are compressed
    slots = [slot("a", 0, 8, 32), slot("b", 1, 8, 4, 2, 4), slot("c", 2, 12, 20), slot("d", 3, 8, 32), slot("e", 4, 8)]
    shapes = [(8, 32), (8, 4, 2, 4), (12, 20), (8, 32), (8,)]

    def grads(rank, step):
        return [randn(shape, seed=1000 * step + 10 * rank + i) for i, shape in enumerate(shapes)]

    outs = {}
    for batched in (True, False):
        runs = exchange_steps(
            2, lambda b=batched: PowerSGD(rank=3, start_iter=0, batch_same_shape=b), slots, grads, range(4)
        )
        outs[batched] = [[o for o in step[0]] for step in runs[0]]
        # round 1 and round 2 have the same sizes either way
        assert runs[0][0][1] == [(8 + 8 + 12 + 8) * 3 + 8, (32 + 32 + 20 + 32) * 3]
    for step_b, step_u in zip(outs[True], outs[False]):
        for b, u in zip(step_b, step_u):
            torch.testing.assert_close(b, u, rtol=1e-5, atol=1e-6)
    # and batching really stacks: a, b, d are one 8 x 16 batch
    scheme = PowerSGD(rank=3)
    plan = scheme._build_plan(tuple(slots), torch.device("cpu"))
    assert [(g.n, g.m, g.members) for g in plan.groups] == [(8, 32, [0, 1, 3]), (12, 20, [2])]


def test_conv_weights_are_out_by_in_kh_kw_matrices():
    s = slot("conv", 0, 16, 4, 3, 3)
    scheme = PowerSGD(rank=2)
    assert scheme.approximation_rank(s) == 2
    # the rank is capped at min(n, m); a matrix that would not shrink by min_compression_rate goes dense
    assert PowerSGD(rank=3).approximation_rank(slot("thin", 1, 2, 400)) is None  # (2 + 400) * 2 * 2 >= 800
    assert PowerSGD(rank=3, min_compression_rate=0.5).approximation_rank(slot("thin", 1, 2, 400)) == 2
    assert PowerSGD(rank=2).approximation_rank(slot("bias", 2, 400)) is None
    assert PowerSGD(rank=2).approximation_rank(Slot("model", 0, 10_000)) is None
    runs = exchange_steps(
        2, lambda: PowerSGD(rank=2, start_iter=0), [s], lambda rank, step: [randn((16, 4, 3, 3), seed=rank)], [0]
    )
    out, sizes, state = runs[0][0]
    assert sizes == [16 * 2, 36 * 2]
    assert out[0].shape == (16 * 36,)
    assert state["q"]["conv#576"].shape == (36, 2)
    assert state["error"]["conv#576"].shape == (16, 36)


def test_zero_gradient_gives_zeros_and_the_warm_start_recovers():
    # a zero gradient makes P, P̂ and Q̄ zero; the zero Q is refilled from the shared seed, so a later
    # gradient is compressed again (without the refill P = M Q would stay zero for ever)
    s = slot("w", 0, 10, 12)
    grad = low_rank(10, 12, 2, seed=5)
    runs = exchange_steps(
        2, lambda: PowerSGD(rank=2, start_iter=0, error_feedback=False), [s],
        lambda rank, step: [torch.zeros(10, 12) if step < 2 else grad], range(4),
    )
    for step, (out, _, _) in enumerate(runs[0]):
        assert torch.isfinite(out[0]).all()
        if step < 2:
            assert torch.equal(out[0], torch.zeros(120))
        else:
            torch.testing.assert_close(out[0], grad.reshape(-1), rtol=1e-4, atol=1e-5)


def test_orthogonalise_makes_orthonormal_columns_and_keeps_zero_columns_zero():
    p = randn((3, 50, 4), seed=7)
    p[1, :, 2] = p[1, :, 0] * 3 + p[1, :, 1] * 1e-6  # nearly dependent on the previous columns
    p[2, :, 1] = 0.0  # exactly zero
    original = p.clone()
    orthogonalise_(p)
    assert torch.isfinite(p).all()
    eye = torch.eye(4)
    for b in (0, 1):
        torch.testing.assert_close(p[b].T @ p[b], eye, rtol=0, atol=1e-5)
    assert torch.equal(p[2, :, 1], torch.zeros(50))
    keep = [0, 2, 3]
    torch.testing.assert_close(p[2][:, keep].T @ p[2][:, keep], torch.eye(3), rtol=0, atol=1e-5)
    # the first column keeps its direction
    torch.testing.assert_close(p[0, :, 0], original[0, :, 0] / original[0, :, 0].norm())
    for scale in (1e-25, 1e20):  # squared entries out of float32's range: still unit columns, same directions
        scaled = orthogonalise_(original[:1] * scale)  # (the well-conditioned batch: its basis is stable)
        torch.testing.assert_close(scaled, p[:1], rtol=1e-4, atol=1e-5)


# -- bytes -----------------------------------------------------------------------------------------------------------


def test_bytes_and_collectives_per_step_match_the_formula():
    slots = [
        slot("conv", 0, 16, 4, 3, 3),  # 16 x 36, r = 2
        slot("conv.bias", 1, 16),
        slot("fc", 2, 32, 20),  # 32 x 20, r = 2
        slot("fc2", 3, 32, 20),  # batched with fc
        slot("tiny", 4, 3, 4),  # uncompressed
    ]
    shapes = [s.shape for s in slots]
    start_iter = 2
    r = 2
    p_elems = 16 * r + 32 * r + 32 * r
    dense_elems = 16 + 12
    q_elems = 36 * r + 20 * r + 20 * r

    def worker(t):
        scheme = gradcomp.make("powersgd", rank=r, start_iter=start_iter)
        ex = GradientExchange(scheme, t)
        per_step = []
        for step in range(5):
            before = t.counter.snapshot()
            ex.exchange(slots, [randn(shape, seed=step * 10 + t.rank + i) for i, shape in enumerate(shapes)], step)
            after = t.counter
            per_step.append(
                (
                    after.collectives - before.collectives,
                    after.ops["all_reduce"][0] - before.ops.get("all_reduce", [0, 0])[0],
                    after.up_payload - before.up_payload,
                    after.down_payload - before.down_payload,
                )
            )
        return per_step

    with gradcomp.SimulatedCluster(WORLD, timeout=60) as cluster:
        runs = cluster.run(worker)
    total = sum(s.numel for s in slots)
    for per_step in runs:
        for step, (collectives, allreduces, up, down) in enumerate(per_step):
            if step < start_iter:
                assert (collectives, allreduces, up, down) == (1, 1, 4 * total, 4 * total)
            else:
                assert (collectives, allreduces) == (2, 2)
                assert up == down == 4 * (p_elems + dense_elems) + 4 * q_elems
    # the two rounds separately: P's and the uncompressed values in one allreduce, Q's in the other
    runs = exchange_steps(
        WORLD, lambda: PowerSGD(rank=r, start_iter=start_iter), slots,
        lambda rank, step: [randn(shape, seed=step * 10 + rank + i) for i, shape in enumerate(shapes)], range(4),
    )
    assert [sizes for _, sizes, _ in runs[0]] == [[total], [total], [p_elems + dense_elems, q_elems]] + [
        [p_elems + dense_elems, q_elems]
    ]


# -- training: replicas, checkpoints, real workers ---------------------------------------------------------------


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def train(transport, steps, params, *, model_name="cnn", start=0, resume=None):
    """SGD with momentum on the synthetic set; flat parameters after every step, and a checkpoint."""
    data = load_dataset("synthetic")
    model = build_model(model_name, data, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make("powersgd", **params), transport)
    if resume is not None:
        buffer = io.BytesIO(resume)
        checkpoint = torch.load(buffer, weights_only=False)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        aggregator.load_state_dict(checkpoint["aggregator"])
    rows = shard_indices(data.num_train, transport.rank, transport.world_size, epoch=0, seed=0)
    history = []
    for step in range(start, start + steps):
        batch = rows[(step * 16) % (len(rows) - 16) :][:16]
        optimizer.zero_grad()
        F.cross_entropy(model(data.train_x[batch]), data.train_y[batch]).backward()
        aggregator.step()
        optimizer.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "aggregator": aggregator.state_dict()},
        buffer,
    )
    return torch.stack(history), buffer.getvalue(), transport.counter.bytes_up, transport.counter.bytes_down


PARAMS = {"rank": 2, "start_iter": 3}


def test_replicas_identical_on_the_simulated_cluster(single_thread):
    with gradcomp.SimulatedCluster(WORLD, timeout=120) as cluster:
        runs = cluster.run(lambda t: train(t, 12, PARAMS))
    for rank in range(1, WORLD):
        assert torch.equal(runs[rank][0], runs[0][0]), f"simulated rank {rank} diverged"
    assert not torch.equal(runs[0][0][0], runs[0][0][-1])


def test_a_loaded_checkpoint_continues_exactly_like_the_uninterrupted_run(single_thread):
    with gradcomp.SimulatedCluster(2, timeout=120) as cluster:
        straight = cluster.run(lambda t: train(t, 10, PARAMS))
    with gradcomp.SimulatedCluster(2, timeout=120) as cluster:
        first = cluster.run(lambda t: train(t, 6, PARAMS))
    with gradcomp.SimulatedCluster(2, timeout=120) as cluster:
        second = cluster.run(lambda t: train(t, 4, PARAMS, start=6, resume=first[t.rank][1]))
    for rank in range(2):
        resumed = torch.cat([first[rank][0], second[rank][0]])
        assert torch.equal(resumed, straight[rank][0]), f"rank {rank}: the resumed run differs"
    # the checkpoint really carries Q's and errors keyed by name and matrix shape
    state = torch.load(io.BytesIO(first[0][1]), weights_only=False)["aggregator"]["exchange"]
    assert set(state["q"]) == set(state["error"]) == {
        "features.0.weight#400", "features.3.weight#12800", "classifier.1.weight#16384",
        "classifier.3.weight#1280",
    }


def test_without_the_checkpoint_the_continuation_differs(single_thread):
    # the state matters: starting the second half with a fresh PowerSGD gives another trajectory
    with gradcomp.SimulatedCluster(2, timeout=120) as cluster:
        straight = cluster.run(lambda t: train(t, 8, PARAMS))
        first = cluster.run(lambda t: train(t, 5, PARAMS))

        def fresh(t):
            checkpoint = torch.load(io.BytesIO(first[t.rank][1]), weights_only=False)
            checkpoint["aggregator"]["exchange"] = {}
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            return train(t, 3, PARAMS, start=5, resume=buffer.getvalue())

        second = cluster.run(fresh)
    assert not torch.equal(second[0][0][-1], straight[0][0][-1])


def test_state_round_trip_and_retain():
    scheme = PowerSGD(rank=2, start_iter=0)
    slots = [slot("a", 0, 8, 16), slot("b", 1, 12, 10)]
    with gradcomp.SimulatedCluster(1) as cluster:
        cluster.run(
            lambda t: (
                GradientExchange(scheme, t).exchange(slots, [randn((8, 16), seed=0), randn((12, 10), seed=1)], 0)
            )
        )
    state = scheme.state_dict()
    assert set(state["q"]) == {"a#128", "b#120"}
    other = PowerSGD(rank=2)
    other.load_state_dict(state)
    for part in ("q", "error"):
        for key, value in state[part].items():
            assert torch.equal(other.state_dict()[part][key], value)
    # the state is a copy, not a view of the buffers
    state["q"]["a#128"].add_(1.0)
    assert not torch.equal(scheme.state_dict()["q"]["a#128"], state["q"]["a#128"])
    scheme.retain([slots[1]])
    assert set(scheme.state_dict()["q"]) == set(scheme.state_dict()["error"]) == {"b#120"}
    scheme.retain([slot("b", 1, 10, 12)])  # same name, another shape: its state is dropped
    assert scheme.state_dict() == {"q": {}, "error": {}}


def test_bad_state_raises_config_error():
    q = {"w#128": torch.zeros(16, 4)}
    with pytest.raises(ConfigError, match="rank"):
        PowerSGD(rank=2).load_state_dict({"q": q})
    with pytest.raises(ConfigError, match="error"):  # an error of another size than its slot's
        PowerSGD(rank=2).load_state_dict({"error": {"w#128": torch.zeros(16, 4)}})
    with pytest.raises(ConfigError, match="float32"):
        PowerSGD(rank=2).load_state_dict({"q": {"w#128": torch.zeros(16, 2, dtype=torch.float64)}})
    scheme = PowerSGD(rank=2)
    scheme.load_state_dict({"q": {"w#128": torch.ones(16, 2)}})
    with pytest.raises(ConfigError, match="rank"):  # refused as a whole: the state loaded before stays
        scheme.load_state_dict({"q": {"v#128": torch.ones(16, 2), "w#128": torch.zeros(16, 4)}})
    assert set(scheme.state_dict()["q"]) == {"w#128"} and scheme.state_dict()["q"]["w#128"].eq(1).all()
    with pytest.raises(ConfigError, match="key"):
        PowerSGD(rank=2).load_state_dict({"q": {"w": torch.zeros(16, 2)}})
    with pytest.raises(ConfigError, match="keys"):
        PowerSGD(rank=2).load_state_dict({"residuals": {}})
    with pytest.raises(ConfigError, match="without error feedback"):
        PowerSGD(rank=2, error_feedback=False).load_state_dict({"error": {"w#128": torch.zeros(8, 16)}})


# -- construction -----------------------------------------------------------------------------------------------


def test_registered_and_built_by_make():
    assert "powersgd" in gradcomp.available()
    scheme = gradcomp.make("powersgd", rank=4, start_iter=0)
    assert isinstance(scheme, PowerSGD)
    assert scheme.params()["rank"] == 4 and scheme.error_feedback
    assert gradcomp.make("powersgd", error_feedback=False).error_feedback is False


@pytest.mark.parametrize(
    "params",
    [
        {"rank": 0},
        {"rank": -1},
        {"rank": 1.5},
        {"rank": True},
        {"rank": "2"},
        {"start_iter": -1},
        {"start_iter": 2.0},
        {"min_compression_rate": 0},
        {"min_compression_rate": -2},
        {"min_compression_rate": float("nan")},
        {"min_compression_rate": float("inf")},
        {"min_compression_rate": "2"},
        {"seed": -1},
        {"batch_same_shape": "yes"},
        {"density": 0.1},
        {"matrix_approximation_rank": 2},
    ],
)
def test_bad_parameters_raise_config_error(params):
    with pytest.raises(ConfigError):
        gradcomp.make("powersgd", **params)


def test_bad_error_feedback_and_topology_raise_config_error():
    with pytest.raises(ConfigError):
        gradcomp.make("powersgd", error_feedback="on")
    with pytest.raises(ConfigError):
        PowerSGD(error_feedback=1)
    with pytest.raises(ConfigError):
        with gradcomp.SimulatedCluster(1) as cluster:
            cluster.run(lambda t: GradientExchange(gradcomp.make("powersgd"), t, topology="allgather"))


def test_a_slot_whose_shape_does_not_hold_its_elements_raises_before_sending():
    bad = Slot("w", 0, 10, (3, 4))

    def worker(t):
        scheme = PowerSGD(start_iter=0)
        GradientExchange(scheme, t)
        scheme.run([bad], [torch.zeros(10)], 0).send(None)

    with pytest.raises(ConfigError, match="shape"):
        with gradcomp.SimulatedCluster(1) as cluster:
            cluster.run(worker)


# -- real gloo workers -------------------------------------------------------------------------------------------


GLOO_STEPS = 15


def _real_worker(rank: int, world_size: int) -> dict:
    from gradcomp.transport.dist import DistTransport

    trajectory, _, up, down = train(DistTransport(), GLOO_STEPS, PARAMS)
    return {
        "digests": [_digest(row) for row in trajectory],
        "trajectory": trajectory if rank == 0 else None,
        "bytes": (up, down),
    }


@pytest.mark.slow
def test_real_gloo_workers_are_bit_identical_and_match_the_simulated_cluster(single_thread):
    real = run_workers(_real_worker, WORLD, timeout=300)
    for rank in range(1, WORLD):
        assert real[rank]["digests"] == real[0]["digests"], f"gloo rank {rank} diverged from rank 0"
    with gradcomp.SimulatedCluster(WORLD, timeout=120) as cluster:
        sim = cluster.run(lambda t: train(t, GLOO_STEPS, PARAMS))
    assert (sim[0][2], sim[0][3]) == real[0]["bytes"]
    # gloo sums in another order than the simulator: the same model up to fp32 rounding, step for step
    torch.testing.assert_close(sim[0][0], real[0]["trajectory"], rtol=0, atol=1e-5)
    assert not torch.equal(sim[0][0][0], sim[0][0][-1])


def test_state_that_is_not_tensors_is_refused():
    with pytest.raises(gradcomp.ConfigError, match="tensors"):
        gradcomp.make("powersgd").load_state_dict({"q": {"a#24": [[1.0]]}})


def test_retain_drops_the_buffers_of_a_slot_list_that_stopped_coming():
    # DDP's first pass has one bucket with every parameter; after its rebuild the same parameters come in
    # two buckets. The first bucket's buffers must go at the next retain, though its slots are all alive.
    a, b = Slot("a", 0, 64 * 64, (64, 64)), Slot("b", 1, 64 * 64, (64, 64))

    def fn(t):
        scheme = gradcomp.make("powersgd")
        ex = gradcomp.GradientExchange(scheme, t)
        ex.exchange([a, b], [torch.randn(4096), torch.randn(4096)], 0)
        scheme.retain([a, b])
        ex.exchange([a], [torch.randn(4096)], 1)
        ex.exchange([b], [torch.randn(4096)], 1)
        scheme.retain([a, b])
        return sorted(len(slots) for slots, _ in scheme._plans)

    with gradcomp.SimulatedCluster(1) as cluster:
        assert cluster.run(fn) == [[1, 1]]
