"""Weight decay for methods that apply momentum themselves: added to the gradient before the exchange.

SGD with momentum decays inside its momentum (u = m·u + g + wd·p). A method that owns its momentum (signum,
DGC, sketched SGD, the momentum feedback policies) runs with the optimizer's momentum at 0, so weight decay
left to the optimizer would be added after the exchange, outside that momentum and outside the method's error
accumulation; the reference implementations (DGC's, sketched SGD's, Signum's) add it to the gradient first.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from torch import nn

from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.run.launch import launch
from gradcomp.experiments.run.runner import add_weight_decay_to_gradients, make_optimizer


@pytest.mark.parametrize(
    ("compressor", "params", "feedback"),
    [("signum", {}, None), ("dgc", {}, None), ("sketch", {}, None), ("topk", {"k": 3}, "momentum_masking")],
)
def test_a_method_that_owns_momentum_gets_weight_decay_in_its_gradient(compressor, params, feedback):
    cfg = TrainConfig(compressor=compressor, params=params, feedback=feedback, momentum=0.9, weight_decay=5e-4)
    note = cfg.hand_momentum_to_method()
    assert cfg.weight_decay_in_gradient and "weight decay 0.0005 is added to each gradient" in note
    assert cfg.momentum == 0.0 and cfg.weight_decay == 5e-4  # recorded as given
    optimizer = make_optimizer(nn.Linear(2, 2), cfg)
    assert optimizer.param_groups[0]["weight_decay"] == 0.0  # not added a second time
    assert cfg.hand_momentum_to_method() is None  # a second call changes nothing


def test_other_methods_keep_weight_decay_in_the_optimizer():
    cfg = TrainConfig(compressor="topk", params={"k": 3}, error_feedback=True, momentum=0.9, weight_decay=5e-4)
    assert cfg.hand_momentum_to_method() is None and not cfg.weight_decay_in_gradient
    assert make_optimizer(nn.Linear(2, 2), cfg).param_groups[0]["weight_decay"] == 5e-4
    without = TrainConfig(compressor="signum", momentum=0.0, weight_decay=0.0)
    assert without.hand_momentum_to_method() is None and not without.weight_decay_in_gradient


def test_the_hook_adds_weight_decay_as_backward_computes_the_gradient():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    add_weight_decay_to_gradients(model, 0.1)
    model(x).sum().backward()
    for p, g in zip(model.parameters(), plain):
        torch.testing.assert_close(p.grad, g + 0.1 * p.detach())


def _seen_by_ddp(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    add_weight_decay_to_gradients(model, 0.1)
    ddp = nn.parallel.DistributedDataParallel(model)
    seen = []

    def record(state, bucket):
        seen.append(bucket.buffer().clone())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, record)
    ddp(torch.ones(1, 3)).sum().backward()
    expected = torch.cat([(torch.ones_like(p) if p.dim() == 1 else torch.ones(2, 3)).reshape(-1) + 0.1 * p.detach()
                          .reshape(-1) for p in model.parameters()])
    return torch.sort(torch.cat(seen)).values, torch.sort(expected).values


def test_ddp_communication_hooks_see_the_decayed_gradient():
    [(seen, expected)] = run_workers(_seen_by_ddp, 1)
    torch.testing.assert_close(seen, expected)


def _signum_run(weight_decay: float, simulate: bool) -> dict:
    cfg = TrainConfig(compressor="signum", dataset="synthetic", model="mlp", workers=2, steps=6, lr=0.001,
                      weight_decay=weight_decay, progress=False, timeout_s=60, simulate=simulate)
    cfg.hand_momentum_to_method()
    assert cfg.weight_decay_in_gradient == (weight_decay > 0)
    return launch(cfg)


def test_weight_decay_in_the_gradient_changes_the_training():
    # the optimizer no longer decays: without the gradient hook, weight decay would do nothing at all
    decayed, plain = _signum_run(0.5, simulate=True), _signum_run(0.0, simulate=True)
    assert decayed["replicas_identical"] and plain["replicas_identical"]
    assert decayed["parameter_digest"] != plain["parameter_digest"]


@pytest.mark.slow
def test_a_run_with_weight_decay_in_the_gradient_keeps_replicas_identical():
    assert _signum_run(0.01, simulate=False)["replicas_identical"]
