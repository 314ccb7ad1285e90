"""Mixed precision with GradientAggregator (docs/ddp.md, Errors): bf16 autocast works, fp16 GradScaler not yet."""

import torch
from torch import nn

import gradcomp
from gradcomp.transport.sim import SimulatedCluster


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _train_bf16(transport, steps: int = 20) -> tuple[list[float], torch.Tensor]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make("topk", density=0.5, error_feedback=True), transport)
    data = torch.Generator().manual_seed(transport.rank)
    x = torch.randn(64, 8, generator=data)
    y = x[:, :2].sum(1, keepdim=True).repeat(1, 2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        assert out.dtype == torch.bfloat16  # autocast is really on
        loss = (out.float() - y).pow(2).mean()
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        aggregator.step()
        optimizer.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_bf16_autocast_trains_and_keeps_replicas_identical():
    with SimulatedCluster(2) as cluster:
        (losses0, params0), (losses1, params1) = cluster.run(_train_bf16)
    assert torch.equal(params0, params1)
    assert losses0[-1] < 0.5 * losses0[0] and losses1[-1] < 0.5 * losses1[0]


def _scaled_step(transport):
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make("topk", density=0.5), transport, scaler=scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(4, 8)).pow(2).mean() * 1e10).backward()  # overflows to Inf on every rank
    applied = aggregator.step()
    scaler.step(optimizer)
    scaler.update()
    moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    return applied, moved, scaler.get_scale(), aggregator.skipped


def test_fp16_grad_scaler_overflow_skips_the_step_and_halves_the_scale_on_every_rank():
    with SimulatedCluster(2) as cluster:
        results = cluster.run(_scaled_step)
    assert results == [(False, False, 2.0**119, 1)] * 2
