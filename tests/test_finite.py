"""The fast NaN / Inf checks: a finite sum proves finiteness; anything else gets the exact check."""

from __future__ import annotations

import pytest
import torch

from gradcomp.finite import all_finite, finite_flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_nan_and_inf_anywhere_are_found(dtype):
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 517, 4095):
            t = torch.randn(4096).to(dtype)
            t[where] = bad
            assert not all_finite(t)
    both = torch.zeros(10, dtype=dtype)
    both[2], both[7] = float("inf"), -float("inf")  # their sum is NaN, still not finite
    assert not all_finite(both)
    assert all_finite(torch.randn(4096).to(dtype)) and all_finite(torch.empty(0, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_values_whose_sum_overflows_are_finite(dtype):
    t = torch.full((64,), torch.finfo(dtype).max, dtype=dtype)  # float32's own sum overflows to Inf
    assert all_finite(t) and finite_flags([t]) == [True]


def test_flags_name_each_tensor():
    good, bad = torch.ones(1000), torch.ones(1000)
    bad[3] = float("nan")
    assert finite_flags([good, bad, good]) == [True, False, True]
    assert finite_flags([good, good]) == [True, True] and finite_flags([]) == []
    huge = torch.full((8,), 3e38)
    assert finite_flags([huge, good]) == [True, True]  # the sum overflows, the exact check clears it
