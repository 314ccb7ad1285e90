"""A count sketch (Charikar, Chen, Farach-Colton 2002): an r×c table of a d-dimensional vector.

Coordinate i is added, multiplied by a sign s_j(i) ∈ {−1, +1}, into bucket h_j(i) of every row j. The table
is linear in the vector (sketch(x) + sketch(y) == sketch(x + y), up to fp32 rounding of the bucket sums), so
workers' sketches are summed by a plain allreduce. Coordinate i is estimated as the median over rows of
s_j(i)·table[j, h_j(i)].

Hash family: **random tables**. h_j(i) and s_j(i) for every (j, i) are drawn i.i.d. uniform (buckets in
[0, c), signs in {−1, +1}) from a CPU ``torch.Generator`` seeded by ``shared_seed(seed, 0, index, salt)``,
where the salt names r, c and d. Every worker draws the same tables without talking (the CPU generator gives
the same stream on every machine; the tables are moved to the vector's device afterwards). Fully random
tables are d-wise independent, which is more than the count sketch's analysis needs (pairwise-independent
buckets and signs, independent across rows); a 2-universal (a·x + b mod p) family would be enough and would
cost no memory, but it is computed per step and its arithmetic needs care for p near 2^31 in int64 on every
device. The tables cost 8 bytes per row and coordinate (int64 flat positions would cost 12; here positions are
int32, signs fp32) and are built once per (slot, size), then cached by the caller.

Sketching is one flat ``index_add_`` over all r·d (row, coordinate) pairs into the flattened r·c table;
estimation is one gather of r·d values and a median over rows (the lower median for an even r), taken by
elementwise min/max passes for r ≤ 9.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp.compressors.base import shared_seed
from gradcomp.errors import ConfigError


class CountSketch:
    """The hash tables of one r×c count sketch of d-dimensional vectors, on one device."""

    def __init__(self, numel: int, rows: int, cols: int, seed: int, index: int, device: torch.device | str = "cpu"):
        if numel < 1 or rows < 1 or cols < 1:
            raise ConfigError(f"a count sketch needs d, rows, cols >= 1, got d={numel}, rows={rows}, cols={cols}")
        if rows * cols >= 2**31:
            raise ConfigError(f"a count sketch of {rows}×{cols} buckets is too large (at most 2^31 − 1)")
        self.numel, self.rows, self.cols = int(numel), int(rows), int(cols)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(shared_seed(seed, 0, index, salt=f"countsketch:{rows}x{cols}:{numel}"))
        buckets = torch.randint(0, cols, (rows, numel), generator=gen, dtype=torch.int64)
        signs = torch.randint(0, 2, (rows, numel), generator=gen, dtype=torch.int64)
        offsets = torch.arange(rows, dtype=torch.int64).mul_(cols).unsqueeze(1)
        device = torch.device(device)
        # flat positions in the (rows·cols) table, row j's buckets offset by j·cols
        self.positions = buckets.add_(offsets).to(torch.int32).reshape(-1).to(device)
        self.signs = signs.mul_(2).sub_(1).to(torch.float32).to(device)  # (rows, d)

    @property
    def size(self) -> int:
        """Number of buckets: r·c floats on the wire."""
        return self.rows * self.cols

    def sketch(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """The flat (r·c) table of ``x`` (flat, d values); written into ``out`` (zeroed first) if given."""
        if x.numel() != self.numel:
            raise ValueError(f"sketch of {self.numel} coordinates given a vector of {x.numel()}")
        if out is None:
            out = torch.zeros(self.size, dtype=torch.float32, device=x.device)
        else:
            out.zero_()
        values = (self.signs * x.reshape(1, -1).to(torch.float32)).reshape(-1)
        return out.index_add_(0, self.positions, values)

    def estimate(self, table: Tensor) -> Tensor:
        """Every coordinate's estimate: the median over rows of s_j(i)·table[j, h_j(i)] (d values)."""
        if table.numel() != self.size:
            raise ValueError(f"a {self.rows}×{self.cols} sketch has {self.size} buckets, got {table.numel()}")
        per_row = table.reshape(-1)[self.positions].view(self.rows, self.numel).mul_(self.signs)
        if self.rows == 1:
            return per_row[0]
        if self.rows <= _SORTING_NETWORK_ROWS:
            return _lower_median_by_min_max(list(per_row.unbind(0)))
        return per_row.median(dim=0).values


# Up to this many rows, the median is taken by elementwise min/max passes (a bubble-sort network, r·(r−1)/2
# compare-exchanges of d-vectors), far faster than ``median(dim=0)``, which sorts each short column on its own
# (docs/host_performance.md).
_SORTING_NETWORK_ROWS = 9


def _lower_median_by_min_max(rows: list[Tensor]) -> Tensor:
    """The lower median, elementwise, of r equally shaped tensors (what ``torch.median`` returns)."""
    r = len(rows)
    for i in range(r):
        for j in range(r - 1 - i):
            rows[j], rows[j + 1] = torch.minimum(rows[j], rows[j + 1]), torch.maximum(rows[j], rows[j + 1])
    return rows[(r - 1) // 2]
