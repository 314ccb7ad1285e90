"""LocalUpdateExchange (--local-steps): which methods it takes, and its checkpointed state."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp.cli import main
from gradcomp.errors import ConfigError
from gradcomp.experiments.run.config import TrainConfig

SMALL = ["--dataset", "synthetic", "--model", "mlp", "--steps", "4", "--no-progress", "--workers", "2", "--simulate"]

# (worker compressor, make() keywords, topology, server compressor or None)
VOTES = {
    "signsgd": ("signsgd", {}, "auto", None),
    "signum": ("signum", {}, "auto", None),
    "signsgd + error feedback": ("signsgd", {"error_feedback": True}, "auto", None),
    "none, ps, server signsgd": ("none", {}, "ps", "signsgd"),
    "none, ps, server signum without feedback": ("none", {}, "ps", ("signum", False)),
}
SCALED = {
    "efsignsgd": ("efsignsgd", {}, "auto", None),
    "onebit": ("onebit", {}, "auto", None),
    "none": ("none", {}, "auto", None),
    "none, ps, server efsignsgd": ("none", {}, "ps", "efsignsgd"),
}


def _aggregator(transport, spec, model):
    name, params, topology, server = spec
    if isinstance(server, tuple):
        server = gradcomp.make(server[0], error_feedback=server[1])
    elif server is not None:
        server = gradcomp.make(server)
    return gradcomp.GradientAggregator(
        model, gradcomp.make(name, **params), transport, topology=topology, server_compressor=server
    )


def _one_sync(transport, spec, lr=1e-3, local_steps=2):
    """The largest weight change after one sync of ``local_steps`` SGD steps at ``lr``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    exchange = gradcomp.LocalUpdateExchange(_aggregator(transport, spec, model), local_steps)
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(transport.rank)
    for _ in range(local_steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4, generator=g)).pow(2).sum().backward()
        optimizer.step()
        exchange.after_local_step()
    assert exchange.syncs == 1
    return max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("label", list(VOTES))
def test_a_majority_vote_is_refused_with_local_steps(label):
    # the vote is ±1 per coordinate; applied to the anchor as the update it moved every weight by 1.0 at a sync
    def worker(transport):
        with pytest.raises(ConfigError, match="majority vote to ±1 per coordinate, with no learning rate"):
            _one_sync(transport, VOTES[label])
        return True

    with gradcomp.SimulatedCluster(3) as cluster:
        assert all(cluster.run(worker))


@pytest.mark.parametrize("label", list(SCALED))
def test_methods_that_keep_the_size_are_accepted(label):
    with gradcomp.SimulatedCluster(3) as cluster:
        moved = cluster.run(lambda transport: _one_sync(transport, SCALED[label]))
    assert all(0 < m < 0.1 for m in moved), moved  # two steps at lr 1e-3: a small move, not 1.0


def _config(spec, **extra) -> TrainConfig:
    name, params, topology, server = spec
    server_error_feedback = True
    if isinstance(server, tuple):
        server, server_error_feedback = server
    return TrainConfig(
        compressor=name, params=dict(params), topology=topology, server_compressor=server,
        server_error_feedback=server_error_feedback, dataset="synthetic", model="mlp", workers=2, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("label", list(VOTES))
def test_the_config_refuses_a_majority_vote_with_local_steps_before_any_worker(label):
    with pytest.raises(ConfigError, match="majority vote"):
        _config(VOTES[label], local_steps=4).validate()
    _config(VOTES[label]).validate()  # every step: the lr scales the vote


@pytest.mark.parametrize("label", list(SCALED))
def test_the_config_takes_scaled_methods_with_local_steps(label):
    _config(SCALED[label], local_steps=4).validate()


@pytest.mark.parametrize(
    "extra",
    [["--compressor", "signsgd"], ["--compressor", "signum"],
     ["--compressor", "none", "--topology", "ps", "--server-compressor", "signsgd"]],
)  # fmt: skip
def test_the_cli_refuses_a_majority_vote_with_local_steps(extra, capsys):
    assert main(["train", *SMALL, "--local-steps", "2", "--lr", "0.001", *extra]) == 2
    assert "majority vote" in capsys.readouterr().err


def test_the_cli_trains_efsignsgd_with_local_steps(tmp_path):
    out = tmp_path / "run.json"
    assert main(["train", *SMALL, "--local-steps", "2", "--compressor", "efsignsgd", "--json", str(out)]) == 0


# ------------------------------------------------------------------------------------------------------ state


def _exchange(transport, inputs: int, local_steps: int = 4):
    model = torch.nn.Linear(inputs, 2)
    return gradcomp.LocalUpdateExchange(
        gradcomp.GradientAggregator(model, gradcomp.make("none"), transport), local_steps
    )


def _unchanged(exchange, anchor, pending, syncs):
    assert [tuple(a.shape) for a in exchange.anchor] == [tuple(a.shape) for a in anchor]
    assert all(torch.equal(a, b) for a, b in zip(exchange.anchor, anchor))
    assert (exchange.pending, exchange.syncs) == (pending, syncs)


def test_a_refused_state_leaves_the_exchange_as_it_was():
    def worker(transport):
        other, mine = _exchange(transport, 3), _exchange(transport, 5)
        other.pending, other.syncs = 3, 7
        anchor = [a.clone() for a in mine.anchor]
        with pytest.raises(ConfigError):  # another model: before the fix, anchors and counters were replaced first
            mine.load_state_dict(other.state_dict())
        _unchanged(mine, anchor, 0, 0)
        return True

    with gradcomp.SimulatedCluster(1) as cluster:
        assert cluster.run(worker) == [True]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s["anchor"].pop(), "1 anchors for 2 parameters"),
        (lambda s: s["anchor"].__setitem__(0, torch.zeros(2, 4)), r"anchor of weight is \(2, 4\)"),
        (lambda s: s["anchor"].__setitem__(1, torch.zeros(2, dtype=torch.float64)), "float64"),
        (lambda s: s.__setitem__("pending", -1), "pending must be an integer >= 0"),
        (lambda s: s.__setitem__("syncs", 1.5), "syncs must be an integer >= 0"),
        (lambda s: s.pop("aggregator"), "must hold anchor, pending, syncs and aggregator"),
    ],
)
def test_anchors_and_counters_are_checked(change, match):
    # the aggregator's own state matches (same model and method): only the exchange's part is wrong. Before the fix
    # such anchors were taken as they were (zip() in sync then dropped or misapplied updates)
    def worker(transport):
        exchange = _exchange(transport, 3)
        state = exchange.state_dict()
        change(state)
        anchor = [a.clone() for a in exchange.anchor]
        with pytest.raises(ConfigError, match=match):
            exchange.load_state_dict(state)
        _unchanged(exchange, anchor, 0, 0)
        return True

    with gradcomp.SimulatedCluster(1) as cluster:
        assert cluster.run(worker) == [True]


def test_a_state_round_trip_restores_anchor_and_counters():
    def worker(transport):
        source, target = _exchange(transport, 3), _exchange(transport, 3)
        with torch.no_grad():
            for a in source.anchor:
                a.add_(1.0)
        source.pending, source.syncs = 2, 5
        target.load_state_dict(source.state_dict())
        _unchanged(target, source.anchor, 2, 5)
        return True

    with gradcomp.SimulatedCluster(1) as cluster:
        assert cluster.run(worker) == [True]


def _loaded_after_building(reset: bool) -> float:
    """Two simulated workers; pretrained weights are loaded after the exchange is built, then 4 local SGD steps of
    lr 1e-3 and a sync: how far the parameters end from the pretrained ones."""
    from gradcomp.transport.sim import SimulatedCluster

    def work(transport):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        pretrained = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
        agg = gradcomp.GradientAggregator(model, gradcomp.make("topk", density=0.1, error_feedback=True), transport)
        local = gradcomp.LocalUpdateExchange(agg, 4)
        model.load_state_dict(pretrained)
        if reset:
            local.reset_anchor()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(4):
            opt.zero_grad()
            g = torch.Generator().manual_seed(10 * step + transport.rank)
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
            local.after_local_step()
        return max(float((p.detach() - 0.5).abs().max()) for p in model.parameters())

    with SimulatedCluster(2, timeout=30) as cluster:
        return max(cluster.run(work))


def test_weights_loaded_after_building_stay_with_reset_anchor():
    """The anchors are the parameters when the exchange was built: weights loaded after that counted as the first
    local update and were compressed (top-k 10 %) and mostly reverted. reset_anchor() takes them as the new anchor:
    the parameters then move by the local steps only."""
    assert _loaded_after_building(reset=False) > 0.1  # what happens without it: most of the load is undone
    assert _loaded_after_building(reset=True) < 0.01


def test_reset_anchor_refuses_pending_steps():
    from gradcomp.transport.sim import SimulatedCluster

    def work(transport):
        model = torch.nn.Linear(2, 2)
        local = gradcomp.LocalUpdateExchange(gradcomp.GradientAggregator(model, gradcomp.make("none"), transport), 3)
        local.after_local_step()
        with pytest.raises(ConfigError, match="1 local steps are pending"):
            local.reset_anchor()
        return True

    with SimulatedCluster(1) as cluster:
        assert cluster.run(work) == [True]
