import os

import pytest
import torch

# Workers spawned by tests inherit this: one intra-op thread each, as `gradcomp train` gives its workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def single_thread():
    """Run torch on one thread (the simulated cluster then computes exactly like a spawned worker)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
