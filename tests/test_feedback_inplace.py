"""Error feedback and momentum correction update their state in place, bit for bit as the formulas do.

``ErrorFeedback`` and ``MomentumCorrection`` keep one buffer per slot and update it in place instead of
building a = x + r, D(m) and a - D(m) afresh every step (gradcomp.feedback). These tests hold them to the
straightforward out-of-place formulas over several steps, with exact (bitwise: -0.0 != +0.0, NaN payloads)
equality of messages and residuals, for every registered compressor that error feedback accepts, and check
that the buffers stay where they are and that a step allocates nothing d-sized beyond the message.

At the end, the memory of the gathered exchange that the race flagged: QSGD decodes chunk by chunk, and
SingleRound adds one decoded buffer at a time and drops its messages once encoded, with the same results.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import gradcomp
from gradcomp import ConfigError, ErrorFeedback, GradientExchange, SimulatedCluster, Slot
from gradcomp.compressors.base import Compressor, accumulate, bind_worker, subtract_sent
from gradcomp.compressors.natural import RandomDithering
from gradcomp.errors import NonFiniteGradientError
from gradcomp.feedback import MomentumCorrection
from gradcomp.registry import available, compressor_class
from gradcomp.schemes.single_round import aggregate_buffers, decode_slots, encode_slots


def _registered_with_feedback() -> list[str]:
    """Every registered single compressor that ``make(..., error_feedback=True)`` accepts (not dgc: it keeps its
    own residual)."""
    names = []
    for name in available():
        if not issubclass(compressor_class(name), Compressor):
            continue
        try:
            gradcomp.make(name, error_feedback=True)
        except ConfigError:
            continue
        names.append(name)
    return names


REGISTERED = _registered_with_feedback()
# parameters and compositions beyond the defaults: the paths error feedback takes differ by message form
EXTRA = [
    ("topk", {"density": 0.05, "positions": "golomb"}),
    ("topk", {"k": 7}),
    ("threshold", {"threshold": 0.5}),
    ("randomk", {"density": 0.3, "seed": 3}),
    ("randomk", {"density": 0.6, "scale": True}),  # omega < 1: accepted, and its values are scaled
    ("randomblock", {"density": 0.7, "scale": True}),
    ("sbc", {"density": 0.05, "positions": "fixed"}),
    ("stc", {"density": 0.001}),
    ("qsgd", {"coding": "elias", "levels": 3}),
    ("random_dithering", {"norm": "inf", "norm_codec": "cnat"}),
    ("topk+cnat", {"density": 0.01}),
    ("topk+fp16", {"density": 0.01}),
    ("randomk+cnat", {"density": 0.01}),
    ("random_dithering+cnat", {}),
]
CONFIGS = [(name, {}) for name in REGISTERED] + EXTRA
IDS = [name + "".join(f"-{k}={v}" for k, v in p.items()) for name, p in CONFIGS]


def _inputs(d: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Heavy-tailed steps, one with exact ties, one with signed zeros, one with a huge dynamic range."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-d // 512)
    scale = torch.exp(1.5 * torch.randn(blocks, generator=g)).repeat_interleave(512)[:d]
    xs = [torch.randn(d, generator=g) * scale for _ in range(steps)]
    xs[1] = torch.randint(-4, 5, (d,), generator=g).to(torch.float32) * 0.5  # ties, zeros, exact cancellation
    zeros = torch.where(torch.rand(d, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
    xs[2] = torch.where(torch.rand(d, generator=g) < 0.01, xs[2], zeros)  # mostly +0.0 / -0.0
    if steps > 3:
        xs[3] = xs[3] * torch.logspace(-20, 20, d)  # beyond fp16's range; tiny entries
    return xs


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


class ReferenceFeedback:
    """The formulas, out of place: a = x + r, m = C(a), r = a - D(m) (gradcomp's code before it went in place)."""

    def __init__(self, inner: Compressor):
        self.inner, self.residual = inner, None

    def compress(self, x: torch.Tensor, slot: Slot, step: int):
        wanted = x.reshape(-1).to(torch.float32)
        if self.residual is not None:
            wanted = wanted + self.residual
        fields = self.inner.compress(wanted, slot, step)
        self.residual = wanted - self.inner.decompress(fields, slot, step)
        return fields


class ReferenceMomentum:
    """Momentum correction (and masking) out of place, as ``MomentumCorrection`` computed it before."""

    def __init__(self, inner: Compressor, momentum: float, masking: bool):
        self.inner, self.momentum, self.masking = inner, momentum, masking
        self.u = self.v = None

    def compress(self, x: torch.Tensor, slot: Slot, step: int):
        g = x.reshape(-1).to(torch.float32)
        u = g.clone() if self.u is None else self.u.mul_(self.momentum).add_(g)
        v = u.clone() if self.v is None else self.v + u
        fields = self.inner.compress(v, slot, step)
        sent = self.inner.decompress(fields, slot, step)
        if self.masking:
            u.masked_fill_(sent != 0, 0.0)
        self.u, self.v = u, v - sent
        return fields


def _pair(name: str, params: dict, worker: int = 1) -> tuple[ErrorFeedback, ReferenceFeedback]:
    ef = gradcomp.make(name, error_feedback=True, **params)
    assert isinstance(ef, ErrorFeedback)
    reference = ReferenceFeedback(gradcomp.make(name, error_feedback=False, **params))
    bind_worker(ef, worker)
    bind_worker(reference.inner, worker)
    return ef, reference


def _same_up_to_nan_sign(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, except that a NaN may carry either sign bit: the NaN an invalid operation (inf − inf, or
    x − NaN) yields, and its sign, are not fixed by IEEE-754, and the compiled sign kernels' subtraction
    (gradcomp.kernels.sign_kernel) gives the other sign than torch's fused gather-and-subtract does."""
    if not a.is_floating_point():
        return _same_bits(a, b)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    size = a.element_size()
    ints, magnitude = {2: torch.int16, 4: torch.int32, 8: torch.int64}[size], (1 << (8 * size - 1)) - 1
    ai, bi = a.contiguous().view(ints).reshape(-1), b.contiguous().view(ints).reshape(-1)
    nan = nan.reshape(-1)
    return torch.equal((ai & magnitude)[nan], (bi & magnitude)[nan]) and torch.equal(ai[~nan], bi[~nan])


def _check_same(fields, expected, residual, reference_residual, what: str, nan_sign: bool = False) -> None:
    same = _same_up_to_nan_sign if nan_sign else _same_bits
    assert len(fields) == len(expected), what
    for i, (f, e) in enumerate(zip(fields, expected)):
        assert same(f, e), f"{what}: message field {i} differs"
    assert same(residual, reference_residual), (
        f"{what}: residual differs in {int((residual.view(torch.int32) != reference_residual.view(torch.int32)).sum())}"
        " entries"
    )


def test_every_compressor_error_feedback_accepts_is_covered():
    assert {"topk", "sbc", "stc", "efsignsgd", "onebit", "none", "fp16", "qsgd", "cnat"} <= set(REGISTERED)
    assert "dgc" not in REGISTERED


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("d", [1003, 70_001])
def test_error_feedback_matches_the_out_of_place_formula_bit_for_bit(name, params, d):
    ef, reference = _pair(name, params)
    slots = [Slot("layer.weight", 3, d), Slot("layer.bias", 4, 37)]
    xs = _inputs(d, 5, seed=d)
    for step, x in enumerate(xs):
        for slot in slots:
            given = x[: slot.numel] if slot.numel < d else x
            before = given.clone()
            fields = ef.compress(given, slot, step)
            expected = reference.compress(given, slot, step) if slot.numel == d else None
            assert _same_bits(given, before), "the input must not be modified"
            residual = ef.residuals[f"{slot.name}#{slot.numel}"]
            for f in fields:  # no field may follow the residual: it changes in place next step
                assert not f.numel() or f.untyped_storage().data_ptr() != residual.untyped_storage().data_ptr()
            if expected is not None:
                _check_same(fields, expected, residual, reference.residual, f"{name} step {step}")


@pytest.mark.parametrize("name", ["sbc", "stc", "efsignsgd", "onebit", "signsgd", "signum", "topk"])
def test_error_feedback_matches_on_large_tensors(name):
    """Above the sign packer's 2^20-entry chunk and on the sampled top-k paths (d >= 2^16, k <= d/64)."""
    d = (1 << 20) + 4099
    ef, reference = _pair(name, {})
    slot = Slot("w", 0, d)
    for step, x in enumerate(_inputs(d, 4, seed=11)):
        fields, expected = ef.compress(x, slot, step), reference.compress(x, slot, step)
        _check_same(fields, expected, ef.residuals["w#" + str(d)], reference.residual, f"{name} step {step}")


# (efsignsgd and onebit refuse a NaN / Inf to send with NonFiniteGradientError: tests/test_sign.py)
@pytest.mark.parametrize("name", ["topk", "sbc", "stc", "fp16", "none", "randomblock"])
def test_non_finite_entries_match_too(name):
    d = 5000
    ef, reference = _pair(name, {"density": 0.05} if name in ("topk", "sbc", "stc", "randomblock") else {})
    slot = Slot("w", 0, d)
    xs = _inputs(d, 4, seed=5)
    xs[1][::97] = float("inf")
    xs[2][5::89] = float("-inf")
    xs[2][7::101] = float("nan")
    xs[3][7::101] = -float("nan")  # NaN + NaN: which payload survives depends on the order of the operands
    for step, x in enumerate(xs):
        fields, expected = ef.compress(x, slot, step), reference.compress(x, slot, step)
        _check_same(fields, expected, ef.residuals["w#5000"], reference.residual, f"{name} step {step}", nan_sign=True)


def test_a_compressor_that_raises_leaves_no_half_updated_residual():
    ef = gradcomp.make("cnat", error_feedback=True)
    slot = Slot("w", 0, 100)
    ef.compress(torch.randn(100), slot, 0)
    bad = torch.randn(100)
    bad[3] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        ef.compress(bad, slot, 1)
    assert "w#100" not in ef.residuals  # dropped: it held x + r, half a step
    x = torch.randn(100)
    fresh = gradcomp.make("cnat", error_feedback=True)
    for a, b in zip(ef.compress(x, slot, 2), fresh.compress(x, slot, 2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("topk", {"k": 20}),
        ("threshold", {"threshold": 1.0}),
        ("randomk", {"density": 0.1}),
        ("randomblock", {"density": 0.1}),
        ("sbc", {"density": 0.05}),
        ("stc", {"density": 0.05}),
        ("none", {}),
        ("fp16", {}),
        ("efsignsgd", {}),
        ("onebit", {}),
        ("qsgd", {}),
        ("topk+fp16", {"density": 0.05}),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_momentum_correction_matches_the_out_of_place_formula_bit_for_bit(name, params, masking):
    d = 4001
    mc = MomentumCorrection(gradcomp.make(name, error_feedback=False, **params), momentum=0.7, masking=masking)
    reference = ReferenceMomentum(gradcomp.make(name, error_feedback=False, **params), 0.7, masking)
    slot = Slot("w", 0, d)
    buffers = None
    for step, x in enumerate(_inputs(d, 5, seed=7)):
        fields, expected = mc.compress(x, slot, step), reference.compress(x, slot, step)
        u, v = mc.velocity["w#4001"], mc.accumulated["w#4001"]
        _check_same(fields, expected, v, reference.v, f"{name} step {step}")
        assert _same_bits(u, reference.u), f"{name} step {step}: velocity differs"
        if buffers is None:
            buffers = (u.data_ptr(), v.data_ptr())
        assert (u.data_ptr(), v.data_ptr()) == buffers, "u and v are updated in place"


@pytest.mark.parametrize("name", ["topk", "sbc", "stc", "efsignsgd", "onebit", "fp16", "qsgd", "randomk"])
def test_the_residual_buffer_stays_where_it_is(name):
    ef = gradcomp.make(name, error_feedback=True)
    slot = Slot("w", 0, 20_000)
    pointers = set()
    for step, x in enumerate(_inputs(20_000, 5, seed=1)):
        ef.compress(x, slot, step)
        pointers.add(ef.residuals["w#20000"].data_ptr())
    assert len(pointers) == 1


def test_state_dict_is_a_snapshot_and_loading_copies():
    ef = gradcomp.make("efsignsgd")
    slot = Slot("w", 0, 3000)
    xs = _inputs(3000, 4, seed=2)
    ef.compress(xs[0], slot, 0)
    state = ef.state_dict()
    saved = state["residuals"]["w#3000"].clone()
    ef.compress(xs[1], slot, 1)
    assert torch.equal(state["residuals"]["w#3000"], saved)  # the in-place step did not reach the snapshot
    other = gradcomp.make("efsignsgd")
    other.load_state_dict(state)
    other.compress(xs[1], slot, 1)
    assert torch.equal(state["residuals"]["w#3000"], saved)  # nor did the loaded copy's step
    assert torch.equal(other.residuals["w#3000"], ef.residuals["w#3000"])


def test_a_message_that_is_a_view_of_its_input_is_copied_before_the_residual_changes():
    """Uncompressed fp32 returns its input itself: with feedback the message must still be what was sent."""
    ef = gradcomp.make("none", error_feedback=True)
    slot = Slot("w", 0, 64)
    x = torch.randn(64)
    fields = ef.compress(x, slot, 0)
    assert torch.equal(fields[0], x)
    assert not ef.residuals["w#64"].any()  # everything was sent


class _NewStorages(TorchDispatchMode):
    """Calls ``self._new(func, storage)`` once for every storage a torch op returns that none of its inputs had."""

    def _new(self, func, storage) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                storage = t.untyped_storage()
                given.add(storage.data_ptr())
                self._new(func, storage)
        return out


class _Allocations(_NewStorages):
    """Records the byte size of every tensor a torch op returns in storage none of its inputs had."""

    def __init__(self):
        super().__init__()
        self.allocated: list[tuple[str, int, int]] = []

    def _new(self, func, storage) -> None:
        self.allocated.append((str(func), storage.nbytes(), storage.data_ptr()))


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("topk", {}),
        ("threshold", {"threshold": 2.0}),
        ("randomk", {}),
        ("randomblock", {}),
        ("sbc", {}),
        ("stc", {}),
        ("efsignsgd", {}),
        ("onebit", {}),
        ("signsgd", {}),
        ("fp16", {}),
        ("bf16", {}),
        ("topk+fp16", {}),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_a_step_allocates_nothing_gradient_sized_beyond_the_message(name, params):
    """After the first step (which creates the residual), a step's torch ops allocate no tensor of d/2 bytes
    or more except the message's own fields: a, D(m) and a - D(m) are no longer built (4·d bytes each)."""
    d = 1 << 18
    ef = gradcomp.make(name, error_feedback=True, **params)
    slot = Slot("w", 0, d)
    xs = _inputs(d, 4, seed=9)
    ef.compress(xs[0], slot, 0)
    ef.compress(xs[1], slot, 1)  # reusable scratch buffers exist from here on
    with _Allocations() as seen:
        fields = ef.compress(xs[2], slot, 2)
    message = {f.untyped_storage().data_ptr() for f in fields}
    large = [(op, n) for op, n, ptr in seen.allocated if n >= d // 2 and ptr not in message]
    assert not large, f"{name}: gradient-sized temporaries {large}"


def test_subtract_sent_equals_subtracting_the_decompressed_message():
    """The public helper on its own, for each message form, including a subclass that decodes differently."""

    class Doubled(type(gradcomp.make("topk", density=0.1))):
        def decompress(self, fields, slot, step):
            return 2 * super().decompress(fields, slot, step)

    d = 3000
    slot = Slot("w", 2, d)
    x = _inputs(d, 3, seed=4)[0]
    for compressor in [
        gradcomp.make("topk", density=0.1),
        gradcomp.make("sbc", density=0.1),
        gradcomp.make("onebit"),
        gradcomp.make("bf16"),
        gradcomp.make("terngrad"),
        Doubled(density=0.1),
    ]:
        fields = compressor.compress(x, slot, 5)
        out = x.clone() * 3
        expected = out - compressor.decompress(fields, slot, 5)
        subtract_sent(compressor, fields, slot, 5, out)
        assert _same_bits(out, expected), compressor


# ------------------------------------------------------------------------------------------------------------
# Memory of the gathered exchange: QSGD's decoding and SingleRound's aggregation (the race's "extra vs DDP").


class _LiveBytes(_NewStorages):
    """The high-water mark of the bytes held by tensors that torch ops allocate while the mode is on."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def _new(self, func, storage) -> None:
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, storage.nbytes())


def _old_aggregate(compressor, slots, buffers, step):
    """SingleRound's aggregation as it was: every buffer decoded first, then each slot summed in rank order."""
    decoded = [decode_slots(compressor, slots, b) for b in buffers]
    results = []
    for i, slot in enumerate(slots):
        total = torch.zeros(slot.numel)
        for per_worker in decoded:
            accumulate(compressor, per_worker[i], slot, step, total)
        if not bool(torch.isfinite(total).all()):
            total.zero_()
            for per_worker in decoded:
                one = torch.zeros_like(total)
                accumulate(compressor, per_worker[i], slot, step, one)
                total += one.div_(len(decoded))
            results.append(compressor.aggregate(total, 1))
        else:
            results.append(compressor.aggregate(total, len(decoded)))
    return results


def _worker_buffers(name: str, params: dict, slots: list[Slot], workers: int, scale: float = 1.0):
    buffers = []
    for rank in range(workers):
        compressor = gradcomp.make(name, **params)
        bind_worker(compressor, rank)
        g = torch.Generator().manual_seed(100 + rank)
        messages = [compressor.compress(torch.randn(s.numel, generator=g) * scale, s, 3) for s in slots]
        buffers.append(encode_slots(compressor, slots, messages))
    return buffers


@pytest.mark.parametrize(
    ("name", "params", "scale"),
    [
        ("qsgd", {}, 1.0),
        ("qsgd", {"coding": "elias", "levels": 3}, 1.0),
        ("topk", {"density": 0.05}, 1.0),
        ("signsgd", {}, 1.0),
        ("efsignsgd", {"error_feedback": False}, 1.0),
        ("none", {}, 5e37),  # sums of four overflow here and there: the divided-first path
    ],
    ids=["qsgd", "qsgd-elias", "topk", "signsgd-vote", "efsignsgd", "none-overflow"],
)
def test_aggregate_buffers_matches_decoding_every_buffer_first(name, params, scale):
    slots = [Slot("a", 0, 300_001), Slot("b", 1, 777)]
    buffers = _worker_buffers(name, params, slots, 4, scale)
    compressor = gradcomp.make(name, **params)
    new = aggregate_buffers(compressor, slots, buffers, 3, torch.device("cpu"))
    old = _old_aggregate(compressor, slots, buffers, 3)
    for a, b in zip(new, old):
        assert _same_bits(a, b)
    if name == "none":
        assert bool(torch.isfinite(new[0]).all())


@pytest.mark.parametrize("params", [{}, {"levels": 7}, {"coding": "elias"}, {"coding": "elias", "levels": 1}])
def test_qsgd_decodes_as_random_dithering_does(params):
    """QSGD decodes chunk by chunk with random dithering's own decompress: the same values, and accumulate adds
    exactly them; both codings carry the same codes (the packed message is the reference for the elias one)."""
    d = 300_007  # three chunks, the last one partial
    slot = Slot("w", 5, d)
    x = _inputs(d, 3, seed=3)[0]
    q, packed = gradcomp.make("qsgd", **params), gradcomp.make("qsgd", **{**params, "coding": "packed"})
    bind_worker(q, 2)
    bind_worker(packed, 2)
    fields, reference_fields = q.compress(x, slot, 4), packed.compress(x, slot, 4)
    expected = RandomDithering.decompress(packed, reference_fields, slot, 4)  # the parent's whole-tensor decode
    assert _same_bits(q.decompress(fields, slot, 4), expected)
    out = torch.randn(d)
    wanted = out + expected
    q.accumulate(fields, slot, 4, out)
    assert _same_bits(out, wanted)


def test_gathered_qsgd_aggregation_holds_one_decoded_message_at_a_time():
    """Four workers' QSGD buffers of a 1M-entry slot: decoding all of them first (int64 codes, two fp32
    gradients each) and decoding each through d-sized temporaries peaked at 16 fp32 gradients; one decoded
    message (with the container's unpacking), the sum and chunk-sized scratch remain: 4."""
    d = 1 << 20
    slots = [Slot("bucket", 0, d)]
    buffers = _worker_buffers("qsgd", {}, slots, 4)
    compressor = gradcomp.make("qsgd")
    aggregate_buffers(compressor, slots, buffers, 3, torch.device("cpu"))  # warm-up
    with _LiveBytes() as seen:
        result = aggregate_buffers(compressor, slots, buffers, 3, torch.device("cpu"))
    del result
    assert seen.peak < 5 * (4 * d), f"peak {seen.peak / (4 * d):.2f} fp32 gradients"


def test_gathered_exchange_drops_its_messages_once_encoded():
    """The allgather round encodes this worker's messages and lets them go: with QSGD (int64 codes, two fp32
    gradients) a one-worker exchange peaks at 4.5 fp32 gradients (one decoded message, the sum, the buffers),
    where keeping the messages alive and decoding through d-sized temporaries peaked at 12.5."""
    d = 1 << 20
    slot = Slot("bucket", 0, d)
    x = torch.randn(d)
    with SimulatedCluster(1) as cluster:
        exchange = GradientExchange(gradcomp.make("qsgd"), cluster.transports[0], topology="allgather")
        cluster.run(lambda transport: exchange.exchange([slot], [x], 0))  # warm-up: reusable scratch exists

        def step(transport):
            with _LiveBytes() as seen:
                out = exchange.exchange([slot], [x], 1)
            del out
            return seen.peak

        (peak,) = cluster.run(step)
    assert peak < 5 * (4 * d), f"peak {peak / (4 * d):.2f} fp32 gradients"


@pytest.mark.parametrize("name", ["efsignsgd", "onebit"])
def test_the_chunked_sign_methods_add_the_residual_chunk_by_chunk(name, monkeypatch):
    """Their compress_sum hands r += x to the chunk loop (one pass fewer over memory); the bits are those of
    the out-of-place formula (the tests above), and a subclass with its own compress gets the generic route."""
    from gradcomp.compressors import sign

    calls = []
    chunked = sign._signs_and_sums

    def spy(flat, maps, signs=True, count=False, before=None):
        calls.append(before is not None)
        return chunked(flat, maps, signs=signs, count=count, before=before)

    monkeypatch.setattr(sign, "_signs_and_sums", spy)
    d = (1 << 20) + 4099
    slot, xs = Slot("w", 0, d), _inputs(d, 3, seed=3)
    ef = gradcomp.make(name, error_feedback=True)
    ef.compress(xs[0], slot, 0)  # the first step copies x into a new residual: nothing to add
    ef.compress(xs[1], slot, 1)
    assert calls == [False, True]

    class OwnCompress(type(ef.inner)):
        def compress(self, x, slot, step):
            return super().compress(x, slot, step)

    calls.clear()
    own = gradcomp.ErrorFeedback(OwnCompress())
    own.compress(xs[0], slot, 0)
    own.compress(xs[1], slot, 1)
    assert calls == [False, False]
