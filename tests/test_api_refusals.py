"""Library calls given the wrong kind of object refuse with a message that names it, not deep inside torch."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import gradcomp
from gradcomp.errors import ConfigError
from gradcomp.transport.sim import SimulatedCluster


def test_register_ddp_hook_needs_a_ddp_model():
    with pytest.raises(ConfigError, match="takes a torch.nn.parallel.DistributedDataParallel model, got Sequential"):
        gradcomp.register_ddp_hook(nn.Sequential(nn.Linear(2, 2)), gradcomp.make("topk"))


@pytest.mark.parametrize("world", [2.5, "4", 0, True])
def test_a_simulated_cluster_needs_a_whole_number_of_workers(world):
    with pytest.raises(ConfigError, match=f"world_size must be an integer >= 1, got {world!r}"):
        SimulatedCluster(world)


def test_a_numpy_integer_is_a_whole_number():
    with SimulatedCluster(np.int64(2)) as cluster:
        assert cluster.world_size == 2


def test_sketch_takes_cols_or_cols_per_k_not_both():
    with pytest.raises(ConfigError, match=r"give cols \(10\) or cols_per_k \(5\), not both"):
        gradcomp.make("sketch", cols=10, cols_per_k=5)
    for given in ({"cols": 10}, {"cols_per_k": 5}, {}):
        params = gradcomp.make("sketch", **given).params()
        assert gradcomp.make("sketch", **params).params() == params  # what params() says builds the same method
    assert gradcomp.make("sketch").params()["cols_per_k"] == 10.0


@pytest.mark.parametrize("value", ["a", True, None])
def test_a_threshold_that_is_not_a_number_is_named(value):
    with pytest.raises(ConfigError, match=f"threshold must be a positive finite number, got {value!r}"):
        gradcomp.make("threshold", threshold=value)


def test_a_composition_with_nothing_to_compose_is_refused_when_made():
    with pytest.raises(ConfigError, match="fp16\\+topk: 'fp16' sends no fp32 values to compress"):
        gradcomp.make("fp16+topk")
    assert gradcomp.make("topk+cnat", density=0.01).name == "topk+cnat"


def _aggregate_once(transport, model):
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make("none"), transport)
    model(torch.full((2, 4), 1 / 3, dtype=model.weight.dtype)).sum().backward()
    before = model.weight.grad.clone()
    aggregator.step()
    return before, model.weight.grad


def test_float64_parameters_are_named_in_a_warning_and_rounded_to_float32():
    model = nn.Linear(4, 3).double()  # its weight's gradient, 2/3, has digits float32 cannot hold
    with SimulatedCluster(1) as cluster:
        with pytest.warns(UserWarning, match=r"2 float64 parameter\(s\) \(weight, bias\): .* rounded to float32"):
            [(before, after)] = cluster.run(lambda t: _aggregate_once(t, model))
    assert after.dtype == torch.float64
    assert not torch.equal(after, before)
    assert torch.equal(after, before.float().double())  # what the warning says: 'none' sent float32


def test_float32_parameters_give_no_warning():
    with SimulatedCluster(1) as cluster, warnings.catch_warnings():
        warnings.simplefilter("error")
        cluster.run(lambda t: _aggregate_once(t, nn.Linear(4, 3)))


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.words(ids).mean(1))


def _sparse_refused(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    try:
        gradcomp.register_ddp_hook(DDP(_Tagger()), gradcomp.make("topk"))
    except ConfigError as exc:
        refused = str(exc)
    model = _Tagger()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["words.weight"])  # kept out of DDP: not refused
    ddp = DDP(model)
    state = gradcomp.register_ddp_hook(ddp, gradcomp.make("topk", density=0.5))
    ddp(torch.randint(0, 50, (4, 5))).sum().backward()
    state.close()
    return refused, state.step


def test_sparse_gradients_are_refused_when_the_hook_is_registered():
    """nn.Embedding(sparse=True) under the DDP hook failed inside backward: "Could not run 'aten::as_strided' with
    arguments from the 'SparseCPU' backend" for none, "1 slots but 0 tensors" for the others. It is now refused when
    the hook is registered, naming the parameter; kept out of DDP, the module is no obstacle."""
    from distributed import run_workers

    ((refused, steps),) = run_workers(_sparse_refused, 1, timeout=120)
    assert "words.weight get sparse gradients" in refused and "sparse=False" in refused, refused
    assert steps == 1


def _two_workers(fn):
    with SimulatedCluster(2, timeout=30) as cluster:
        return cluster.run(fn)


def test_a_parameter_frozen_at_construction_and_unfrozen_later_is_refused_not_trained_apart():
    """A backbone frozen for warm-up when the aggregator is built has no slot; unfrozen, it used to train on each
    worker's own gradient, never averaged, and the replicas parted without an error. step() now refuses it, naming
    it, before anything is sent; freezing after construction is still fine (the slot sends zeros)."""

    def work(transport):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model[0].weight.requires_grad_(False)
        agg = gradcomp.GradientAggregator(model, gradcomp.make("none"), transport)
        model(torch.ones(1, 4)).sum().backward()
        agg.step()  # as built: fine
        model[0].weight.requires_grad_(True)
        model(torch.ones(1, 4)).sum().backward()
        before = transport.counter.snapshot()
        try:
            agg.step()
        except ConfigError as exc:
            return str(exc), transport.counter.snapshot() == before
        return None

    (message, unsent), (again, _) = _two_workers(work)
    assert message == again and "0.weight require gradients but have no slot" in message, message
    assert unsent


def test_unscale_before_step_is_refused():
    """scaler.unscale_(opt) before step() (the usual clipping recipe, in the wrong order) made the aggregator divide
    by the scale twice and, when another worker overflowed, let this worker's scaler apply NaN gradients (its own
    verdict, taken at unscale_, said finite): the replicas were lost. It is now refused, saying the order."""

    def work(transport):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        agg = gradcomp.GradientAggregator(model, gradcomp.make("topk", density=0.5), transport, scaler=scaler)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.ones(1, 4)).sum()).backward()
        scaler.unscale_(opt)
        try:
            agg.step()
        except ConfigError as exc:
            return str(exc)
        return None

    for message in _two_workers(work):
        assert message is not None and "unscale_(optimizer) was called before step()" in message, message


def test_a_sparse_gradient_is_refused_by_the_aggregator():
    """nn.Embedding(sparse=True) failed deep inside torch ("reshape is not implemented for sparse tensors") after the
    set-up all-gather; it is now a ConfigError naming the parameter, before anything is sent."""

    def work(transport):
        model = nn.Embedding(10, 3, sparse=True)
        agg = gradcomp.GradientAggregator(model, gradcomp.make("topk", density=0.5), transport)
        model(torch.tensor([1, 2])).sum().backward()
        try:
            agg.step()
        except ConfigError as exc:
            counter = transport.counter.snapshot()
            return str(exc), counter.collectives + counter.up_setup + counter.up_payload
        return None

    for message, sent in _two_workers(work):
        assert "weight: a torch.sparse_coo gradient" in message and sent == 0, (message, sent)
