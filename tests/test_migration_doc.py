"""docs/migrating-from-torch-hooks.md's loops, run as written on two gloo processes, with a non-finite gradient on
rank 1 only at step 2: the unchanged GradScaler loop skips that step on both ranks, ``nonfinite="raise"`` is caught
as the typed error on both; either way the replicas stay identical and finite."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp

PAGE = Path(__file__).resolve().parents[1] / "docs" / "migrating-from-torch-hooks.md"
BAD_STEP, BAD_RANK, STEPS = 2, 1, 5


def blocks() -> dict[str, str]:
    """The page's Python blocks that follow a ``<!-- tested: NAME -->`` line, by name."""
    text = PAGE.read_text()
    found = re.findall(r"<!-- tested: ([\w-]+) -->\s*\n(\s*)```python\n(.*?)\n\s*```", text, flags=re.S)
    return {name: textwrap.dedent("\n".join(line.removeprefix(indent) for line in body.split("\n")))
            for name, indent, body in found}


def _loader(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)
        if step == BAD_STEP and rank == BAD_RANK:
            x[0, 0] = float("inf")  # this rank's gradients are not finite at this step
        out.append((x, y))
    return out


def _run_block(rank: int, world: int, name: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))
    namespace = {"torch": torch, "F": F, "DDP": DDP, "gradcomp": gradcomp, "device": "cpu", "model": model,
                 "loader": _loader(rank)}
    exec(compile(blocks()[name], f"{PAGE.name}:{name}", "exec"), namespace)  # noqa: S102 - the page's own code
    scaler = namespace.get("scaler")
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "scale": scaler.get_scale() if scaler is not None else None, "skipped": namespace.get("skipped")}


def test_the_page_has_the_loops_this_test_runs():
    assert set(blocks()) == {"unchanged-amp-loop", "raise"}


@pytest.mark.slow
def test_an_unchanged_gradscaler_loop_skips_a_step_that_overflowed_on_one_rank():
    rank0, rank1 = run_workers(_run_block, 2, "unchanged-amp-loop", timeout=120)
    for r in (rank0, rank1):
        assert bool(torch.isfinite(r["params"]).all())
        assert r["scale"] == 65536.0 / 2  # GradScaler's initial scale, halved once: the bad step was skipped
    assert torch.equal(rank0["params"], rank1["params"])  # replicas identical


@pytest.mark.slow
def test_nonfinite_raise_is_caught_as_the_typed_error_on_every_rank():
    rank0, rank1 = run_workers(_run_block, 2, "raise", timeout=120)
    for r in (rank0, rank1):
        assert r["skipped"] == [BAD_STEP] and bool(torch.isfinite(r["params"]).all())
    assert torch.equal(rank0["params"], rank1["params"])
