"""torch.compile with gradcomp's DDP hook, on 2 gloo ranks on the CPU.

The backend is ``aot_eager``: AOTAutograd traces forward and backward into graphs, as inductor does, but runs
them with eager kernels, so no C++ compiler runs (inductor on the CPU compiles C++, tens of seconds per graph).
What the hook sees does not depend on the backend: DDP's reducer still hands it the buckets.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_workers


def _train(rank, world, compiled, method, steps):
    import gradcomp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = gradcomp.register_ddp_hook(model, gradcomp.make(method, **({"density": 0.25, "error_feedback": True}
                                                                        if method == "topk" else {})))
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 6, generator=g)
        y = torch.stack([x[:, 0] + x[:, 1], x[:, 2] - x[:, 3], x[:, 4] * x[:, 5]], dim=1)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state.wait()
    result = ([p.detach().clone() for p in net.parameters()], losses, state.transport.counter.bytes_up, state.step)
    state.close()
    return result


@pytest.mark.parametrize("method", ["topk", "none"])
def test_compiled_model_trains_with_the_hook(method):
    eager = run_workers(_train, 2, False, method, 12)
    compiled = run_workers(_train, 2, True, method, 12)
    for rank in range(2):
        params, losses, sent, steps = compiled[rank]
        assert steps == 12 and sent > 0  # the hook ran once per backward, compiled or not
        assert sent == eager[rank][2]  # the same messages
        for a, b in zip(eager[rank][0], params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # compiled kernels may round differently
        assert losses[-1] < losses[0]
    for a, b in zip(compiled[0][0], compiled[1][0]):
        assert torch.equal(a, b)  # replicas identical
