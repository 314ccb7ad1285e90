"""scripts/sketch_scaling.py on a tiny setting: per-worker bits of sketch flat in W, of local top-k down growing.

Two simulated training steps on digits with the MLP (d = 9,610: two layers compressed at 1 %, the biases
dense), W = 2 and 4, the four methods; the bits are the transport's counters, read by the script.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sketch_scaling.py"
UP, DOWN = "bits_up_per_worker_per_step", "bits_down_per_worker_per_step"


def _load_script():
    spec = importlib.util.spec_from_file_location("sketch_scaling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sketch_scaling = _load_script()


@pytest.fixture(scope="module")
def rows():
    return sketch_scaling.run_scaling(
        [2, 4],
        sketch_scaling.METHODS,
        2,
        {"density": 0.01},
        dataset="digits",
        model="mlp",
        batch_size=8,
    )


def check_scaling(rows) -> None:
    """The behaviour the docs claim; raises AssertionError."""
    by = {(r["method"], r["workers"]): r for r in rows}
    # sketched SGD: two allreduces of W-independent sizes, flat in W, and less than fp32
    for key in (UP, DOWN):
        assert by["sketch", 2][key] == by["sketch", 4][key]
        assert by["sketch", 4][key] < by["none", 4][key]
    # local top-k: the same message up, the W - 1 others' messages down (the payload: the ranks' 4-byte agreement on
    # refused messages, control, goes up and down once per step)
    up, down = "payload_" + UP, "payload_" + DOWN
    assert by["local_topk", 2][UP] == by["local_topk", 4][UP]
    assert by["local_topk", 4][DOWN] > by["local_topk", 2][DOWN]
    for w in (2, 4):
        assert by["local_topk", w][down] == (w - 1) * by["local_topk", w][up]
        assert by["local_topk", w][UP] - by["local_topk", w][up] == 32
    assert by["local_topk", 4][down] == 3 * by["local_topk", 2][down]
    # the oracle allreduces the dense vector: exactly fp32, both ways
    for w in (2, 4):
        for key in (UP, DOWN):
            assert by["true_topk", w][key] == by["none", w][key] == by["none", w]["fp32_bits_per_worker_per_step"]


def test_scaling_on_a_tiny_run(rows):
    assert len(rows) == 8
    assert all(r["steps"] == 2 for r in rows)
    assert all(r["per_step_constant"] for r in rows)  # every step of every worker moved the same bits
    check_scaling(rows)
    assert sketch_scaling.problems(rows) == []
    sketch = next(r for r in rows if r["method"] == "sketch")
    assert sketch["params"]["density"] == 0.01 and "cols_per_k" in sketch["params"]  # resolved, not just given


def test_check_catches_swapped_local_topk_rows(rows):
    """Swapping local top-k's W = 2 and W = 4 measurements must fail the check (and the script's own)."""
    swapped = [dict(r) for r in rows]
    lt = {r["workers"]: r for r in swapped if r["method"] == "local_topk"}
    for key in (UP, DOWN, "payload_" + UP, "payload_" + DOWN):
        lt[2][key], lt[4][key] = lt[4][key], lt[2][key]
    with pytest.raises(AssertionError):
        check_scaling(swapped)
    assert any("local_topk" in p for p in sketch_scaling.problems(swapped))


def test_check_catches_a_sketch_that_grows_with_w(rows):
    grown = [dict(r) for r in rows]
    next(r for r in grown if r["method"] == "sketch" and r["workers"] == 4)[DOWN] *= 3
    with pytest.raises(AssertionError):
        check_scaling(grown)
    assert any(p.startswith("sketch") for p in sketch_scaling.problems(grown))


def test_steps_for_cuts_large_w():
    assert [sketch_scaling.steps_for(w, 300, 2560) for w in (4, 16, 64, 256)] == [300, 160, 40, 10]
    assert sketch_scaling.steps_for(1024, 300, 2560) == 5
    assert sketch_scaling.steps_for(256, 300, 0) == 300


def test_baselines_get_the_shared_k_only():
    given = {"cols_per_k": 4, "candidates": 1}
    assert sketch_scaling.method_params("sketch", given) == {"cols_per_k": 4, "candidates": 1, "density": 0.01}
    assert sketch_scaling.method_params("local_topk", given) == {"density": 0.01}
    assert sketch_scaling.method_params("true_topk", {"k": 50, "rows": 3}) == {"k": 50}
    assert sketch_scaling.method_params("none", given) == {}
