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
