"""1-bit Adam, 0/1 Adam, DiLoCo's outer Nesterov step and dense warm-up steps, against references written from
their papers' equations (world size 1 and 2, simulated and gloo), resume across the freeze, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distributed import run_workers
from gradcomp import GradientAggregator, LocalUpdateExchange, NonFiniteGradientError, SimulatedCluster, make
from gradcomp.errors import ConfigError
from gradcomp.train.onebit_adam import OneBitAdam
from gradcomp.train.zero_one_adam import ZeroOneAdam, schedule, steady_round

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def _grads(model: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    model.zero_grad()
    x, y = _batch(rank, step)
    ((model(x) - y) ** 2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _train(transport, cls, kwargs, steps: int):
    model = _model()
    opt = cls(model, transport, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kwargs)
    for step in range(steps):
        _grads(model, transport.rank, step)
        opt.step()
    opt.finish()
    return [p.detach().clone() for p in model.parameters()], opt


def _simulated(world: int, fn):
    with SimulatedCluster(world) as cluster:
        return cluster.run(fn)


# -- references from the papers' equations ---------------------------------------------------------------------


def _sign_compress(x: torch.Tensor) -> torch.Tensor:
    """signs and one scale ||x||_1 / d (what efsignsgd sends), decoded."""
    if x.numel() == 0:
        return x.clone()
    scale = x.abs().sum() / x.numel()
    return torch.where(x >= 0, scale, -scale)


class CompressedAllReduce:
    """The compressed all-reduce of 1-bit Adam written out for all W workers in one process: every tensor cut in W
    shards (tensor_split), worker i compresses shard j with its residual e_i, owner j averages the W decoded shards,
    compresses the average with its server residual s_j, and every worker receives the same result."""

    def __init__(self, world: int):
        self.world = world
        self.worker_error: dict = {}
        self.server_error: dict = {}

    def __call__(self, vectors: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        out = []
        for k in range(len(vectors[0])):
            shape = vectors[0][k].shape
            shards_per_worker = []
            for i in range(self.world):
                shards = torch.tensor_split(vectors[i][k].reshape(-1), self.world)
                sent = []
                for j, shard in enumerate(shards):
                    e = self.worker_error.get((i, k, j), torch.zeros_like(shard))
                    corrected = shard + e
                    c = _sign_compress(corrected)
                    self.worker_error[(i, k, j)] = corrected - c
                    sent.append(c)
                shards_per_worker.append(sent)
            result = []
            for j in range(self.world):
                mean = sum(shards_per_worker[i][j] for i in range(self.world)) / self.world
                e = self.server_error.get((k, j), torch.zeros_like(mean))
                corrected = mean + e
                c = _sign_compress(corrected)
                self.server_error[(k, j)] = corrected - c
                result.append(c)
            out.append(torch.cat(result).reshape(shape))
        return out


def _adamw_update(p, m, v, step_size_t, denom, lr):
    p.mul_(1 - lr * WD)
    p.sub_(step_size_t * m / denom)


def reference_onebit_adam(world: int, freeze: int, steps: int) -> list[torch.Tensor]:
    """1-bit Adam (Tang et al. 2021, Algorithm 1) with AdamW's bias corrections, every worker in one process."""
    models = [_model() for _ in range(world)]
    b1, b2 = BETAS
    m = [torch.zeros_like(p) for p in models[0].parameters()]
    v = [torch.zeros_like(p) for p in models[0].parameters()]
    reduce = CompressedAllReduce(world)
    for t in range(1, steps + 1):
        grads = [_grads(models[i], i, t - 1) for i in range(world)]
        if t <= freeze:
            mean = [sum(g[k] for g in grads) / world for k in range(len(m))]
            m = [b1 * mk + (1 - b1) * gk for mk, gk in zip(m, mean)]
            v = [b2 * vk + (1 - b2) * gk * gk for vk, gk in zip(v, mean)]
            c2 = 1 - b2 ** t
        else:
            local = [[b1 * mk + (1 - b1) * gk for mk, gk in zip(m, grads[i])] for i in range(world)]
            m = reduce(local)
            c2 = 1 - b2 ** freeze
        for model in models:
            with torch.no_grad():
                for p, mk, vk in zip(model.parameters(), m, v):
                    _adamw_update(p, mk, vk, LR / (1 - b1 ** t), (vk / c2).sqrt() + EPS, LR)
    return [p.detach() for p in models[0].parameters()]


def reference_zero_one_adam(world: int, freeze: int, steps: int, kappa: int, scaler: int, clip: int):
    """0/1 Adam (Lu et al. 2023, Algorithm 1, with DeepSpeed's doubling policies for T_v and T_u)."""
    models = [_model() for _ in range(world)]
    b1, b2 = BETAS
    params = [list(model.parameters()) for model in models]
    n = len(params[0])
    m = [[torch.zeros_like(p) for p in params[0]] for _ in range(world)]
    v = [torch.zeros_like(p) for p in params[0]]
    grad_reduce, update_reduce = CompressedAllReduce(world), CompressedAllReduce(world)
    var_interval, var_counter, var_updates = 1, 0, 0
    local_interval, local_counter, pending, lrs = 1, 0, 0, 0.0
    anchor = None
    for t in range(1, steps + 1):
        grads = [_grads(models[i], i, t - 1) for i in range(world)]
        if t <= freeze:
            if t % var_interval == 0:
                mean = [sum(g[k] for g in grads) / world for k in range(n)]
                v = [b2 * vk + (1 - b2) * gk * gk for vk, gk in zip(v, mean)]
                var_updates += 1
                var_counter += 1
            else:
                mean = grad_reduce(grads)
            shared = [b1 * mk + (1 - b1) * gk for mk, gk in zip(m[0], mean)]
            m = [[x.clone() for x in shared] for _ in range(world)]
            if t % var_interval == 0 and var_counter == kappa:
                var_counter, var_interval = 0, 2 * var_interval
            denom = [(vk / (1 - b2 ** var_updates)).sqrt() + EPS for vk in v]
            with torch.no_grad():
                for i in range(world):
                    for p, mk, d in zip(params[i], m[i], denom):
                        _adamw_update(p, mk, None, LR / (1 - b1 ** t), d, LR)
            if t == freeze:
                anchor = [p.detach().clone() for p in params[0]]
            continue
        m = [[b1 * mk + (1 - b1) * gk for mk, gk in zip(m[i], grads[i])] for i in range(world)]
        with torch.no_grad():
            for i in range(world):
                for p, mk, d in zip(params[i], m[i], denom):
                    _adamw_update(p, mk, None, LR / (1 - b1 ** t), d, LR)
        anchor = [a * (1 - LR * WD) for a in anchor]  # decoupled decay of the kept copy too
        lrs += LR
        pending += 1
        local_counter += 1
        if pending == local_interval or t == steps:
            change = [[(p.detach() - a) * d for p, a, d in zip(params[i], anchor, denom)] for i in range(world)]
            u = update_reduce(change)
            shared_m = [-uk * (1 - b1 ** t) / lrs for uk in u]
            m = [[x.clone() for x in shared_m] for _ in range(world)]
            anchor = [a + uk / d for a, uk, d in zip(anchor, u, denom)]
            with torch.no_grad():
                for i in range(world):
                    for p, a in zip(params[i], anchor):
                        p.copy_(a)
            pending, lrs = 0, 0.0
        if local_counter == scaler:
            local_counter, local_interval = 0, min(clip, 2 * local_interval)
    return [p.detach() for p in params[0]]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> bool:
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))


# -- the tests ---------------------------------------------------------------------------------------------------


def test_onebit_adam_warm_up_is_torch_adamw_bit_for_bit():
    model = _model()
    reference = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    for step in range(12):
        _grads(model, 0, step)
        reference.step()
    (params, _), = _simulated(1, lambda t: _train(t, OneBitAdam, {"freeze_step": 50}, 12))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


@pytest.mark.parametrize("world", [1, 2])
def test_onebit_adam_equals_its_equations(world):
    freeze, steps = 4, 14
    results = _simulated(world, lambda t: _train(t, OneBitAdam, {"freeze_step": freeze}, steps))
    expected = reference_onebit_adam(world, freeze, steps)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[-1][0]))  # replicas identical
    assert _close(results[0][0], expected)
    # and the compressed phase matters: dense AdamW throughout ends elsewhere
    assert not _close(results[0][0], reference_onebit_adam(world, steps, steps), 1e-4)


@pytest.mark.parametrize("world", [1, 2])
def test_zero_one_adam_equals_its_equations(world):
    kw = {"var_freeze_step": 12, "var_update_scaler": 3, "local_step_scaler": 3, "local_step_clipper": 4}
    steps = 30
    results = _simulated(world, lambda t: _train(t, ZeroOneAdam, kw, steps))
    expected = reference_zero_one_adam(world, 12, steps, kappa=3, scaler=3, clip=4)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[-1][0]))
    assert _close(results[0][0], expected)
    opt = results[0][1]
    assert opt.var_updates == 3 + 3 + 1  # steps 1-3, 5, 7, 9, 12 (the interval doubled after 3 updates each)
    assert opt.syncs > 0 and opt.pending == 0


def _resume(world, cls, kwargs, steps, cut):
    def worker(transport):
        model = _model()
        opt = cls(model, transport, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kwargs)
        for step in range(cut):
            _grads(model, transport.rank, step)
            opt.step()
        state, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
        model = _model()
        model.load_state_dict(weights)
        opt = cls(model, transport, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kwargs)
        opt.load_state_dict(state)
        for step in range(cut, steps):
            _grads(model, transport.rank, step)
            opt.step()
        opt.finish()
        return [p.detach().clone() for p in model.parameters()]

    return _simulated(world, worker)


@pytest.mark.parametrize("cls,kwargs", [(OneBitAdam, {"freeze_step": 6}),
                                        (OneBitAdam, {"freeze_step": 6, "warmup_compressor": "cnat"}),
                                        (ZeroOneAdam, {"var_freeze_step": 6, "local_step_scaler": 2}),
                                        (ZeroOneAdam, {"var_freeze_step": 6, "var_update_scaler": 6,
                                                       "local_step_scaler": 2, "warmup_compressor": "cnat"})])
@pytest.mark.parametrize("cut", [3, 6, 9])  # before, at and after the freeze
def test_resume_is_bit_exact_across_the_freeze(cls, kwargs, cut):
    straight = _simulated(2, lambda t: _train(t, cls, kwargs, 14)[0])
    resumed = _resume(2, cls, kwargs, 14, cut)
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _wide() -> nn.Module:
    """A model with enough entries (4,003) that the messages' headers are a small part of their bytes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 400), nn.Tanh(), nn.Linear(400, 3))


WARM_UPS = {OneBitAdam: {"freeze_step": 50},  # (0/1 Adam: every step of its variance stage a dense one)
            ZeroOneAdam: {"var_freeze_step": 50, "var_update_scaler": 50}}


def _warm_up(world: int, compressor: str, steps: int = 5, cls=OneBitAdam):
    def worker(transport):
        model = _wide()
        opt = cls(model, transport, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, warmup_compressor=compressor,
                  **WARM_UPS[cls])
        sent = []
        for step in range(steps):
            _grads(model, transport.rank, step)
            before = transport.counter.bytes_up, transport.counter.bytes_down
            opt.step()
            sent.append(max(transport.counter.bytes_up - before[0], transport.counter.bytes_down - before[1]))
        return [p.detach().clone() for p in model.parameters()], sent

    return _simulated(world, worker)


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_a_compressed_warm_up_sends_fewer_bytes_and_stays_near_fp32s_adamw(cls):
    fp32 = _warm_up(2, "none", cls=cls)
    start = [p.detach() for p in _wide().parameters()]

    def distance(a, b):
        return sum(((x - y) ** 2).sum() for x, y in zip(a, b)) ** 0.5

    numel = sum(p.numel() for p in _wide().parameters())
    assert fp32[0][1][0] >= 4 * numel  # fp32's warm-up: at least 32 bits a coordinate
    for compressor, ratio in (("fp16", 0.5), ("cnat", 9 / 32)):
        results = _warm_up(2, compressor, cls=cls)
        (params, sent), (other, _) = results
        assert all(torch.equal(a, b) for a, b in zip(params, other))  # replicas identical
        # the messages' payload, up and down, is the quantiser's (headers aside), every warm-up step
        assert all(ratio * fp32[0][1][0] <= s <= (ratio + 0.05) * fp32[0][1][0] for s in sent), (compressor, sent)
        assert not all(torch.equal(a, b) for a, b in zip(params, fp32[0][0]))  # it did quantise
        # and AdamW on the quantised average stays nearer AdamW on the exact one than the weights moved (measured
        # after 5 steps: fp16 1e-4 of the movement; C_nat, re-compressed by each shard's owner, 0.58 of it: Adam's
        # normalised step gives a small, noisy mean coordinate a full step either way)
        assert distance(params, fp32[0][0]) < (0.01 if compressor == "fp16" else 0.75) * distance(fp32[0][0], start)


def test_a_warm_up_compressor_that_is_biased_or_unknown_is_refused():
    def worker(transport):
        for name in ("topk", "efsignsgd", "nope"):
            with pytest.raises(ConfigError, match="warm-up's compressor must be one of"):
                OneBitAdam(_model(), transport, lr=LR, freeze_step=3, warmup_compressor=name)
        return True

    assert all(_simulated(1, worker))


def test_a_state_with_other_settings_is_refused():
    def worker(transport):
        saved = ZeroOneAdam(_model(), transport, var_freeze_step=4).state_dict()
        with pytest.raises(ConfigError, match="var_freeze_step=4"):
            ZeroOneAdam(_model(), transport, var_freeze_step=5).load_state_dict(saved)
        with pytest.raises(ConfigError, match="freeze_step=3"):
            OneBitAdam(_model(), transport, freeze_step=2).load_state_dict(
                OneBitAdam(_model(), transport, freeze_step=3).state_dict())
        return True

    assert all(_simulated(1, worker))


def test_zero_one_adam_a_local_nan_before_a_checkpoint_still_raises_at_the_sync_after_resume():
    def worker(transport):
        model = _model()
        opt = ZeroOneAdam(model, transport, var_freeze_step=2, local_step_scaler=1, local_step_clipper=2)
        for step in range(4):  # step 4 is the first of a run of 2 local steps
            _grads(model, transport.rank, step)
            if step == 3 and transport.rank == 1:
                next(model.parameters()).grad[0, 0] = float("nan")
            opt.step()
        state, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
        model = _model()
        model.load_state_dict(weights)
        opt = ZeroOneAdam(model, transport, var_freeze_step=2, local_step_scaler=1, local_step_clipper=2)
        opt.load_state_dict(state)
        _grads(model, transport.rank, 4)
        with pytest.raises(NonFiniteGradientError):
            opt.step()
        return True

    assert all(_simulated(2, worker))


def test_a_state_of_another_method_or_model_is_refused_and_changes_nothing():
    def worker(transport):
        opt = OneBitAdam(_model(), transport, freeze_step=2)
        other = ZeroOneAdam(_model(), transport, var_freeze_step=2)
        with pytest.raises(ConfigError, match="saved by 'ZeroOneAdam'"):
            opt.load_state_dict(other.state_dict())
        small = OneBitAdam(nn.Linear(6, 3), transport, freeze_step=2)
        before = opt.state_dict()
        with pytest.raises(ConfigError):
            opt.load_state_dict(small.state_dict())
        after = opt.state_dict()
        return all(torch.equal(a, b) for a, b in zip(before["tensors"]["exp_avg"], after["tensors"]["exp_avg"]))

    assert all(_simulated(1, worker))


@pytest.mark.parametrize("cls,kwargs", [(OneBitAdam, {"freeze_step": 2}), (ZeroOneAdam, {"var_freeze_step": 2}),
                                        (ZeroOneAdam, {"var_freeze_step": 6, "var_update_scaler": 1})])
@pytest.mark.parametrize("bad_step", [1, 3])  # dense warm-up; compressed phase (0/1 Adam: a sync, or a 1-bit step)
def test_a_nan_on_one_rank_raises_on_every_rank_at_the_same_step_and_changes_nothing(cls, kwargs, bad_step):
    def worker(transport):
        model = _model()
        opt = cls(model, transport, **kwargs)
        for step in range(bad_step):
            _grads(model, transport.rank, step)
            opt.step()
        _grads(model, transport.rank, bad_step)
        if transport.rank == 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        before = copy.deepcopy(opt.state_dict())
        weights = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        except NonFiniteGradientError:
            after = opt.state_dict()
            same_moments = _same_state(before, after)
            same_weights = all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
            return ("raised", opt.t, same_moments and same_weights)
        return ("no error", opt.t, None)

    results = _simulated(2, worker)
    assert results == [("raised", bad_step, True)] * 2


def _same_state(a, b) -> bool:
    """Two states equal to the last bit, nested dicts and lists of tensors included."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


def test_zero_one_adam_weight_decay_is_decoupled_as_adamw():
    """One weight, a constant gradient: 1-bit compression of one entry is exact, so 0/1 Adam's local steps and
    syncs must follow AdamW (the decay once per step, not folded into the momentum at every sync)."""

    def run(make_opt):
        p = nn.Parameter(torch.tensor([10.0]))
        opt = make_opt([("w", p)])
        for _ in range(200):
            p.grad = torch.ones(1)
            opt.step()
        if hasattr(opt, "finish"):
            opt.finish()
        return float(p.detach())

    adamw = run(lambda ps: torch.optim.AdamW([ps[0][1]], lr=0.01, weight_decay=0.1))
    got = _simulated(1, lambda t: run(lambda ps: ZeroOneAdam(ps, t, lr=0.01, weight_decay=0.1, var_freeze_step=10,
                                                             local_step_scaler=5)))
    assert abs(got[0] - adamw) < 0.02 * abs(adamw), (got, adamw)


def test_outer_nesterov_equals_torch_sgd_nesterov_on_the_pseudo_gradient():
    local_steps, syncs = 3, 4

    def worker(transport):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=LR)
        exchange = LocalUpdateExchange(GradientAggregator(model, make("none"), transport), local_steps,
                                       outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
        for step in range(local_steps * syncs):
            _grads(model, transport.rank, step)
            inner.step()
            exchange.after_local_step()
        return [p.detach().clone() for p in model.parameters()]

    results = _simulated(2, worker)
    # the reference: two inner AdamW replicas, torch's SGD(nesterov) on the anchor with grad = -(mean change)
    models = [_model(), _model()]
    inners = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    anchor = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(local_steps * syncs):
        for rank in range(2):
            _grads(models[rank], rank, step)
            inners[rank].step()
        if (step + 1) % local_steps == 0:
            with torch.no_grad():
                for k, a in enumerate(anchor):
                    changes = [list(m.parameters())[k] - a for m in models]
                    a.grad = -(changes[0] / 2 + changes[1] / 2)
            outer.step()
            with torch.no_grad():
                for m in models:
                    for p, a in zip(m.parameters(), anchor):
                        p.copy_(a)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    assert _close(results[0], [a.detach() for a in anchor], 1e-6)


def test_plain_outer_sgd_is_todays_averaging_bit_for_bit():
    def worker(transport, **outer):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=LR)
        exchange = LocalUpdateExchange(GradientAggregator(model, make("none"), transport), 2, **outer)
        for step in range(6):
            _grads(model, transport.rank, step)
            inner.step()
            exchange.after_local_step()
        return [p.detach().clone() for p in model.parameters()], exchange.state_dict()

    plain = _simulated(2, lambda t: worker(t))
    explicit = _simulated(2, lambda t: worker(t, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0))
    heavy = _simulated(2, lambda t: worker(t, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.5))
    assert all(torch.equal(a, b) for a, b in zip(plain[0][0], explicit[0][0]))
    assert "outer" not in plain[0][1] and "outer" in heavy[0][1]
    assert not _close(plain[0][0], heavy[0][0], 1e-6)


def test_outer_state_resumes_and_is_checked():
    def worker(transport):
        model = _model()
        agg = GradientAggregator(model, make("none"), transport)
        exchange = LocalUpdateExchange(agg, 2, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
        for step in range(4):
            _grads(model, transport.rank, step)
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.01 * p.grad)
            exchange.after_local_step()
        state = exchange.state_dict()
        other = LocalUpdateExchange(GradientAggregator(model, make("none"), transport), 2,
                                    outer_optimizer="nesterov", outer_lr=0.5, outer_momentum=0.9)
        with pytest.raises(ConfigError, match="outer optimizer"):
            other.load_state_dict(state)
        plain = LocalUpdateExchange(GradientAggregator(model, make("none"), transport), 2)
        with pytest.raises(ConfigError, match="must hold"):
            plain.load_state_dict(state)
        same = LocalUpdateExchange(GradientAggregator(model, make("none"), transport), 2,
                                   outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
        same.load_state_dict(state)
        return all(torch.equal(a, b) for a, b in zip(same.outer_buffer, exchange.outer_buffer)) and any(
            b.abs().sum() > 0 for b in same.outer_buffer)

    assert all(_simulated(1, worker))


@pytest.mark.parametrize("kwargs,match", [
    ({"outer_optimizer": "adam"}, "sgd or nesterov"),
    ({"outer_optimizer": "nesterov", "outer_lr": 0.0}, "outer_lr"),
    ({"outer_optimizer": "nesterov", "outer_momentum": 1.0}, "outer_momentum"),
])
def test_bad_outer_options(kwargs, match):
    def worker(transport):
        with pytest.raises(ConfigError, match=match):
            LocalUpdateExchange(GradientAggregator(_model(), make("none"), transport), 2, **kwargs)
        return True

    assert all(_simulated(1, worker))


def test_dense_steps_send_fp32_then_the_method():
    dense, steps = 3, 6

    def worker(transport, method, dense_steps):
        model = _model()
        agg = GradientAggregator(model, make(method, density=0.1, error_feedback=True) if method == "topk"
                                 else make(method), transport, dense_steps=dense_steps)
        counts, out = [], []
        for step in range(steps):
            _grads(model, transport.rank, step)
            before = transport.counter.bytes_up
            agg.step()
            counts.append(transport.counter.bytes_up - before)
            out.append([p.grad.clone() for p in model.parameters()])
        return counts, out, agg.exchange.state_dict()

    warm = _simulated(2, lambda t: worker(t, "topk", dense))
    fp32 = _simulated(2, lambda t: worker(t, "none", 0))
    topk = _simulated(2, lambda t: worker(t, "topk", 0))
    numel = sum(p.numel() for p in _model().parameters())
    counts, grads, _ = warm[0]
    assert counts[:dense] == fp32[0][0][:dense] and counts[0] >= 4 * numel
    assert all(c < counts[0] for c in counts[dense:]) and counts[dense:] == topk[0][0][dense:]
    for step in range(dense):  # the warm-up is the dense average exactly
        assert all(torch.equal(a, b) for a, b in zip(grads[step], fp32[0][1][step]))
    # after it, top-k with a residual that started empty at the first compressed step
    assert not all(torch.equal(a, b) for a, b in zip(grads[dense], topk[0][1][dense]))


def test_dense_steps_refuses_a_bad_count():
    def worker(transport):
        for bad in (-1, 1.5, True):
            with pytest.raises(ConfigError, match="dense_steps"):
                GradientAggregator(_model(), make("none"), transport, dense_steps=bad)
        return True

    assert all(_simulated(1, worker))


def _gloo_onebit(rank, world_size):
    from gradcomp import DistTransport

    transport = DistTransport()
    params, opt = _train(transport, OneBitAdam, {"freeze_step": 4}, 10)
    return params, transport.counter.bytes_up


def test_onebit_adam_over_gloo_equals_the_simulated_cluster():
    gloo = run_workers(_gloo_onebit, 2)
    sim = _simulated(2, lambda t: (_train(t, OneBitAdam, {"freeze_step": 4}, 10)[0], t.counter.bytes_up))
    for (params, sent), (sim_params, sim_sent) in zip(gloo, sim):
        assert all(torch.equal(a, b) for a, b in zip(params, sim_params))
        assert sent == sim_sent
    assert all(torch.equal(a, b) for a, b in zip(gloo[0][0], gloo[1][0]))


def test_zero_one_adam_a_nan_in_a_local_step_raises_at_the_sync_on_every_rank():
    def worker(transport):
        model = _model()
        opt = ZeroOneAdam(model, transport, var_freeze_step=2, local_step_scaler=1, local_step_clipper=2)
        seen = []
        for step in range(6):
            _grads(model, transport.rank, step)
            if step == 3 and transport.rank == 1:  # step 4: a local step of a run of 2, its sync at step 5
                next(model.parameters()).grad[0, 0] = float("inf")
            try:
                opt.step()
            except NonFiniteGradientError:
                seen.append(step)
        return seen, [p.detach().clone() for p in model.parameters()]

    (seen0, p0), (seen1, p1) = _simulated(2, worker)
    assert seen0 == seen1 == [4]
    assert all(torch.isfinite(p).all() for p in p0 + p1)


SMALL = ["train", "--dataset", "synthetic", "--model", "mlp", "--no-progress", "--steps", "10", "--workers", "2"]


@pytest.mark.parametrize("extra,message", [
    (["--optimizer", "onebit_adam", "--freeze-step", "10"], "--freeze-step 10 is not before the run's last step"),
    (["--optimizer", "zero_one_adam", "--freeze-step", "0"], "--freeze-step must be a whole number >= 1"),
    (["--optimizer", "onebit_adam", "--compressor", "topk"], "takes no --compressor"),
    (["--optimizer", "onebit_adam", "--local-steps", "4"], "takes no --local-steps"),
    (["--optimizer", "onebit_adam", "--momentum", "0.9"], "--momentum is SGD's"),
    (["--optimizer", "sgd", "--freeze-step", "3"], "--freeze-step is 1-bit Adam's and 0/1 Adam's"),
    (["--outer-optimizer", "nesterov"], "give --local-steps H too"),
    (["--local-steps", "4", "--outer-optimizer", "nesterov", "--outer-lr", "0"], "--outer-lr must be"),
    (["--local-steps", "4", "--outer-lr", "-1"], "--outer-lr must be"),
    (["--local-steps", "4", "--outer-momentum", "1"], "--outer-momentum must be in [0, 1)"),
    (["--dense-steps", "10"], "--dense-steps 10 leaves none of the 10 steps"),
    (["--dense-steps", "2", "--local-steps", "2"], "not with --local-steps"),
    (["--optimizer", "zero_one_adam", "--local-step-clipper", "0"], "--local-step-clipper must be"),
    (["--optimizer", "onebit_adam", "--warmup-compressor", "topk"], "--warmup-compressor must be one of"),
    (["--optimizer", "zero_one_adam", "--warmup-compressor", "sbc"], "--warmup-compressor must be one of"),
    (["--optimizer", "adamw", "--warmup-compressor", "cnat"], "--warmup-compressor is 1-bit Adam's"),
])
def test_bad_options_are_one_line_before_any_worker_starts(extra, message, capsys):
    from gradcomp.cli import main

    assert main([*SMALL, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra", [["--optimizer", "onebit_adam"], ["--optimizer", "zero_one_adam"],
                                   ["--optimizer", "onebit_adam", "--warmup-compressor", "cnat"],
                                   ["--optimizer", "zero_one_adam", "--warmup-compressor", "cnat"],
                                   ["--ddp", "--compressor", "topk", "--param", "density=0.1", "--error-feedback",
                                    "--dense-steps", "3"],
                                   ["--local-steps", "3", "--outer-optimizer", "nesterov"]])
def test_the_new_optimizers_train_on_real_gloo_workers(extra, tmp_path):
    from gradcomp.cli import main

    out = tmp_path / "r.json"
    assert main([*SMALL, "--lr", "0.01", *extra, "--json", str(out)]) == 0
    import json

    result = json.loads(out.read_text())
    assert result["replicas_identical"] and result["backend"] == "gloo"
    assert result["bits_up_per_worker"] < result["dense_bits_per_worker"]


@pytest.mark.parametrize("cls,kwargs", [(OneBitAdam, {"freeze_step": 2}),
                                        (ZeroOneAdam, {"var_freeze_step": 4, "local_step_scaler": 2})])
def test_a_coordinate_with_zero_variance_is_not_moved_by_the_compressed_phase(cls, kwargs):
    """The odd rows of the embedding never get a gradient (they share each shard with rows that do): their
    variance stays 0, and the 1-bit message's ± scale divided by eps would throw them to ~lr/eps."""

    def worker(transport):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1))
        rows = model[0].weight.detach()[1::2].clone()
        opt = cls(model, transport, lr=1e-2, **kwargs)
        for step in range(12):
            g = torch.Generator().manual_seed(step * 7 + transport.rank)
            x = 2 * torch.randint(0, 5, (8, 3), generator=g)
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            opt.step()
        opt.finish()
        return torch.equal(model[0].weight.detach()[1::2], rows), max(float(p.abs().max()) for p in model.parameters())

    for unmoved, largest in _simulated(2, worker):
        assert unmoved and largest < 10


def test_race_methods_for_adam_parse_into_their_training_and_plan_takes_them_by_phases():
    from gradcomp.experiments.race.method import parse_method, planned

    cfg = parse_method("onebit_adam:freeze_step=16").config()
    assert (cfg.compressor, cfg.optimizer, cfg.freeze_step, cfg.ddp) == ("none", "onebit_adam", 16, False)
    assert cfg.warmup_compressor == "none"
    assert parse_method("onebit_adam:freeze_step=16,warmup=cnat").config().warmup_compressor == "cnat"
    cfg = parse_method("diloco:local_steps=32").config()
    assert (cfg.local_steps, cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum) == (32, "nesterov", 0.7, 0.9)
    cfg = parse_method("random_dithering:levels=7,local_steps=8,outer=nesterov,outer.lr=0.5").config()
    assert (cfg.compressor, cfg.params, cfg.local_steps, cfg.outer_lr) == ("random_dithering", {"levels": 7}, 8, 0.5)
    cfg = parse_method("powersgd:rank=2,dense_steps=100").config()
    assert (cfg.dense_steps, cfg.ddp, cfg.params) == (100, False, {"rank": 2})
    with pytest.raises(ConfigError, match="local_steps must be a whole number"):
        parse_method("diloco:local_steps=x")
    from gradcomp.experiments.study import phases

    for text in ("onebit_adam", "diloco:local_steps=8", "topk:density=0.01,dense_steps=5"):  # planned by phases
        assert len(phases.phases(planned(text, {}), 1000)) in (1, 2)
    assert len(phases.phases(planned("zero_one_adam", {}), 1000)) > 2  # its schedule's stretches (test_plan_phases)


def test_an_evaluation_due_between_syncs_is_made_at_the_next_sync(tmp_path):
    """With local steps every 3 and an evaluation every 5 steps, evaluations fall at the syncs after 5, 10, 15
    (they were skipped, so a DiLoCo run evaluated every 100 steps with H = 32 had one point in 1,000 steps)."""
    from gradcomp.cli import main
    import json

    out = tmp_path / "r.json"
    assert main([*SMALL, "--steps", "16", "--local-steps", "3", "--eval-every", "5", "--simulate", "--json",
                 str(out)]) == 0
    assert [step for step, _ in json.loads(out.read_text())["accuracy_curve"]] == [6, 12, 15]


@pytest.mark.parametrize("freeze, steps, kappa, scaler, clipper, expected", [
    (100, 1000, 1000, 50, 2, (150, 2)),   # H = 1 for 50 steps, then 2
    (100, 1000, 1000, 50, 4, (200, 4)),   # 1, 2, then 4 from step 200 (a round boundary, a multiple of 4)
    (150, 1000, 16, 50, 16, None),        # H reaches 16 mid-round: its rounds start at steps not multiples of 16
    (100, 120, 1000, 50, 4, (100, 1)),    # the run ends before H grows: within it, every step syncs
])
def test_zero_one_schedule_steady_round(freeze, steps, kappa, scaler, clipper, expected):
    kinds = schedule(freeze, steps, kappa, scaler, clipper)
    assert steady_round(kinds) == expected
    if expected:
        start, h = expected
        assert [k for k, _ in kinds[start:]] == (["local"] * (h - 1) + ["sync"]) * ((steps - start) // h)
