"""Library calls given the wrong kind of object refuse with a message that names it, not deep inside torch."""

import numpy as np
import pytest
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
