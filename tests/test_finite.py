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


def test_finite_flag_is_a_device_flag_that_a_large_finite_sum_does_not_fool():
    """The device path's verdict: a bool tensor, nothing read back; finite entries whose sum overflows are finite
    (min/max, not a sum), a NaN or ±Inf anywhere is not; empty tensors are skipped."""
    from sync_counting import counting

    from gradcomp.finite import finite_flag

    big = torch.full((4,), 3e38)
    cases = {
        (): True, (big,): True, (big, torch.zeros(0)): True, (torch.ones(3, dtype=torch.float16),): True,
        (big, torch.tensor([1.0, float("nan")])): False, (torch.tensor([-float("inf")]),): False,
        (torch.tensor([1.0, float("inf")], dtype=torch.bfloat16),): False,
    }  # fmt: skip
    for tensors, expected in cases.items():
        with counting() as counter:
            flag = finite_flag(list(tensors))
        assert counter.total == 0, counter
        assert flag.dtype == torch.bool and flag.numel() == 1 and bool(flag) is expected, (tensors, flag)
