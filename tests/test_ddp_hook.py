"""The DDP communication hook on gloo: overlap, per-parameter slots, DDP's bucket rebuild, errors, checkpoints.

DDP puts every parameter in one bucket for the first backward pass and rebuilds its buckets after it; with
``bucket_cap_mb=CAP`` SmallCNN's eight parameters then fall into three buckets (four, two and two
parameters), so every run below crosses a rebuild and exchanges several buckets per step.
"""

from __future__ import annotations

import gc
import hashlib
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.experiments.run.data import load_dataset, shard_indices
from gradcomp.experiments.run.models import build_model
from gradcomp.train.ddp_hook import DEFAULT_MIN_COMPRESSION_RATE

CAP = 0.01  # MB
HAS_POWERSGD = "powersgd" in gradcomp.available()
NO_POWERSGD = "powersgd is not registered yet (gradcomp.make('powersgd') lands with schemes/powersgd.py)"


def _method(name: str):
    if name in ("none", "fp16", "bf16"):
        return gradcomp.make(name)
    if name.startswith("topk"):
        return gradcomp.make("topk", density=0.4 if name == "topk-mixed" else 0.05, error_feedback=True)
    if name == "randomk":
        return gradcomp.make("randomk", density=0.1)
    if name == "powersgd":
        return gradcomp.make("powersgd")
    raise AssertionError(name)


def _batches(rank: int, world: int, steps: int, size: int = 16):
    data = load_dataset("synthetic")
    rows = shard_indices(data.num_train, rank, world, epoch=0, seed=0)
    return data, [(data.train_x[rows[i * size : (i + 1) * size]], data.train_y[rows[i * size : (i + 1) * size]])
                  for i in range(steps)]


def _digest(model: torch.nn.Module) -> tuple[str, torch.Tensor]:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest(), flat


def model_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _residual_keys(state) -> list[str]:
    return sorted(state.state_dict()["exchange"].get("compressor", {}).get("residuals", {}))


def _train(rank: int, world: int, name: str, hook: bool = True, steps: int = 30, **hook_args) -> dict:
    data, batches = _batches(rank, world, steps)
    model = build_model("cnn", data, seed=0)
    ddp = DDP(model, bucket_cap_mb=CAP)
    state = gradcomp.register_ddp_hook(ddp, _method(name), **hook_args) if hook else None
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses, buckets, residuals = [], [], []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if state is not None:
            buckets.append(dict(state.bucket_sizes))
            if len(residuals) < 3:
                residuals.append(_residual_keys(state))
    digest, flat = _digest(model)
    out = {"digest": digest, "params": flat if rank == 0 else None, "losses": losses}
    if state is not None:
        out.update(steps_seen=state.step, bytes_up=state.transport.counter.bytes_up, buckets=buckets,
                   residuals=residuals + [_residual_keys(state)], thread_alive=state._worker.alive)
        state.close()
        out["thread_alive_after_close"] = state._worker.alive
    return out


def _runs(rank: int, world: int) -> dict:
    runs = {"plain": _train(rank, world, "none", hook=False)}
    for name in ("none", "topk", "randomk", "topk-mixed"):
        runs[name] = _train(rank, world, name)
    runs["topk-bucket"] = _train(rank, world, "topk", granularity="bucket")
    runs["topk-ps"] = _train(rank, world, "topk", topology="ps")
    runs["topk-mixed-off"] = _train(rank, world, "topk-mixed", min_compression_rate=None)
    if HAS_POWERSGD:
        runs["powersgd"] = _train(rank, world, "powersgd")
    return runs


@pytest.fixture(scope="module")
def ddp_runs():
    return run_workers(_runs, 3, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["none", "topk", "randomk", "topk-mixed", "topk-bucket", "topk-ps", "powersgd"])
def test_replicas_bit_identical_with_several_buckets(ddp_runs, label):
    if label == "powersgd" and not HAS_POWERSGD:
        pytest.skip(NO_POWERSGD)
    runs = [r[label] for r in ddp_runs]
    assert len(runs[0]["buckets"][0]) == 1, "DDP's first pass: one bucket"
    assert all(len(b) >= 3 for b in runs[0]["buckets"][1:]), runs[0]["buckets"]
    assert len({r["digest"] for r in runs}) == 1, f"{label}: replicas diverged"
    assert all(r["steps_seen"] == 30 for r in runs)
    # none issues its allreduces from the hook and never starts the thread
    assert runs[0]["thread_alive"] == (label != "none") and not runs[0]["thread_alive_after_close"]


@pytest.mark.slow
def test_uncompressed_hook_matches_ddp_allreduce(ddp_runs):
    torch.testing.assert_close(ddp_runs[0]["none"]["params"], ddp_runs[0]["plain"]["params"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_compressed_hook_learns_and_sends_fewer_bits(ddp_runs):
    # (unscaled-variance random-k at 10 % learns too slowly for 30 steps to show; its bytes are checked)
    for label in ("plain", "none", "topk", "topk-bucket", "topk-ps") + (("powersgd",) if HAS_POWERSGD else ()):
        losses = ddp_runs[0][label]["losses"]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, f"{label} did not learn: {losses}"
    for label in ("topk", "randomk", "topk-bucket", "topk-ps"):
        assert ddp_runs[0][label]["bytes_up"] < ddp_runs[0]["none"]["bytes_up"] / 5, label


@pytest.mark.slow
def test_min_compression_rate_sends_what_does_not_pay_uncompressed(ddp_runs):
    assert DEFAULT_MIN_COMPRESSION_RATE == 2.0
    mixed, off, none = (ddp_runs[0][k]["bytes_up"] for k in ("topk-mixed", "topk-mixed-off", "none"))
    # at density 0.4 a weight's top-k message (4-byte values and 1.75-byte positions for 40 % of its entries)
    # is 1.7 times smaller than its fp32 values, not 2: the weights travel dense, the biases compressed
    assert off < mixed < none
    assert ddp_runs[0]["topk-mixed"]["digest"] != ddp_runs[0]["topk-mixed-off"]["digest"]


@pytest.mark.slow
def test_residuals_belong_to_parameters_and_survive_the_rebuild(ddp_runs):
    model = build_model("cnn", load_dataset("synthetic"), seed=0)
    names = sorted(f"{n}#{p.numel()}" for n, p in model.named_parameters())  # ErrorFeedback's keys
    # per-parameter slots: the same eight residuals before DDP's rebuild (one bucket), after it, at the end
    assert all(keys == names for keys in ddp_runs[0]["topk"]["residuals"]), ddp_runs[0]["topk"]["residuals"]
    # one slot per bucket: the first pass's single bucket keeps a residual until the rebuild; then exactly the
    # three current buckets have one, none of them the old one's (bucket 0 now holds other parameters)
    first, second, third, last = ddp_runs[0]["topk-bucket"]["residuals"]
    assert len(first) == 1 and first[0].startswith("bucket0:") and first[0].endswith(f"#{model_numel(model)}")
    assert len(second) == 3 and first[0] not in second, (first, second)
    assert sorted(k.split(":")[0] for k in second) == ["bucket0", "bucket1", "bucket2"]
    assert second == third == last


# -- the same numbers as GradientAggregator -------------------------------------------------------------------


# fp16 and bf16 go by the hook's direct path (a cast of the bucket buffer), none too; the others by its thread
VERSUS = ("none", "fp16", "bf16", "topk", "randomk") + (("powersgd",) if HAS_POWERSGD else ())


def _versus_aggregator(rank: int, world: int) -> dict:
    out = {}
    for name in VERSUS:
        data, batches = _batches(rank, world, 12)
        ddp_model = build_model("cnn", data, seed=0)
        ddp = DDP(ddp_model, bucket_cap_mb=CAP)
        state = gradcomp.register_ddp_hook(ddp, _method(name), min_compression_rate=None)
        plain = build_model("cnn", data, seed=0)
        aggregator = gradcomp.GradientAggregator(plain, _method(name))
        opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches:
            opt_ddp.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt_ddp.step()
            opt_plain.zero_grad()
            F.cross_entropy(plain(x), y).backward()
            aggregator.step()
            opt_plain.step()
        ddp_state, agg_state = state.state_dict(), aggregator.state_dict()
        residuals = (ddp_state["exchange"].get("compressor", {}).get("residuals", {}),
                     agg_state["exchange"].get("compressor", {}).get("residuals", {}))
        out[name] = {
            "ddp": _digest(ddp_model)[0],
            "aggregator": _digest(plain)[0],
            "steps": (ddp_state["step"], agg_state["steps"]),
            "residuals_equal": residuals[0].keys() == residuals[1].keys()
            and all(torch.equal(residuals[0][k], residuals[1][k]) for k in residuals[0]),
            "residual_count": len(residuals[0]),
        }
    return out


@pytest.mark.slow
def test_layer_slots_give_gradient_aggregators_result():
    """Per-parameter slots are GradientAggregator's slots: same shared randomness, residuals and averages.

    Two workers, so a sum of two values is the same whatever order gloo adds them in (one allreduce for the
    whole model in the aggregator, one per bucket in DDP): the results agree bit for bit.
    """
    results = run_workers(_versus_aggregator, 2, timeout=300)
    for name in VERSUS:
        for r in results:
            assert r[name]["ddp"] == r[name]["aggregator"], f"{name}: DDP hook and GradientAggregator differ"
            assert r[name]["steps"] == (12, 12)
            assert r[name]["residuals_equal"]
    assert results[0]["topk"]["residual_count"] == 8


def _dense_steps_versus_aggregator(rank: int, world: int) -> dict:
    out = {}
    for name in ("topk", "randomk"):  # the thread's path after the direct path of the dense steps
        data, batches = _batches(rank, world, 6)
        ddp_model = build_model("cnn", data, seed=0)
        ddp = DDP(ddp_model, bucket_cap_mb=CAP)
        state = gradcomp.register_ddp_hook(ddp, _method(name), min_compression_rate=None, dense_steps=3)
        plain = build_model("cnn", data, seed=0)
        aggregator = gradcomp.GradientAggregator(plain, _method(name), dense_steps=3)
        sent = []
        for x, y in batches:
            before = state.transport.counter.bytes_up
            ddp.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            sent.append(state.transport.counter.bytes_up - before)
            plain.zero_grad()
            F.cross_entropy(plain(x), y).backward()
            aggregator.step()
            for p, q in zip(ddp_model.parameters(), plain.parameters()):
                assert torch.equal(p.grad, q.grad), (name, "the hook's average differs from the aggregator's")
        out[name] = {"sent": sent, "state_step": state.state_dict()["step"],
                     "numel": sum(p.numel() for p in plain.parameters()),
                     "residuals": len(state.state_dict()["exchange"].get("compressor", {}).get("residuals", {}))}
    return out


@pytest.mark.slow
def test_dense_steps_of_the_hook_send_fp32_then_the_method_as_the_aggregator_does():
    for r in run_workers(_dense_steps_versus_aggregator, 2, timeout=300):
        for name in ("topk", "randomk"):
            sent = r[name]["sent"]
            assert all(s >= 4 * r[name]["numel"] for s in sent[:3]), (name, sent)  # fp32, every entry
            assert all(s < sent[0] / 4 for s in sent[3:]), (name, sent)  # then the method's messages
            assert r[name]["state_step"] == 6
        assert r["topk"]["residuals"] > 0  # error feedback started at the first compressed pass


def test_dense_steps_of_the_hook_must_be_a_whole_number():
    with pytest.raises(gradcomp.ConfigError, match="dense_steps must be a whole number"):
        gradcomp.train.ddp_hook.CompressionHookState(gradcomp.make("topk"), None, dense_steps=-1)


# -- overlap, dtype, thread lifetime, state round trip ----------------------------------------------------------


def _overlap_and_state(rank: int, world: int) -> dict:
    out = {}
    data, batches = _batches(rank, world, 8)

    # the hook returns before the bucket is exchanged: the next bucket is handed over while the first one
    # is still on the thread (the exchange is slowed down to make the window wide)
    model = build_model("cnn", data, seed=0)
    ddp = DDP(model, bucket_cap_mb=CAP)
    state = gradcomp.register_ddp_hook(ddp, _method("topk"))
    events: list[tuple[str, int, float]] = []
    exchange, submit = state.exchange.exchange, state.submit

    def slow_exchange(slots, tensors, step, **kw):
        time.sleep(0.2)
        result = exchange(slots, tensors, step, **kw)
        events.append(("done", slots[0].index, time.perf_counter()))
        return result

    def logged_submit(bucket):
        events.append(("submit", bucket.index(), time.perf_counter()))
        return submit(bucket)

    state.exchange.exchange, state.submit = slow_exchange, logged_submit
    for x, y in batches[:2]:
        events.clear()
        F.cross_entropy(ddp(x), y).backward()
    out["events"] = [(kind, t) for kind, _, t in events]
    state.exchange.exchange, state.submit = exchange, submit

    # the bucket buffer keeps its dtype: a float64 model gets float64 averages
    model64 = build_model("cnn", data, seed=0).double()
    ddp64 = DDP(model64, bucket_cap_mb=CAP)
    state64 = gradcomp.register_ddp_hook(ddp64, _method("topk"))
    for x, y in batches[:2]:
        F.cross_entropy(ddp64(x.double()), y).backward()
    out["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model64.parameters()})
    out["bytes64"] = state64.transport.counter.bytes_up
    # none's direct path too, which sends a float64 bucket as fp32 like the scheme would
    none64 = build_model("cnn", data, seed=0).double()
    ddp_none64 = DDP(none64, bucket_cap_mb=CAP)
    state_none64 = gradcomp.register_ddp_hook(ddp_none64, _method("none"))
    reference64 = build_model("cnn", data, seed=0).double()
    ddp_reference64 = DDP(reference64, bucket_cap_mb=CAP)
    for x, y in batches[:2]:
        F.cross_entropy(ddp_none64(x.double()), y).backward()
        F.cross_entropy(ddp_reference64(x.double()), y).backward()
    out["none64"] = {
        "dtypes": sorted({str(p.grad.dtype) for p in none64.parameters()}),
        "bytes": state_none64.transport.counter.bytes_up,
        "numel": model_numel(none64),
        "max_error": max(
            float((a.grad - b.grad).abs().max()) for a, b in zip(none64.parameters(), reference64.parameters())
        ),
    }

    # the communication thread ends with its state
    before = sum(t.name == "gradcomp-ddp-comm" for t in threading.enumerate())
    del ddp64, state64, model64
    gc.collect()
    for _ in range(50):
        if sum(t.name == "gradcomp-ddp-comm" for t in threading.enumerate()) < before:
            break
        time.sleep(0.1)
    out["threads"] = (before, sum(t.name == "gradcomp-ddp-comm" for t in threading.enumerate()))

    # a closed state refuses buckets, on the direct path (none) too
    out["closed"] = []
    for name in ("topk", "none"):
        closed_ddp = DDP(build_model("cnn", data, seed=0))
        gradcomp.register_ddp_hook(closed_ddp, _method(name)).close()
        try:
            F.cross_entropy(closed_ddp(batches[0][0]), batches[0][1]).backward()
        except gradcomp.CommunicationError as exc:
            out["closed"].append(str(exc))

    # checkpoint round trip: 3 steps, save, a new model / DDP / hook / optimizer loads it, 3 more steps;
    # against 6 steps in one go. Per-parameter residuals do not care that the new DDP's first pass has one
    # bucket. Bucket slots do: a restored DDP starts with one bucket again, whose slot is new, so with
    # granularity "bucket" only the state itself is compared.
    def fresh(granularity):
        m = build_model("cnn", data, seed=0)
        d = DDP(m, bucket_cap_mb=CAP)
        s = gradcomp.register_ddp_hook(d, _method("topk"), granularity=granularity)
        return m, d, s, torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9)

    def run(d, o, part):
        for x, y in part:
            o.zero_grad()
            F.cross_entropy(d(x), y).backward()
            o.step()

    def same(a, b):
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    for granularity in ("layer", "bucket"):
        m1, d1, s1, o1 = fresh(granularity)
        run(d1, o1, batches[:6])
        m2, d2, s2, o2 = fresh(granularity)
        run(d2, o2, batches[:3])
        checkpoint = {"model": m2.state_dict(), "opt": o2.state_dict(), "hook": s2.state_dict()}
        m3, d3, s3, o3 = fresh(granularity)
        m3.load_state_dict(checkpoint["model"])
        o3.load_state_dict(checkpoint["opt"])
        s3.load_state_dict(checkpoint["hook"])
        loaded_equal = same(s3.state_dict(), checkpoint["hook"])
        run(d3, o3, batches[3:6])
        out[granularity] = {
            "continuous": _digest(m1)[0],
            "restored": _digest(m3)[0],
            "loaded_equal": loaded_equal,
            "step": s3.step,
            "saved_residuals": sorted(checkpoint["hook"]["exchange"]["compressor"]["residuals"]),
        }

    # a state saved by another method, for another model, or not a state at all, is refused, nothing loaded
    out["refused"] = []
    other_model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    for method, model_, state_ in (("randomk", build_model("cnn", data, seed=0), checkpoint["hook"]),
                                   ("topk", other_model, checkpoint["hook"]), ("topk", other_model, {})):
        s4 = gradcomp.register_ddp_hook(DDP(model_, bucket_cap_mb=CAP), _method(method))
        try:
            s4.load_state_dict(state_)
        except gradcomp.ConfigError as exc:
            out["refused"].append((str(exc), s4.step))
        s4.close()
    return out


@pytest.mark.slow
def test_overlap_dtype_thread_lifetime_and_checkpoint():
    results = run_workers(_overlap_and_state, 2, timeout=300)
    for r in results:
        # second pass (three buckets): bucket 1 is handed over before bucket 0's exchange is done
        events = r["events"]
        first_done = next(t for kind, t in events if kind == "done")
        submits = [t for kind, t in events if kind == "submit"]
        assert len(submits) >= 3 and submits[1] < first_done, events
        assert r["grad_dtypes"] == ["torch.float64"] and r["bytes64"] > 0
        assert r["none64"]["dtypes"] == ["torch.float64"]
        assert r["none64"]["bytes"] == 2 * 4 * r["none64"]["numel"]  # two steps of fp32
        assert 0 < r["none64"]["max_error"] < 1e-6  # fp32 rounding against DDP's own float64 allreduce
        assert len(r["closed"]) == 2 and all("closed" in m for m in r["closed"]), r["closed"]
        before, after = r["threads"]
        assert before >= 1 and after == before - 1
        assert r["layer"]["continuous"] == r["layer"]["restored"]
        for granularity in ("layer", "bucket"):
            assert r[granularity]["loaded_equal"] and r[granularity]["step"] == 6, granularity
        assert len(r["layer"]["saved_residuals"]) == 8
        assert len(r["bucket"]["saved_residuals"]) == 3
        (other_method, _), (other_model, _), (not_a_state, _) = r["refused"]
        assert other_method.startswith("CompressionHookState.load_state_dict: the state was saved by SingleRound(")
        assert "RandomK(" in other_method.split("this CompressionHookState runs")[1]
        assert "the state was saved for other parameters" in other_model
        assert "expects what its state_dict() returns (keys step, exchange), got keys []" in not_a_state
        assert all(step == 0 for _, step in r["refused"])


# -- errors: NaN on every rank, NaN on one rank, a failure on the thread ----------------------------------------


def _nan_everywhere(rank: int, world: int) -> dict:
    data, batches = _batches(rank, world, 2)
    ddp = DDP(build_model("cnn", data, seed=0), bucket_cap_mb=CAP)
    gradcomp.register_ddp_hook(ddp, _method("topk"), nonfinite="raise")
    x, y = batches[0]
    F.cross_entropy(ddp(x), y).backward()  # first pass: one bucket; the NaN comes after DDP's rebuild
    x = batches[1][0].clone()
    x[0, 0, 0, 0] = float("nan")  # on every rank
    try:
        F.cross_entropy(ddp(x), batches[1][1]).backward()
    except gradcomp.NonFiniteGradientError as exc:  # the typed error, from backward itself
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = "no error"
    # nothing of the hook is in flight: the group is usable right away
    t = torch.ones(3)
    dist.all_reduce(t)
    # and DDP ended the bad pass cleanly: the next backward works, with finite gradients
    ddp.zero_grad()
    F.cross_entropy(ddp(batches[0][0]), batches[0][1]).backward()
    finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
    return {"message": message, "sum": t.tolist(), "next_finite": finite}


@pytest.mark.slow
def test_nan_on_every_rank_raises_naming_parameters():
    for r in run_workers(_nan_everywhere, 2, timeout=120):
        assert "NonFiniteGradientError: non-finite" in r["message"], r["message"]
        assert "classifier.3.weight" in r["message"], r["message"]
        assert "nothing of it was applied" in r["message"]
        assert "scaler=" in r["message"] and "propagate" in r["message"]  # it names the remedy
        assert r["sum"] == [2.0, 2.0, 2.0] and r["next_finite"]


def _nan_on_rank0(rank: int, world: int) -> dict:
    data, batches = _batches(rank, world, 2)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    ddp = DDP(build_model("cnn", data, seed=0), bucket_cap_mb=CAP, process_group=group)
    state = gradcomp.register_ddp_hook(ddp, _method("topk"), nonfinite="raise")
    x, y = batches[0]
    if rank == 0:
        x = x.clone()
        x[0, 0, 0, 0] = float("nan")
    started = time.monotonic()
    try:
        F.cross_entropy(ddp(x), y).backward()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = "no error"
    return {"error": error, "seconds": time.monotonic() - started, "failure": repr(state.failure)}


@pytest.mark.slow
def test_nan_on_one_rank_raises_on_every_rank_without_a_time_out():
    rank0, rank1 = run_workers(_nan_on_rank0, 2, timeout=120)
    # the ranks agree on the bucket's first message: both raise at once, not after the group's 3 s time-out
    for r in (rank0, rank1):
        assert r["error"].startswith("NonFiniteGradientError: "), r  # the typed error, not DDP's RuntimeError
        assert r["failure"] == "None", r  # no failure: the hook goes on with the next pass
    assert "classifier" in rank0["error"] and "on this worker" not in rank1["error"]


def _direct_nan_with_a_slow_rank(rank: int, world: int, name: str) -> dict:
    """``none`` / ``fp16`` (all-reduced straight from the hook, checked in each bucket's callback), several
    buckets, a NaN on rank 1, rank 0's backward slow between buckets: rank 0's first bucket has been found bad by
    the time DDP hands it the next one. That bucket was refused (CommunicationError on rank 0 alone), and its
    all-reduce never issued while rank 1's waited in it. The process group's time-out is 3 s here."""

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            if rank == 0:
                time.sleep(0.3)
            return g

    class SlowModule(torch.nn.Module):
        def forward(self, x):
            return Slow.apply(x)

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(32, 32), SlowModule())])
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    ddp = DDP(net, bucket_cap_mb=0.005, process_group=group)  # one Linear a bucket
    state = gradcomp.register_ddp_hook(ddp, gradcomp.make(name), nonfinite="raise")
    g = torch.Generator().manual_seed(rank)
    errors = []
    for step in range(3):
        x = torch.randn(4, 32, generator=g)
        if step == 2 and rank == 1:
            x[0, 0] = float("nan")
        try:
            ddp(x).square().mean().backward()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    t = torch.ones(1)
    try:
        dist.all_reduce(t, group=state.transport.group)  # the hook's group has no collective left hanging in it
    except Exception as exc:
        return {"errors": errors, "sum": f"{type(exc).__name__}"}
    return {"errors": errors, "sum": t.item()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["none", "fp16"])
def test_a_bad_bucket_of_a_direct_method_stops_every_rank_with_the_same_error(name):
    for r in run_workers(_direct_nan_with_a_slow_rank, 2, name, timeout=120):
        assert len(r["errors"]) == 1 and "NonFiniteGradientError" in r["errors"][0], r["errors"]
        assert "CommunicationError" not in r["errors"][0] and r["sum"] == 2.0, r


def _thread_failure(rank: int, world: int) -> dict:
    data, batches = _batches(rank, world, 3)
    ddp = DDP(build_model("cnn", data, seed=0), bucket_cap_mb=CAP)
    state = gradcomp.register_ddp_hook(ddp, _method("topk"))
    F.cross_entropy(ddp(batches[0][0]), batches[0][1]).backward()

    def broken(*args, **kwargs):
        raise gradcomp.WireError("corrupted buffer (test)")

    state.exchange.exchange = broken
    try:
        F.cross_entropy(ddp(batches[1][0]), batches[1][1]).backward()
    except RuntimeError as exc:
        error = str(exc)
    else:
        error = "no error"
    return {"error": error, "failure": repr(state.failure), "alive": state._worker.alive}


@pytest.mark.slow
def test_error_on_the_thread_reaches_backward():
    for r in run_workers(_thread_failure, 2, timeout=120):
        assert "WireError: corrupted buffer (test)" in r["error"], r["error"]
        assert r["failure"].startswith("WireError"), r
        assert r["alive"]  # the thread survives; it refuses later buckets instead of sending them


def test_bad_granularity_is_a_config_error():
    with pytest.raises(gradcomp.ConfigError, match="granularity"):
        gradcomp.train.ddp_hook.CompressionHookState(gradcomp.make("none"), granularity="model")


def _float64_hook(rank: int, world: int) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradcomp.register_ddp_hook(DDP(nn.Linear(4, 3).double()), gradcomp.make("none"))
    return [str(w.message) for w in caught]


def test_register_ddp_hook_names_float64_parameters_in_a_warning():
    [messages] = run_workers(_float64_hook, 1)
    assert any("register_ddp_hook: 2 float64 parameter(s) (weight, bias)" in m for m in messages), messages


def _registrations(rank: int, world: int) -> dict:
    import torch._dynamo

    out = {}
    ddp = DDP(nn.Linear(4, 3))
    compiled = torch.compile(ddp, backend="eager")
    state = gradcomp.register_ddp_hook(compiled, gradcomp.make("none"))  # on the DDP model inside
    compiled(torch.ones(2, 4)).sum().backward()
    out["compiled"] = state.step
    groups = dist.distributed_c10d._world.group_count
    try:
        gradcomp.register_ddp_hook(ddp, gradcomp.make("none"))
    except gradcomp.ConfigError as exc:
        out["twice"] = str(exc)
    out["groups_made"] = dist.distributed_c10d._world.group_count - groups  # refused before its group was made
    previous = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        gradcomp.register_ddp_hook(DDP(nn.Linear(4, 3)), gradcomp.make("none"))
    except gradcomp.ConfigError as exc:
        out["python_reducer"] = str(exc)
    finally:
        torch._dynamo.config.optimize_ddp = previous
    return out


def test_registration_on_a_compiled_ddp_model_and_refusals_before_anything_is_made():
    """torch.compile(DDP(model)) gets the hook on the DDP model inside (it said "wrap it first"); a second hook on
    one model, and torch's Python reducer (which calls hooks per parameter: a TypeError deep in the first
    backward), are refused before the hook's process group is made."""
    [r] = run_workers(_registrations, 1)
    assert r["compiled"] == 1
    assert "has a communication hook already" in r["twice"] and r["groups_made"] == 0
    assert "runs torch's Python reducer" in r["python_reducer"]
