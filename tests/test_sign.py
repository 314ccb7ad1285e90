"""The sign family: signsgd, signum, efsignsgd, onebit (1 bit per coordinate, bit-packed)."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from roundtrip import f32_bits, round_trip

import gradcomp
from gradcomp import ConfigError, NonFiniteGradientError, Slot, WireError
from gradcomp.compressors import sign
from gradcomp.compressors.sign import EFSignSGD, OneBit, SignSGD, Signum, pack_signs, packed_count, unpack_signs
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.run.data import load_dataset, shard_indices
from gradcomp.experiments.run.models import build_model
from gradcomp.schemes.single_round import aggregate_buffers, decode_slots, encode_slots
from gradcomp.transport.dist import DistTransport
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES, checksum64, decode, encode, pack_bool

NAMES = ["signsgd", "signum", "efsignsgd", "onebit"]
VOTING = ["signsgd", "signum"]
FLOATS = {"signsgd": 0, "signum": 0, "efsignsgd": 1, "onebit": 2}  # fp32 values after the sign bits
SIZES = [0, 1, 7, 8, 9, 63, 64, 65, 1000, 1001]


def bare(name: str, **params):
    return gradcomp.make(name, error_feedback=False, **params)


def vectors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "normal": torch.randn(1001, generator=g),
        "zeros": torch.zeros(13),
        "neg-zeros": -torch.zeros(9),
        "all-negative": -torch.rand(17, generator=g) - 0.1,
        "all-positive": torch.rand(16, generator=g) + 0.1,
        "single": torch.tensor([-3.5]),
        "empty": torch.zeros(0),
        "huge": torch.tensor([3.0e38, 3.3e38, -3.4e38, 1e-45, -1e-45, 0.0, -0.0, 2.5]),
        "tiny": torch.tensor([1e-45, -1e-45, 1e-40, -2e-40, 1e-38]),
    }


def negative(x: torch.Tensor, step: int = 0) -> torch.Tensor:
    """The documented sign convention: 0 and -0.0 are + (pack_signs, efsignsgd and onebit always; the majority vote's
    signsgd and signum on even steps), − for the majority vote on odd steps."""
    return x <= 0 if step % 2 else x < 0


# ------------------------------------------------------------------------------------------------ packing


@pytest.mark.parametrize("d", SIZES + [10_007])
def test_pack_signs_is_pack_bool_of_the_negative_mask(d):
    x = torch.randn(d, generator=torch.Generator().manual_seed(d))
    x[::7] = 0.0
    x[1::11] = -0.0
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_count(d) == math.ceil(d / 8)
    assert torch.equal(packed, pack_bool(negative(x)))
    assert torch.equal(unpack_signs(packed, d), torch.where(negative(x), -1.0, 1.0))


@pytest.mark.parametrize("name", NAMES)
def test_several_chunks(name):
    # packing, the sums and accumulate work through chunks of 2^20 entries: cross two boundaries
    d = 2 * (1 << 20) + 13
    x = torch.randn(d, generator=torch.Generator().manual_seed(9))
    x[(1 << 20) - 3 : (1 << 20) + 3] = torch.tensor([-1.0, 0.0, -2.0, 3.0, -0.0, -4.0])
    c = bare(name)
    slot = Slot("big", 0, d)
    out = round_trip(c, x, slot)
    assert torch.equal(c.compress(x, slot, 2)[0], pack_bool(negative(x)))
    odd = 1 if name in VOTING else 0  # efsignsgd and onebit send a zero as + on every step
    assert torch.equal(bare(name).compress(x, slot, 1)[0], pack_bool(negative(x, odd)))
    xd = x.double()
    if name == "efsignsgd":
        assert out[0].abs().item() == pytest.approx(float(xd.abs().mean()), rel=1e-6)
    if name == "onebit":
        assert out[x >= 0][0].item() == pytest.approx(float(xd[x >= 0].mean()), rel=1e-6)
        assert out[x < 0][0].item() == pytest.approx(float(xd[x < 0].mean()), rel=1e-6)


def test_accumulate_into_a_non_contiguous_tensor():
    c = bare("onebit")
    slot = Slot("w", 0, 12)
    x = torch.randn(12)
    fields = c.compress(x, slot, 0)
    out = torch.ones(4, 3).t()  # (3, 4), not contiguous
    c.accumulate(fields, slot, 0, out)
    assert torch.equal(out.reshape(-1), 1.0 + c.decompress(fields, slot, 0))


def test_pack_signs_bit_order_by_hand():
    # entries 0 and 9 negative: byte 0 = 0b00000001, byte 1 = 0b00000010; entry 3 is -0.0 (counted as +)
    x = torch.tensor([-1.0, 2, 3, -0.0, 5, 6, 7, 8, 9, -10])
    assert pack_signs(x).tolist() == [1, 2]
    assert pack_signs(-torch.ones(8)).tolist() == [255]


# --------------------------------------------------------------------------------------------------- wire


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ef", [False, True])
def test_wire_round_trip_bit_exact(name, ef):
    compressor = gradcomp.make(name, error_feedback=ef)
    for i, (label, x) in enumerate(vectors().items()):
        for step in (0, 1, 5):
            if ef and label == "huge" and step == 1 and name in ("efsignsgd", "onebit"):
                # "huge" + its residual overflows float32: refused before anything is sent; the residual is dropped,
                # so step 5 starts afresh
                with pytest.raises(NonFiniteGradientError, match=f"in {label}"):
                    compressor.compress(x, Slot(label, i, x.numel()), step)
                continue
            out = round_trip(compressor, x, Slot(label, i, x.numel()), step)
            assert ef or torch.isfinite(out).all()
            if name in VOTING and not ef and step == 0:
                m = x * (1.0 - 0.9) if name == "signum" else x  # signum's first momentum (1e-45 underflows)
                assert torch.equal(out, torch.where(negative(m), -1.0, 1.0))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("d", SIZES + [100_003])
def test_wire_size_is_one_bit_per_entry_plus_headers(name, d):
    c = bare(name)
    slot = Slot("t", 0, d)
    buf = encode(c.compress(torch.randn(d), slot, 0), c.specs(slot))
    floats = FLOATS[name]
    expected = HEADER_BYTES + SECTION_HEADER_BYTES + math.ceil(d / 8)
    if floats:
        expected += SECTION_HEADER_BYTES + 4 * floats
    assert buf.numel() == expected


def test_many_slots_share_one_container_header():
    c = bare("efsignsgd")
    slots = [Slot(f"s{i}", i, n) for i, n in enumerate([5, 800, 3, 17])]
    messages = [c.compress(torch.randn(s.numel), s, 0) for s in slots]
    buf = encode_slots(c, slots, messages)
    assert buf.numel() == HEADER_BYTES + sum(2 * SECTION_HEADER_BYTES + math.ceil(s.numel / 8) + 4 for s in slots)
    for got, sent in zip(decode_slots(c, slots, buf), messages):
        assert all(torch.equal(a, b) for a, b in zip(got, sent))


def test_wire_bytes_are_the_lsb_first_bitmap():
    x = torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, 1, 1, -1, 1])  # bits 0 and 9
    c = bare("signsgd")
    slot = Slot("x", 0, 11)
    buf = encode(c.compress(x, slot, 0), c.specs(slot))
    data = buf[HEADER_BYTES + SECTION_HEADER_BYTES :].tolist()
    assert data == [0b00000001, 0b00000010]


# ------------------------------------------------------------------------------------------- majority vote


def vote(name: str, rows: list[list[float]], step: int = 0) -> torch.Tensor:
    """Every worker's message encoded, gathered and aggregated as the allgather topology does."""
    workers = [bare(name) for _ in rows]  # one compressor (and momentum) per worker
    slot = Slot("w", 0, len(rows[0]))
    buffers = [encode(c.compress(torch.tensor(r), slot, step), c.specs(slot)) for c, r in zip(workers, rows)]
    return aggregate_buffers(workers[0], [slot], buffers, step, torch.device("cpu"))[0]


@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_majority_vote_three_workers(name):
    rows = [
        [1.0, -2.0, 3.0, -0.5, 0.0, 1e-30],
        [5.0, -1.0, -3.0, 0.5, -1.0, -1.0],
        [-9.0, 4.0, -1.0, 0.5, -1.0, -2.0],
    ]
    # coordinate 0: + + - → +, even though the mean is negative: the vote ignores magnitudes
    assert vote(name, rows).tolist() == [1.0, -1.0, -1.0, 1.0, -1.0, -1.0]


@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_majority_vote_four_workers_tie_gives_zero(name):
    rows = [
        [1.0, 1.0, -1.0, 1.0, 0.0],
        [1.0, -1.0, -1.0, 1.0, 0.0],
        [-1.0, 1.0, -1.0, -1.0, -1.0],
        [1.0, -1.0, -1.0, -1.0, -1.0],
    ]
    # 3:1 → +; 2:2 ties → 0; 0:4 → −; zeros count as + at an even step (so 2:2 in the last coordinate) and as −
    # at an odd one (0:4)
    assert vote(name, rows).tolist() == [1.0, 0.0, -1.0, 0.0, 0.0]
    assert vote(name, rows, step=1).tolist() == [1.0, 0.0, -1.0, 0.0, -1.0]


def test_mean_aggregation_for_scaled_signs():
    for name in ("efsignsgd", "onebit"):
        c = bare(name)
        slot = Slot("w", 0, 4)
        xs = [torch.tensor([1.0, -2.0, 3.0, -4.0]), torch.tensor([-1.0, 2.0, 5.0, 4.0])]
        buffers = [encode(c.compress(x, slot, 0), c.specs(slot)) for x in xs]
        expected = sum(c.decompress(c.compress(x, slot, 0), slot, 0) for x in xs) / 2
        assert torch.equal(aggregate_buffers(c, [slot], buffers, 0, torch.device("cpu"))[0], expected)


def test_vote_through_the_exchange_with_every_gathering_topology():
    rows = torch.tensor([[1.0, -1.0, 2.0], [1.0, 1.0, -2.0], [-1.0, -1.0, -2.0], [1.0, 1.0, 2.0]])
    slot = Slot("w", 0, 3)
    for topology in ("allgather", "ps", "sharded"):
        with gradcomp.SimulatedCluster(4) as cluster:
            out = cluster.run(
                lambda t, topology=topology: gradcomp.GradientExchange(bare("signsgd"), t, topology=topology).exchange(
                    [slot], [rows[t.rank]], 0
                )[0]
            )
        for r in out:
            assert r.tolist() == [1.0, 0.0, 0.0]


def test_allreduce_is_refused():
    with gradcomp.SimulatedCluster(2) as cluster:
        with pytest.raises(ConfigError, match="not summable"):
            cluster.run(lambda t: gradcomp.GradientExchange(bare("signsgd"), t, topology="allreduce"))


# ------------------------------------------------------------------------------------------------- signum


def test_signum_momentum_update_and_sent_sign():
    beta = 0.75  # exact in binary: the expected momenta below are exact
    c = Signum(momentum=beta)
    slot = Slot("w", 0, 3)
    grads = [torch.tensor([1.0, -1.0, 0.5]), torch.tensor([-0.25, 2.0, -4.0]), torch.tensor([-1.0, 0.0, 1.0])]
    m = torch.zeros(3)
    for step, g in enumerate(grads):
        m = beta * m + (1 - beta) * g
        sent = c.decompress(c.compress(g, slot, step), slot, step)
        assert torch.equal(c.state["momentum"]["w#3"], m)
        assert torch.equal(sent, torch.where(m < 0, -1.0, 1.0))
    # step 1, coordinate 0: g = -0.25 but m = 0.75·0.25 − 0.25·0.25 > 0: momentum keeps sending +
    c2 = Signum(momentum=beta)
    c2.compress(grads[0], slot, 0)
    assert c2.decompress(c2.compress(grads[1], slot, 1), slot, 1)[0].item() == 1.0


def test_signum_zero_momentum_is_signsgd():
    x = torch.randn(100)
    slot = Slot("w", 0, 100)
    c = Signum(momentum=0)
    for step in range(3):
        y = x * (step - 1)
        assert torch.equal(c.compress(y, slot, step)[0], SignSGD().compress(y, slot, step)[0])


def test_signum_owns_momentum_and_keeps_it_per_slot():
    assert Signum.owns_momentum and gradcomp.make("signum").owns_momentum
    assert not any(gradcomp.make(n).owns_momentum for n in ("signsgd", "efsignsgd", "onebit"))
    c = Signum()
    a, b = Slot("a", 0, 4), Slot("b", 1, 4)
    c.compress(torch.ones(4), a, 0)
    c.compress(-torch.ones(4), b, 0)
    c.compress(torch.ones(5), Slot("a", 0, 5), 0)  # same name, new size: a fresh buffer
    assert sorted(c.state["momentum"]) == ["a#4", "a#5", "b#4"]
    assert torch.equal(c.state["momentum"]["b#4"], torch.full((4,), -0.1))
    c.retain([b])
    assert sorted(c.state["momentum"]) == ["b#4"]


def test_signum_state_round_trip():
    slot = Slot("w", 0, 50)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(50, generator=g) for _ in range(6)]
    a = Signum(momentum=0.8)
    for step in range(3):
        a.compress(grads[step], slot, step)
    state = a.state_dict()
    b = Signum(momentum=0.8)
    b.load_state_dict(state)
    for step in range(3, 6):
        assert torch.equal(a.compress(grads[step], slot, step)[0], b.compress(grads[step], slot, step)[0])
        assert torch.equal(a.state["momentum"]["w#50"], b.state["momentum"]["w#50"])
    state["momentum"]["w#50"].add_(1.0)  # the state dict is a copy
    assert not torch.equal(state["momentum"]["w#50"], a.state["momentum"]["w#50"])


def test_state_of_the_others():
    for name in ("signsgd", "efsignsgd", "onebit"):
        assert bare(name).state_dict() == {}
        with pytest.raises(ConfigError):
            bare(name).load_state_dict({"momentum": {}})
    c = gradcomp.make("efsignsgd")  # error feedback: the residuals are the state
    slot = Slot("w", 0, 20)
    x = torch.randn(20)
    c.compress(x, slot, 0)
    d = gradcomp.make("efsignsgd")
    d.load_state_dict(c.state_dict())
    assert torch.equal(c.compress(x, slot, 1)[1], d.compress(x, slot, 1)[1])
    assert torch.equal(c.residuals["w#20"], d.residuals["w#20"])


def test_signum_rejects_bad_state():
    with pytest.raises(ConfigError, match="unexpected"):
        Signum().load_state_dict({"residuals": {}})
    with pytest.raises(ConfigError):
        Signum().load_state_dict({"momentum": {"w#3": [1.0, 2.0, 3.0]}})


# ------------------------------------------------------------------------------------- efsignsgd, onebit


def test_efsignsgd_scale_is_the_mean_magnitude():
    x = torch.tensor([1.0, -2.0, 0.0, 5.0, -0.0, -3.0])
    c = EFSignSGD()
    slot = Slot("w", 0, 6)
    packed, scale = c.compress(x, slot, 0)
    assert torch.equal(scale, torch.tensor([11.0 / 6.0]))
    assert torch.equal(c.decompress([packed, scale], slot, 0), torch.where(x < 0, -1.0, 1.0) * scale)


def test_efsignsgd_error_identity():
    d = 1000
    slot = Slot("w", 0, d)
    c = gradcomp.make("efsignsgd")
    assert isinstance(c, gradcomp.ErrorFeedback)
    g = torch.Generator().manual_seed(5)
    residual = torch.zeros(d)
    for step in range(4):
        x = torch.randn(d, generator=g)
        p = x + residual
        fields = c.compress(x, slot, step)
        sent = c.decompress(fields, slot, step)
        pd = p.double()
        assert fields[1].item() == pytest.approx(float(pd.abs().sum() / d), rel=1e-6)
        residual = c.residuals["w#1000"]
        assert torch.equal(residual, p - sent)  # what was not sent is fed back
        # ||p - C(p)||² = ||p||² − ||p||_1² / d: contractive by the factor 1 − ||p||_1² / (d ||p||²)
        assert float((residual.double() ** 2).sum()) == pytest.approx(
            float((pd**2).sum() - pd.abs().sum() ** 2 / d), rel=1e-5
        )


def test_onebit_two_means():
    x = torch.tensor([3.0, -1.0, 0.0, -0.0, 2.0, -5.0, 7.0])
    c = OneBit()
    slot = Slot("w", 0, 7)
    packed, means = c.compress(x, slot, 0)
    assert means.tolist() == [pytest.approx(12.0 / 5.0), -3.0]  # 0 and -0.0 are on the >= 0 side
    out = c.decompress([packed, means], slot, 0)
    assert torch.equal(out, torch.where(x < 0, means[1], means[0]))
    # random data against float64 references
    y = torch.randn(10_001, generator=torch.Generator().manual_seed(1))
    packed, means = c.compress(y, Slot("y", 1, y.numel()), 0)
    yd = y.double()
    assert means[0].item() == pytest.approx(float(yd[y >= 0].mean()), rel=1e-6)
    assert means[1].item() == pytest.approx(float(yd[y < 0].mean()), rel=1e-6)


def test_onebit_one_sided_and_zero_inputs():
    c = OneBit()
    for x, expected in [
        (torch.tensor([1.0, 3.0]), [2.0, 0.0]),
        (torch.tensor([-1.0, -3.0]), [0.0, -2.0]),
        (torch.zeros(5), [0.0, 0.0]),
    ]:
        slot = Slot("w", 0, x.numel())
        fields = c.compress(x, slot, 0)
        assert fields[1].tolist() == expected
        assert torch.equal(round_trip(c, x, slot), torch.where(x < 0, expected[1], expected[0]))


def test_onebit_is_the_best_two_level_reconstruction():
    # the means minimise the squared error of each side: moving either one makes it worse
    y = torch.randn(2000, generator=torch.Generator().manual_seed(2)).double()
    c = OneBit()
    slot = Slot("y", 0, 2000)
    fields = c.compress(y.float(), slot, 0)
    err = float(((c.decompress(fields, slot, 0).double() - y) ** 2).sum())
    for dpos, dneg in [(1e-3, 0), (-1e-3, 0), (0, 1e-3), (0, -1e-3)]:
        shifted = [fields[0], fields[1] + torch.tensor([dpos, dneg])]
        assert float(((c.decompress(shifted, slot, 0).double() - y) ** 2).sum()) > err
    assert err < float((y**2).sum())  # contractive


def test_overflowing_sums_are_recomputed():
    x = torch.full((1000,), 3.0e38)
    x[::2] = -3.0e38
    slot = Slot("w", 0, 1000)
    assert torch.linalg.vector_norm(x, 1).isinf()  # the float32 sum overflows
    assert torch.equal(EFSignSGD().compress(x, slot, 0)[1], torch.tensor([3.0e38]))
    assert torch.equal(OneBit().compress(x, slot, 0)[1], torch.tensor([3.0e38, -3.0e38]))


def test_error_feedback_defaults():
    assert not isinstance(gradcomp.make("signsgd"), gradcomp.ErrorFeedback)
    assert not isinstance(gradcomp.make("signum"), gradcomp.ErrorFeedback)
    assert isinstance(gradcomp.make("efsignsgd"), gradcomp.ErrorFeedback)
    assert isinstance(gradcomp.make("onebit"), gradcomp.ErrorFeedback)
    assert not isinstance(gradcomp.make("onebit", error_feedback=False), gradcomp.ErrorFeedback)


# ------------------------------------------------------------------------------------------- declarations


@pytest.mark.parametrize("name", NAMES)
def test_biased_and_not_summable(name):
    c = bare(name)
    assert c.unbiased is False and c.omega is None and c.summable is False
    # deterministic and biased: the expectation of the output is the output, and it is not the input
    x = torch.tensor([0.5, -0.25, 3.0, 0.0])
    slot = Slot("w", 0, 4)
    out = c.decompress(c.compress(x, slot, 0), slot, 0)
    assert torch.equal(out, c.decompress(c.compress(x, slot, 0), slot, 0)) or name == "signum"
    assert not torch.allclose(out, x)


@pytest.mark.parametrize(
    "name,params",
    [
        ("signum", {"momentum": 1.0}),
        ("signum", {"momentum": -0.1}),
        ("signum", {"momentum": float("nan")}),
        ("signum", {"momentum": True}),
        ("signum", {"momentum": "0.9"}),
        ("signum", {"momentum": None}),
        ("signsgd", {"momentum": 0.9}),
        ("signsgd", {"density": 0.1}),
        ("efsignsgd", {"scale": 2.0}),
        ("onebit", {"threshold": 0.0}),
    ],
)
def test_bad_parameters(name, params):
    with pytest.raises(ConfigError):
        gradcomp.make(name, **params)


def test_registry_and_params():
    for name in NAMES:
        assert name in gradcomp.available()
    assert gradcomp.make("signum", momentum=0.5).params() == {"momentum": 0.5}
    assert gradcomp.make("signum").params() == {"momentum": 0.9}
    assert bare("signsgd").params() == {} and bare("onebit").params() == {}
    assert gradcomp.make("efsignsgd").params() == {"error_feedback": True}


# -------------------------------------------------------------------------------------------------- fuzz


def mutate(raw: bytearray, rng: random.Random) -> bytearray:
    kind = rng.randrange(5)
    if kind == 0 and raw:  # flip bits
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(raw))
            raw[i] ^= 1 << rng.randrange(8)
    elif kind == 1 and raw:  # delete a run
        i = rng.randrange(len(raw))
        del raw[i : i + rng.randint(1, 6)]
    elif kind == 2:  # insert bytes
        i = rng.randrange(len(raw) + 1)
        raw[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 6)))
    elif kind == 3 and len(raw) >= 4:  # an extreme u32 (counts, sizes)
        i = rng.randrange(len(raw) - 3)
        raw[i : i + 4] = struct.pack("<I", rng.choice([0, 1, 2**31, 2**32 - 1, rng.randrange(2**32)]))
    else:  # truncate
        del raw[rng.randrange(len(raw) + 1) :]
    return raw


def refit(raw: bytearray) -> bytearray:
    """Recompute the header's body length and checksum, so only the sections (and the signs) can object."""
    if len(raw) < HEADER_BYTES:
        return raw
    body = torch.tensor(list(raw[HEADER_BYTES:]), dtype=torch.uint8)
    struct.pack_into("<IQ", raw, 8, len(body), checksum64(body))
    return raw


def decode_and_use(c, slots, raw: bytes) -> bool:
    try:
        fields = decode_slots(c, slots, torch.tensor(list(raw), dtype=torch.uint8))
        for slot, f in zip(slots, fields):
            out = torch.zeros(slot.numel)
            c.accumulate(f, slot, 0, out)
            c.decompress(f, slot, 0)
    except Exception as e:
        assert type(e) is WireError, f"{type(e).__name__}: {e}"
        return False
    return True


@pytest.mark.parametrize("name", NAMES)
def test_fuzz_only_wire_errors(name):
    rng = random.Random(hash(name) % 1000)
    c = bare(name)
    slots = [Slot("a", 0, 13), Slot("b", 1, 64), Slot("c", 2, 3)]
    rejected = 0
    for _ in range(150):
        xs = [torch.randn(s.numel) for s in slots]
        raw = bytearray(encode_slots(c, slots, [c.compress(x, s, 0) for x, s in zip(xs, slots)]).tolist())
        assert decode_and_use(c, slots, bytes(raw))
        mutated = mutate(bytearray(raw), rng)
        for candidate in (mutated, refit(bytearray(mutated))):
            rejected += not decode_and_use(c, slots, bytes(candidate))
        for cut in (0, 1, HEADER_BYTES - 1, HEADER_BYTES, len(raw) // 2, len(raw) - 1):
            assert not decode_and_use(c, slots, bytes(raw[:cut]))
    assert rejected > 150


@pytest.mark.parametrize("name", NAMES)
def test_padding_bits_are_rejected(name):
    # 13 signs: the last byte's top 3 bits are padding; set one, make the header consistent again
    c = bare(name)
    slot = Slot("a", 0, 13)
    raw = bytearray(encode(c.compress(torch.randn(13), slot, 0), c.specs(slot)).tolist())
    last = HEADER_BYTES + SECTION_HEADER_BYTES + 1
    for bit in (5, 6, 7):
        bad = bytearray(raw)
        bad[last] |= 1 << bit
        fields = decode(torch.tensor(list(refit(bad)), dtype=torch.uint8), c.specs(slot))
        with pytest.raises(WireError, match="padding"):
            c.decompress(fields, slot, 0)
        with pytest.raises(WireError, match="padding"):
            c.accumulate(fields, slot, 0, torch.zeros(13))


# --------------------------------------------------------------------------------------- training runs


def trajectory(transport, name, steps=12, lr=2.0**-8, **params):
    """Plain SGD on a small MLP; every worker's parameters after every step, and the bytes it sent."""
    transport.counter.reset()
    data = load_dataset("synthetic")
    model = build_model("mlp", data, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make(name, **params), transport)
    rows = shard_indices(data.num_train, transport.rank, transport.world_size, epoch=0, seed=0)
    history = []
    for step in range(steps):
        batch = rows[step * 16 : (step + 1) * 16]
        optimizer.zero_grad()
        F.cross_entropy(model(data.train_x[batch]), data.train_y[batch]).backward()
        aggregator.step()
        optimizer.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return torch.stack(history), transport.counter.bytes_up


@pytest.mark.parametrize("name", NAMES)
def test_four_simulated_workers_stay_identical(name, single_thread):
    with gradcomp.SimulatedCluster(4) as cluster:
        runs = cluster.run(lambda t: trajectory(t, name))
    for history, sent in runs[1:]:
        assert torch.equal(history, runs[0][0])
        assert sent == runs[0][1]
    assert not torch.equal(runs[0][0][0], runs[0][0][-1])  # it moved


def test_majority_vote_moves_every_weight_by_lr_or_zero(single_thread):
    lr = 2.0**-8
    with gradcomp.SimulatedCluster(4) as cluster:
        runs = cluster.run(lambda t: trajectory(t, "signsgd", steps=3, lr=lr))
    history = runs[0][0]
    steps = (history[1:] - history[:-1]).abs()
    moved = steps != 0
    # a weight moves by one ulp-rounded lr or not at all (4 workers: ties)
    torch.testing.assert_close(steps[moved], torch.full_like(steps[moved], lr), rtol=1e-3, atol=0)
    assert 0 < int((~moved).sum()) < steps.numel() // 2


def _real(rank, world, name):
    return trajectory(DistTransport(), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_gloo_workers_match_the_simulated_run_bit_for_bit(name, single_thread):
    real = run_workers(_real, 4, name, timeout=180)
    with gradcomp.SimulatedCluster(4) as cluster:
        sim = cluster.run(lambda t: trajectory(t, name))
    for rank in range(4):
        assert torch.equal(f32_bits(real[rank][0]), f32_bits(sim[rank][0]))
        assert real[rank][1] == sim[rank][1]


# ------------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_matches_cpu(name):
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(4))
    slot = Slot("w", 0, x.numel())
    cpu, gpu = bare(name), bare(name)
    a = cpu.compress(x, slot, 0)
    b = gpu.compress(x.cuda(), slot, 0)
    assert torch.equal(a[0], b[0].cpu())
    if len(a) > 1:
        torch.testing.assert_close(a[1], b[1].cpu(), rtol=1e-6, atol=0)
    buf = encode(b, gpu.specs(slot))
    assert buf.is_cuda
    out = gpu.decompress(decode(buf, gpu.specs(slot)), slot, 0)
    assert out.is_cuda and torch.equal(torch.sign(out.cpu()), torch.sign(cpu.decompress(a, slot, 0)))


def test_signum_state_of_the_wrong_size_is_refused():
    with pytest.raises(gradcomp.ConfigError, match=r"shape \(5,\), expected \(4,\)"):
        gradcomp.make("signum").load_state_dict({"momentum": {"a#4": torch.zeros(5)}})


# ------------------------------------------------------------------------------------------ zeros and ties


@pytest.mark.parametrize("path", ["cpu", "numpy", "torch"])
@pytest.mark.parametrize("name", VOTING)
def test_a_zero_is_sent_as_plus_on_even_steps_and_as_minus_on_odd_ones(name, path, monkeypatch):
    # the compiled kernel (cpu, above its size threshold), numpy's comparison, and the torch ops of other devices
    if path == "numpy":
        monkeypatch.setenv("GRADCOMP_KERNELS", "0")
    if path == "torch":
        monkeypatch.setattr(sign, "_numpy_path", lambda t: False)
    d = (1 << 20) + 1003  # two chunks, a partial last byte
    x = torch.randn(d, generator=torch.Generator().manual_seed(5))
    x[::5], x[1::7] = 0.0, -0.0
    slot = Slot("w", 0, d)
    c = bare(name, momentum=0.0) if name == "signum" else bare(name)  # m = g: the same signs as signsgd
    for step in range(4):
        assert torch.equal(c.compress(x, slot, step)[0], pack_bool(negative(x, step))), f"step {step}"


@pytest.mark.parametrize("workers", [3, 4])
@pytest.mark.parametrize("name", VOTING)
def test_an_all_zero_coordinate_stays_within_lr_of_its_start(name, workers):
    # a parameter whose gradient is exactly 0 on every worker (unused, a dead unit): sent as + on every step it
    # drifted by −lr a step (−0.1 after 100 steps at lr 1e-3); now it moves back and forth by lr
    lr = 1e-3

    def worker(transport):
        torch.manual_seed(0)
        used, unused = torch.nn.Linear(3, 1), torch.nn.Parameter(torch.zeros(4))
        params = [("used.weight", used.weight), ("used.bias", used.bias), ("unused", unused)]
        optimizer = torch.optim.SGD([p for _, p in params], lr=lr)
        aggregator = gradcomp.GradientAggregator(params, gradcomp.make(name), transport)
        g = torch.Generator().manual_seed(transport.rank)
        furthest = 0.0
        for _ in range(100):
            optimizer.zero_grad()
            used(torch.randn(8, 3, generator=g)).pow(2).mean().backward()
            unused.grad = torch.zeros(4)
            aggregator.step()
            optimizer.step()
            furthest = max(furthest, unused.detach().abs().max().item())
        return furthest

    with gradcomp.SimulatedCluster(workers) as cluster:
        furthest = cluster.run(worker)
    assert all(0 < f <= lr * (1 + 1e-6) for f in furthest), furthest


@pytest.mark.parametrize("server_error_feedback", [True, False])
def test_a_tied_vote_goes_down_from_the_server_as_plus_then_minus(server_error_feedback):
    # --topology ps --server-compressor signsgd: the server's vote (0 where 2 of 4 say +) travels down in one bit.
    # With error feedback (the CLI's default) the residual −1 that a tie sent as + leaves turns the next tie into
    # −; without it the tie follows the zero rule: + on even steps, − on odd ones (it used to be + every step)
    rows = torch.tensor(
        [[1.0, 1.0, -1.0, 1.0], [1.0, -1.0, -1.0, -1.0], [-1.0, 1.0, -1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]]
    )
    slot = Slot("w", 0, 4)
    config = TrainConfig(
        compressor="signsgd", topology="ps", server_compressor="signsgd", server_error_feedback=server_error_feedback
    )

    def worker(transport):
        compressor, server = config.build_compressors()
        exchange = gradcomp.GradientExchange(compressor, transport, topology="ps", server_compressor=server)
        return [exchange.exchange([slot], [rows[transport.rank]], step)[0].tolist() for step in range(4)]

    with gradcomp.SimulatedCluster(4) as cluster:
        out = cluster.run(worker)
    plus, minus = [1.0, 1.0, -1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]  # coordinates 0, 1 and 3 tie, 2 is −
    assert out == [[plus, minus, plus, minus]] * 4


# ------------------------------------------------------------------------------------ float64 and overflow


def test_signsgd_rounds_float64_to_float32_before_the_sign():
    # as signum, efsignsgd and onebit do: −1e-300 is −0.0 in float32, a zero (+ at an even step), not −
    x = torch.tensor([-1e-300, 1e-300, -2.0, 3.0], dtype=torch.float64)
    slot = Slot("w", 0, 4)
    assert bare("signsgd").compress(x, slot, 0)[0].tolist() == [0b0100]
    assert torch.equal(bare("signsgd").compress(x, slot, 0)[0], bare("signum").compress(x, slot, 0)[0])


@pytest.mark.parametrize("name", ["efsignsgd", "onebit"])
def test_a_non_finite_value_to_send_is_refused_naming_the_slot(name):
    x = torch.tensor([float("nan"), -1.0, 2.0])
    with pytest.raises(NonFiniteGradientError, match="non-finite .* in conv1.weight"):
        bare(name).compress(x, Slot("conv1.weight", 0, 3), 0)


def test_efsignsgd_residual_overflow_is_refused_before_sending():
    # finite gradients near float32's largest value: g + residual overflows to inf at the second step; the exchange
    # used to hand back inf, then nan. The residual is dropped, so the third step starts afresh
    slot = Slot("w", 0, 2)

    def worker(transport):
        exchange = gradcomp.GradientExchange(gradcomp.make("efsignsgd"), transport)
        first = exchange.exchange([slot], [torch.tensor([3.0e38, -1.0])], 0)[0]
        with pytest.raises(NonFiniteGradientError, match="efsignsgd: non-finite .* in w"):
            exchange.exchange([slot], [torch.tensor([3.0e38, -1.0])], 1)
        third = exchange.exchange([slot], [torch.tensor([3.0e38, -1.0])], 2)[0]
        return first, third

    with gradcomp.SimulatedCluster(2) as cluster:
        for first, third in cluster.run(worker):
            assert torch.isfinite(first).all() and torch.equal(first, third)


def test_signsgd_error_feedback_residual_is_bounded_only_while_the_gradient_is():
    # the residual of sign(p) with error feedback stays within 1 per coordinate while |g| <= 1; a coordinate with
    # |g| = 3 on every step grows by |g| − 1 = 2 a step
    c = gradcomp.make("signsgd", error_feedback=True)
    g = torch.Generator().manual_seed(1)
    for step in range(50):
        c.compress(torch.rand(1000, generator=g) * 2 - 1, Slot("w", 0, 1000), step)
        assert c.residuals["w#1000"].abs().max() <= 1.0
    for step in range(10):
        c.compress(torch.tensor([3.0]), Slot("v", 1, 1), step)
    assert c.residuals["v#1"].tolist() == [20.0]
