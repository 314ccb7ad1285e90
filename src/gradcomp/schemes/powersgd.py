"""PowerSGD: rank-r power iteration with warm start and error feedback, in two allreduces per step.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019 (arXiv:1905.13727).

    gradcomp.make("powersgd", rank=2)                      # error feedback on, as in the paper
    gradcomp train --compressor powersgd --param rank=2

The algorithm, per step, for every parameter whose gradient is viewed as an n×m matrix (a conv weight
(out, in, kh, kw) as out × in·kh·kw; r = min(rank, n, m)):

    M = G + E                      this worker's gradient plus its error (E = 0 without error feedback)
    P = M Q                        Q (m×r) is the previous step's Q: warm start, one power iteration a step
    P = allreduce-mean(P)          round 1 (together with every uncompressed tensor, see below)
    P̂ = orthogonalise(P)           orthonormal columns; the same on every worker
    Q = Mᵀ P̂
    Q = allreduce-mean(Q)          round 2
    update = P̂ Qᵀ                  the same on every worker; it replaces the averaged gradient
    E = M − P̂ Qᵀ                   what this worker's M kept that the update did not carry

Every round is a plain allreduce of fp32 values, so the method scales like fp32 allreduce; per step a
worker hands 4·(Σ n·r + Σ uncompressed) bytes to round 1 and 4·Σ m·r bytes to round 2.

Choices made where the paper is silent (each a parameter where it matters):

- **Which tensors are compressed** (as torch's ``powerSGD_hook``): a tensor is sent as it is when it is not
  a matrix — a bias, any 1-D slot, a slot without a shape (a whole-model slot, granularity ``model``: then
  PowerSGD degenerates to fp32 allreduce and a warning says so) — or when compression would not pay:
  (n + m)·r·``min_compression_rate`` ≥ n·m (default 2, torch's default). Uncompressed tensors travel in the
  SAME allreduce as the P's (one flat buffer: all P's, then the uncompressed values), so a step costs
  exactly two collectives; torch's hook spends a third one on them. They are exact means and keep no error.
- **Warm-up** ``start_iter`` (default 0, the paper's method): steps with ``step < start_iter`` send every
  tensor uncompressed in one dense allreduce and accumulate no error. Torch's hook recommends deferring
  compression (its default is 1000, its docstring example 10), epfml's library defaults to 100 steps: the
  first, large and fast-changing gradients are the ones a rank-r approximation hurts most. The paper
  compresses from the first step, and with error feedback that does as well on the default job, while a
  few dense steps cost as many bytes as hundreds of compressed ones (docs/methods/powersgd.md has the runs).
  Raise it for a model whose first steps are fragile. The step is the exchange's step argument, so a resumed run knows
  where it is without a counter of its own.
- **Orthogonalisation**: classical Gram–Schmidt with one reorthogonalisation pass per column ("twice is
  enough"), batched over matrices of the same shape, for every rank. Why not QR (epfml's library, and
  torch's hook for r > 2): the result P̂ P̂ᵀ does not depend on which orthonormal basis is returned, so QR's
  advantage is only speed at larger r, while Gram–Schmidt here (a) is a handful of batched elementwise and
  bmm operations with no LAPACK call, the same on CPU and GPU; (b) keeps a column that is exactly zero (a
  layer whose gradient and error are zero) at zero instead of dividing by zero (torch's hook produces NaN
  there unless given an epsilon); a rank-deficient M leaves rounding noise in its surplus columns, which are
  normalised like any other (P̂ P̂ᵀ M still equals M to rounding); (c) with the second pass it stays
  orthonormal to rounding even when a column is nearly dependent on the previous ones, where one pass of
  Gram–Schmidt would return a "unit" column made of rounding noise that is not orthogonal.
- **Q's columns are normalised** before P = M Q. P̂ is unchanged in exact arithmetic (Gram–Schmidt does not
  see a positive scaling of P's columns), but P's magnitude stays that of M instead of M² (no fp32
  overflow after many warm-started steps). A column of Q that is exactly zero (it follows from a zero
  column of P̂) would never come back to life, since P = M Q would stay zero in that direction; it is
  refilled from the shared seed. Q is identical on every worker, so every worker makes the same choice.
- **Initial Q**: i.i.d. standard normal, drawn on the CPU from a generator seeded by (``seed``, step,
  parameter index) — identical on every worker and on CPU and GPU, never touching the global RNG.
- **Error feedback** (``error_feedback=True``, the paper's method): E = M − P̂ Q̄ᵀ with the *averaged* Q̄,
  as in the paper's Algorithm 2 (``e ← Δ − decompress(compress(Δ))``, where compress includes both
  allreduces) and in both reference implementations. So ``update + E_new == M`` on every worker, and the
  workers' errors sum to Σ M − W·update.
- **Batching**: matrices of the same shape are stacked into one (B, n, m) batch (``batch_same_shape``);
  batched and one-by-one give the same values up to fp32 rounding (bmm and the reductions may sum in a
  different order; the test allows 1e-5 relative).
- **Mean**: P's, uncompressed values and Q's are divided by W before they are summed (as ``SingleRound``).
- **Buffers**: per set of slots, the P+uncompressed and Q send buffers, the stacked M's, the Q's and the
  errors are allocated once and reused (the Q's and errors are the state); the returned tensors are fresh
  every step (the caller may keep them).

The learning rate: PowerSGD's update replaces the averaged gradient; the optimizer's momentum, weight decay
and learning rate apply to it as usual (the paper runs SGD with Nesterov momentum 0.9 on top and keeps the
uncompressed baseline's learning rate schedule). The error feedback re-sends, at the next step, what the
low-rank update left out of the gradient — it is fed before the learning rate, so the lr scales it like
any gradient; the method has no learning-rate parameter of its own.

State (``state_dict``, a ``gradcomp.compressors.state.SlotState``): the Q of every compressed matrix and, with error
feedback, its error, keyed by slot (``"<slot name>#<d>"``); a loaded Q must be (m, r) for an m that divides d
and this rank, an error d elements. Randomness is derived from (seed, step, index) and needs no state, so
a loaded checkpoint continues bit for bit like the uninterrupted run.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Slot, check_bool, check_int, shared_generator
from gradcomp.errors import ConfigError
from gradcomp.schemes.base import Scheme
from gradcomp.transport.requests import AllReduce, Rounds
from gradcomp.compressors.state import SlotState
from gradcomp.wire.bits import host_path

_TINY = torch.finfo(torch.float32).tiny  # a column whose norm is at most this counts as zero


def orthogonalise_(p: Tensor) -> Tensor:
    """Make the columns of every matrix of the batch ``p`` (B, n, r) orthonormal, in place.

    Gram–Schmidt with a second projection pass for every column after the first; a column that is exactly
    zero (or becomes zero after projection) stays zero instead of turning into NaN.
    """
    if p.dim() != 3:
        raise ValueError(f"expected a batch of matrices (B, n, r), got shape {tuple(p.shape)}")
    for i in range(p.shape[2]):
        col = p[:, :, i : i + 1]
        for _ in range(1 if i == 0 else 2):
            if i:
                prev = p[:, :, :i]
                col.sub_(torch.bmm(prev, torch.bmm(prev.transpose(1, 2), col)))
            _normalise_columns_(col)
    return p


def _normalise_columns_(x: Tensor) -> Tensor:
    """Divide every column of the batch ``x`` (B, n, c) by its norm; zero columns stay zero.

    Each column is first divided by its largest magnitude: ``vector_norm`` squares the entries as they are,
    so in float32 a column whose entries are all below about 1e-19 had a norm of 0 (and was dropped as a zero
    column) and one with an entry above about 1e19 a norm of Inf (divided to zero), which silently lost a
    finite gradient of that size. Scaled, the norm lies in [1, sqrt(n)].
    """
    largest = x.abs().amax(dim=1, keepdim=True)
    x.div_(torch.where(largest > 0, largest, torch.full_like(largest, math.inf)))  # a zero column stays zero
    norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    return x.div_(torch.where(norm > _TINY, norm, torch.full_like(norm, math.inf)))


def matrix_shape(slot: Slot) -> tuple[int, int] | None:
    """(n, m): the parameter viewed as out × everything else; None for a slot that is not a matrix."""
    if slot.shape is None or len(slot.shape) < 2 or slot.numel == 0:
        return None
    n = int(slot.shape[0])
    return n, slot.numel // n


@dataclass
class _Group:
    """Compressed matrices of one shape, stacked (or a single matrix when batching is off)."""

    n: int
    m: int
    r: int
    members: list[int]  # positions in the plan's slots
    p_offset: int  # in the round-1 buffer
    q_offset: int  # in the round-2 buffer
    out_offset: int  # in the flat output
    m_buf: Tensor  # (B, n, m): this step's M
    q_state: Tensor  # (B, m, r): the warm-started Q (state)
    error: Tensor | None  # (B, n, m): the error (state), None without error feedback
    q_views: list[Tensor] = field(default_factory=list)
    e_views: list[Tensor] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return len(self.members)


@dataclass
class _Plan:
    """Everything about one set of slots that does not change from step to step."""

    slots: tuple[Slot, ...]
    groups: list[_Group]
    dense: list[tuple[int, int]]  # (slot position, offset in the round-1 buffer)
    out_offsets: list[int]  # per slot, in the flat output
    p_buf: Tensor  # round 1: all P's, then the uncompressed values
    q_buf: Tensor  # round 2: all Q's
    total: int  # elements of the flat output


class PowerSGD(Scheme):
    name = "powersgd"

    def __init__(
        self,
        rank: int = 2,
        start_iter: int = 0,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        seed: int = 0,
        batch_same_shape: bool = True,
    ):
        # the approximation rank; ``self.rank`` is the worker's rank (Scheme.bind)
        self.matrix_rank = check_int("rank", rank, minimum=1)
        self.start_iter = check_int("start_iter", start_iter, minimum=0)
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)):
            raise ConfigError(f"min_compression_rate must be a number > 0, got {min_compression_rate!r}")
        if not (math.isfinite(min_compression_rate) and min_compression_rate > 0):
            raise ConfigError(f"min_compression_rate must be a finite number > 0, got {min_compression_rate!r}")
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.seed = check_int("seed", seed, minimum=0)
        self.batch_same_shape = check_bool("batch_same_shape", batch_same_shape)
        # per slot: "q" (m, r) and "error" (n, m), views into a plan's stacked Q's and errors
        self.state = SlotState("powersgd", ["q", "error"], check=self._fits)
        self._plans: dict[tuple[tuple[Slot, ...], torch.device], _Plan] = {}
        self._used_plans: set[tuple[tuple[Slot, ...], torch.device]] = set()  # since the last retain()
        self._warned_shapeless = False

    def params(self) -> dict[str, Any]:
        return {
            "rank": self.matrix_rank,
            "start_iter": self.start_iter,
            "min_compression_rate": self.min_compression_rate,
            "error_feedback": self.error_feedback,
            "seed": self.seed,
            "batch_same_shape": self.batch_same_shape,
        }

    # -- which tensors are compressed -------------------------------------------------------------------------

    def approximation_rank(self, slot: Slot) -> int | None:
        """r for a slot that is compressed, None for one sent as it is."""
        shape = matrix_shape(slot)
        if shape is None:
            return None
        n, m = shape
        r = min(self.matrix_rank, n, m)
        if (n + m) * r * self.min_compression_rate >= n * m:
            return None
        return r

    def check_slots(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            if slot.shape is not None and math.prod(slot.shape) != slot.numel:
                raise ConfigError(f"{slot.name}: shape {tuple(slot.shape)} does not hold {slot.numel} elements")

    # -- the rounds ---------------------------------------------------------------------------------------------

    def defers_verdict(self, slots: Sequence[Slot]) -> bool:
        return True  # P and Q have sizes the shapes fix, and no message's data is read on the host

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        if len(slots) != len(tensors):
            raise ConfigError(f"{len(slots)} slots but {len(tensors)} tensors")
        if step < self.start_iter:
            return (yield from self._dense(slots, tensors))
        plan = self._plan(tuple(slots), tensors[0].device)
        return (yield from self._compressed(plan, tensors, step))

    def _dense(self, slots: Sequence[Slot], tensors: Sequence[Tensor]) -> Rounds:
        """Warm-up: one uncompressed allreduce of every tensor; no error is kept."""
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors]).div_(self.world_size)
        summed = yield AllReduce(flat, inplace=True)
        return list(torch.split(summed, [s.numel for s in slots]))

    def _compressed(self, plan: _Plan, tensors: Sequence[Tensor], step: int) -> Rounds:
        self._adopt(plan, step)
        world = self.world_size
        # round 1: P = M Q for every compressed matrix, then the uncompressed values, divided by W
        for g in plan.groups:
            rows = g.m_buf.view(g.batch, -1)
            for b, i in enumerate(g.members):
                rows[b].copy_(tensors[i].reshape(-1))
            if g.error is not None:
                g.m_buf.add_(g.error)
            self._prepare_q(plan, g, step)
            torch.bmm(g.m_buf, g.q_state, out=_view(plan.p_buf, g.p_offset, (g.batch, g.n, g.r)))
        for i, offset in plan.dense:
            plan.p_buf[offset : offset + plan.slots[i].numel].copy_(tensors[i].reshape(-1))
        plan.p_buf.div_(world)
        p_mean = yield AllReduce(plan.p_buf, inplace=True)

        # round 2: Q = Mᵀ P̂ with P̂ the orthonormalised mean P, divided by W
        p_hats = []
        for g in plan.groups:
            p_hat = orthogonalise_(_view(p_mean, g.p_offset, (g.batch, g.n, g.r)))
            torch.bmm(g.m_buf.transpose(1, 2), p_hat, out=_view(plan.q_buf, g.q_offset, (g.batch, g.m, g.r)))
            p_hats.append(p_hat)
        out = torch.empty(plan.total, dtype=torch.float32, device=plan.p_buf.device)
        if plan.groups:
            plan.q_buf.div_(world)
            q_mean = yield AllReduce(plan.q_buf, inplace=True)
            for g, p_hat in zip(plan.groups, p_hats):
                q_bar = _view(q_mean, g.q_offset, (g.batch, g.m, g.r))
                update = _view(out, g.out_offset, (g.batch, g.n, g.m))
                torch.bmm(p_hat, q_bar.transpose(1, 2), out=update)
                if g.error is not None:
                    torch.sub(g.m_buf, update, out=g.error)
                g.q_state.copy_(q_bar)
        for i, offset in plan.dense:
            numel, out_offset = plan.slots[i].numel, plan.out_offsets[i]
            out[out_offset : out_offset + numel].copy_(p_mean[offset : offset + numel])
        return [out[o : o + s.numel] for s, o in zip(plan.slots, plan.out_offsets)]

    def _prepare_q(self, plan: _Plan, g: _Group, step: int) -> None:
        """Normalise Q's columns; refill a column that is exactly zero from the shared seed.

        The host path looks whether a column is zero and draws a fresh Q (on the CPU, from the matrix's own seed)
        only for a matrix that has one. The device path reads nothing back: it draws one fresh (B, m, r) block for
        the group every step, on the device, from the seed of the step and the group's first matrix, and puts it
        where a column is zero (``torch.where``), so the refill's numbers differ from the host path's (the same
        on every worker, as the host path's are); a Q without a zero column is the same on both paths."""
        dead = g.q_state.abs().amax(dim=1, keepdim=True) == 0  # (B, 1, r)
        if not host_path(g.q_state):
            first = plan.slots[g.members[0]]
            gen = shared_generator(self.seed, step, first.index, g.q_state.device, salt="powersgd-q-group")
            fresh = torch.randn(g.q_state.shape, generator=gen, dtype=torch.float32, device=g.q_state.device)
            torch.where(dead, fresh, g.q_state, out=g.q_state)
        elif bool(dead.any()):
            for b in torch.nonzero(dead.reshape(g.batch, g.r).any(dim=1)).reshape(-1).tolist():
                fresh = self._fresh_q(plan.slots[g.members[b]], g.m, g.r, step).to(g.q_state.device)
                g.q_state[b] = torch.where(dead[b], fresh, g.q_state[b])
        _normalise_columns_(g.q_state)  # scaled first, so a Q of any finite magnitude keeps its direction

    def _fresh_q(self, slot: Slot, m: int, r: int, step: int) -> Tensor:
        gen = shared_generator(self.seed, step, slot.index, torch.device("cpu"), salt="powersgd-q")
        return torch.randn(m, r, generator=gen, dtype=torch.float32)

    # -- buffers and state ---------------------------------------------------------------------------------------

    def _plan(self, slots: tuple[Slot, ...], device: torch.device) -> _Plan:
        self._used_plans.add((slots, device))
        plan = self._plans.get((slots, device))
        if plan is None:
            self.check_slots(slots)
            plan = self._build_plan(slots, device)
            self._plans[(slots, device)] = plan
        return plan

    def _build_plan(self, slots: tuple[Slot, ...], device: torch.device) -> _Plan:
        shapeless = [s.name for s in slots if s.shape is None and s.numel > 1]
        if shapeless and not self._warned_shapeless:
            self._warned_shapeless = True
            warnings.warn(
                f"powersgd: slot(s) {', '.join(shapeless)} have no shape (granularity 'model' or a flat bucket): "
                "they are sent uncompressed; use one slot per parameter to compress them",
                stacklevel=4,
            )
        by_shape: dict[tuple[int, ...], list[int]] = {}
        dense: list[int] = []
        for i, slot in enumerate(slots):
            r = self.approximation_rank(slot)
            if r is None:
                dense.append(i)
                continue
            n, m = matrix_shape(slot)  # type: ignore[misc]
            key = (n, m, r) if self.batch_same_shape else (n, m, r, i)
            by_shape.setdefault(key, []).append(i)

        groups: list[_Group] = []
        p_size = q_size = out_size = 0
        out_offsets = [0] * len(slots)
        for (n, m, r, *_), members in by_shape.items():
            batch = len(members)
            q_state = torch.zeros(batch, m, r, dtype=torch.float32, device=device)
            error = torch.zeros(batch, n, m, dtype=torch.float32, device=device) if self.error_feedback else None
            g = _Group(
                n=n, m=m, r=r, members=members,
                p_offset=p_size, q_offset=q_size, out_offset=out_size,
                m_buf=torch.empty(batch, n, m, dtype=torch.float32, device=device), q_state=q_state, error=error,
            )
            g.q_views = [q_state[b] for b in range(batch)]
            g.e_views = [error[b] for b in range(batch)] if error is not None else []
            for b, i in enumerate(members):
                out_offsets[i] = out_size + b * n * m
            p_size += batch * n * r
            q_size += batch * m * r
            out_size += batch * n * m
            groups.append(g)
        dense_offsets = []
        for i in dense:
            dense_offsets.append((i, p_size))
            out_offsets[i] = out_size
            p_size += slots[i].numel
            out_size += slots[i].numel
        return _Plan(
            slots=slots, groups=groups, dense=dense_offsets, out_offsets=out_offsets,
            p_buf=torch.empty(p_size, dtype=torch.float32, device=device),
            q_buf=torch.empty(q_size, dtype=torch.float32, device=device),
            total=out_size,
        )

    def _adopt(self, plan: _Plan, step: int) -> None:
        """Make the plan's buffers hold the current state (loaded, or kept by another plan) or a fresh one."""
        for g in plan.groups:
            for b, i in enumerate(g.members):
                slot = plan.slots[i]
                self._hold("q", slot, g.q_views[b], lambda: self._fresh_q(slot, g.m, g.r, step))
                if g.error is not None:
                    self._hold("error", slot, g.e_views[b], None)

    def _hold(self, field: str, slot: Slot, view: Tensor, fresh) -> None:
        """Put the slot's state of ``field`` into ``view`` (a plan's buffer) and keep the view as the state."""
        held = self.state.get(field, slot)
        if held is view:
            return
        if held is not None and held.shape == view.shape:
            view.copy_(held)
        elif fresh is None:
            view.zero_()
        else:  # none yet, or one of another matrix shape of the same size (the slot was viewed otherwise)
            view.copy_(fresh())
        self.state.put(field, slot, view)

    def retain(self, slots: Sequence[Slot]) -> None:
        self.state.retain(slots)
        for s in slots:  # the same name and size as another shape: another matrix, start afresh
            q, shape = self.state.get("q", s), matrix_shape(s)
            if q is not None and (shape is None or q.shape[0] != shape[1]):
                self.state.drop(s)
        wanted = set(slots)
        # a plan (buffers for one slot list, e.g. one DDP bucket) survives only if it was used since the last
        # retain: DDP's single first-pass bucket holds live slots but never comes back after the rebuild
        used = self._used_plans
        self._plans = {k: p for k, p in self._plans.items() if set(k[0]) <= wanted and (k in used or not used)}
        self._used_plans = set()

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def restore_where(self, snapshot: dict[str, Any], bad: Tensor) -> bool:
        return self.state.restore_where(snapshot, bad)  # in place: the plans' buffers keep holding the state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and state.get("error") and not self.error_feedback:
            raise ConfigError("the checkpoint holds PowerSGD errors but this PowerSGD runs without error feedback")
        self.state.load_state_dict(state)

    def _fits(self, field: str, key: str, numel: int, t: Tensor) -> str | None:
        """The shape check of a loaded Q (m, r) or error (n, m) of a slot of ``numel`` elements."""
        if t.dim() != 2 or t.shape[0] == 0 or numel % t.shape[0 if field == "q" else 1]:
            return f"shape {tuple(t.shape)}, which is no Q or error of a matrix of {numel} elements"
        if field == "error":
            return None if t.numel() == numel else f"shape {tuple(t.shape)}, expected {numel} elements"
        m = t.shape[0]
        r = min(self.matrix_rank, numel // m, m)
        if t.shape[1] != r:
            return (f"shape {tuple(t.shape)}, expected ({m}, {r}) for rank {self.matrix_rank} (was the checkpoint "
                    "made with another rank?)")  # fmt: skip
        return None


def _view(flat: Tensor, offset: int, shape: tuple[int, ...]) -> Tensor:
    return flat[offset : offset + math.prod(shape)].view(shape)
