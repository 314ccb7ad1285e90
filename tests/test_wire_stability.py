"""Wire stability: the encoded messages of every compressor, for fixed inputs, must never change.

``DIGESTS`` holds the SHA-256 of the encoded messages of every case below, recorded with the code as it was
before the compressors were optimised (issue "make compressors fast enough"). A case is a compressor with
fixed parameters, run for one or more steps on one of the seeded inputs of ``INPUTS``; its digest covers, for
every step, the message's length and its bytes. Any change of codes, positions, values, their order or the
container layout shows as a different digest, so a speed-up (or any later change) that alters a single bit
of what a compressor sends fails here. Randomised compressors use their seeded generators: the same seed,
step, slot and worker must give the same codes.

The digest covers the message body (every section: codec, parameter, count, byte length and data), not the
20-byte container header: magic, format version and body checksum belong to the container, which has its
own tests (tests/test_wire_container.py, tests/test_wire_checksum.py), so that a new container version or
checksum does not touch these digests, while the header's section count and body length follow from the
body. Every message is also decoded (which verifies the checksum) and must give back the encoded fields.

The inputs are chosen to reach every code path that an optimisation may take: tensors below and above the
small-message packing limit (4096 values) and the sign packer's chunk (2^20 entries), sizes that are not a
multiple of 8, heavy-tailed magnitudes, exact ties at the top-k boundary, mostly-zero tensors (top-k must
then send zeros), signed zeros, entries beyond fp16's range, and densities on both sides of 1/64.

To re-record after an intended change of a wire format: ``python tests/test_wire_stability.py`` prints the
table; say in the commit which format changed and why. Re-recorded since: ``stc-0.01`` and ``stc-0.05``, when
STC stopped sending the kept entries that are exactly zero (the ``sparse`` input has fewer nonzero entries
than those k; they used to arrive as +mu, and now carry 0 as in the paper), and again when STC's Golomb positions
took the Rice parameter of the configured density k / d instead of that of the count sent (the same in every other
input, where the count is k); ``dgc``, ``dgc-0.01-fixed`` and
``dgc-warmup-clip``, when DGC's selection began to send exactly the top-k (its sampled threshold is taken four
standard deviations low and lowered further when fewer than k pass; the paper's threshold let fewer than k
through on about half of the steps, and those were sent as they were); ``signsgd`` and ``signum``, when the
majority-vote methods began to send an entry that is exactly 0 as + on even steps and as − on odd ones (it was
always +, so a coordinate that is 0 on every worker drifted by −lr a step; the ``ties`` and ``sparse`` inputs
hold zeros, and these cases run three steps; the layout, one bit per entry, is unchanged); every other case kept
its digest.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gradcomp
from gradcomp import Slot
from gradcomp.compressors.base import bind_worker
from gradcomp.wire import HEADER_BYTES, decode, encode
from wire_paths import device_path


def _heavy(d: int, seed: int) -> torch.Tensor:
    """N(0, 1) times a log-normal scale per block of 4096 entries (the bench's synthetic gradient, smaller)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-d // 4096)
    # the C library's exp, not torch.exp: torch's vectorised exp changed its last bit for some inputs between
    # torch 2.11 and 2.13 (4 of the 293 scales of "large"), which changed this input and every digest made on it
    scale = 1e-3 * torch.tensor([math.exp(v) for v in (1.5 * torch.randn(blocks, generator=g)).tolist()])
    return torch.randn(d, generator=g) * scale.repeat_interleave(4096)[:d]


def _ties(d: int, seed: int) -> torch.Tensor:
    """Few distinct magnitudes (multiples of 0.25 in [-2, 2]): top-k boundaries fall inside runs of ties."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (d,), generator=g).to(torch.float32) * 0.25


def _sparse(d: int, seed: int) -> torch.Tensor:
    """0.3 % nonzero entries (fewer than top-k's 1 %), the rest +0.0 and -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=g)
    keep = torch.rand(d, generator=g) < 0.003
    zeros = torch.where(torch.rand(d, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
    return torch.where(keep, x, zeros)


def _wide(d: int, seed: int) -> torch.Tensor:
    """Magnitudes from 1e-30 to 1e30 (fp16 / bf16 saturation, subnormals after scaling)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g) * torch.logspace(-30, 30, d)


INPUTS: dict[str, Callable[[], torch.Tensor]] = {
    "small": lambda: _heavy(1003, 1),  # below the 4096-value packing limit
    "medium": lambda: _heavy(50_003, 2),
    "large": lambda: _heavy(1_200_007, 3),  # above the sign packer's 2^20-entry chunk
    "ties": lambda: _ties(200_001, 4),
    "sparse": lambda: _sparse(300_000, 5),
    "wide": lambda: _wide(20_000, 6),
}

# label -> (compressor name, make() keyword arguments, inputs, steps, worker)
CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...], int, int]] = {}


def _case(label: str, name: str, params: dict[str, Any], inputs: tuple[str, ...], steps: int = 1, worker: int = 0):
    CASES[label] = (name, params, inputs, steps, worker)


_ALL = tuple(INPUTS)
_case("none", "none", {}, ("small", "medium", "wide"))
_case("fp16", "fp16", {}, ("small", "large", "wide"))
_case("bf16", "bf16", {}, ("small", "large", "wide"))
for _d in (0.01, 0.001, 0.05):
    _case(f"topk-{_d}", "topk", {"density": _d, "error_feedback": False}, _ALL)
_case("topk-0.01-golomb", "topk", {"density": 0.01, "positions": "golomb", "error_feedback": False}, _ALL)
_case("topk-0.3", "topk", {"density": 0.3, "error_feedback": False}, ("small", "medium", "ties"))
_case("topk-k7", "topk", {"k": 7, "error_feedback": False}, ("small", "large", "ties", "sparse"))
_case("topk-0.01-ef", "topk", {"density": 0.01, "error_feedback": True}, ("medium", "large", "ties"), steps=3)
_case("randomk-0.01", "randomk", {"density": 0.01}, _ALL, steps=2)
_case("randomk-0.001-scaled", "randomk", {"density": 0.001, "scale": True, "seed": 3}, ("large", "medium"))
_case("randomk-0.3", "randomk", {"density": 0.3}, ("small", "medium"))
_case("randomk-k5", "randomk", {"k": 5}, ("small", "large"))
_case("randomblock-0.01", "randomblock", {"density": 0.01}, _ALL, steps=2)
_case("randomblock-0.4-scaled", "randomblock", {"density": 0.4, "scale": True, "seed": 9}, ("small", "medium"), 3)
for _tau in (1e-3, 0.5, 1.25):
    _case(f"threshold-{_tau}", "threshold", {"threshold": _tau}, _ALL)
_case("threshold-golomb", "threshold", {"threshold": 1e-3, "positions": "golomb"}, _ALL)
for _d in (0.01, 0.001, 0.05):
    _case(f"sbc-{_d}", "sbc", {"density": _d, "error_feedback": False}, _ALL)
_case("sbc-0.01-fixed-ef", "sbc", {"density": 0.01, "positions": "fixed"}, ("medium", "large", "ties"), steps=3)
for _d in (0.01, 0.001, 0.05):
    _case(f"stc-{_d}", "stc", {"density": _d, "error_feedback": False}, _ALL)
_case("stc-0.01-fixed-ef", "stc", {"density": 0.01, "positions": "fixed"}, ("medium", "large", "ties"), steps=3)
_case("dgc", "dgc", {}, _ALL, steps=3)
_case("dgc-0.01-fixed", "dgc", {"density": 0.01, "positions": "fixed", "sample": 0.05}, _ALL, steps=3, worker=2)
_case("dgc-warmup-clip", "dgc", {"density": 0.001, "warmup_steps": 1, "clip": 0.5}, ("medium", "large"), steps=4)
_case("dgc-dense", "dgc", {"density": 1.0}, ("small",), steps=2)
_case("cnat", "cnat", {}, ("small", "large", "wide"), steps=2)
_case("cnat-seed-worker", "cnat", {"seed": 5}, ("medium",), worker=3)
for _s in (1, 3, 8):
    _case(f"natural_dithering-{_s}", "natural_dithering", {"levels": _s}, ("small", "large", "wide"))
_case(
    "natural_dithering-inf-cnat",
    "natural_dithering",
    {"levels": 7, "norm": "inf", "norm_codec": "cnat"},
    ("medium", "sparse"),
    steps=2,
    worker=1,
)
for _s in (1, 8, 127, 1000):
    _case(f"random_dithering-{_s}", "random_dithering", {"levels": _s}, ("small", "large", "wide"))
_case(
    "random_dithering-inf-cnat",
    "random_dithering",
    {"levels": 5, "norm": "inf", "norm_codec": "cnat"},
    ("medium", "ties"),
    steps=2,
    worker=1,
)
_case("qsgd", "qsgd", {}, ("small", "large", "sparse", "wide"), steps=2)
_case("qsgd-7", "qsgd", {"levels": 7, "seed": 2}, ("medium", "ties"), worker=1)
_case("qsgd-elias", "qsgd", {"coding": "elias"}, ("small", "large", "sparse"))
_case("qsgd-1-elias", "qsgd", {"levels": 1, "coding": "elias"}, ("medium", "wide"), worker=2)
_case("terngrad", "terngrad", {}, ("small", "large", "wide"), steps=2)
_case("terngrad-noclip", "terngrad", {"clip": 0.0, "seed": 4}, ("medium", "sparse"), worker=1)
for _name in ("signsgd", "signum"):
    _case(_name, _name, {}, _ALL, steps=3)
_case("signum-0.5", "signum", {"momentum": 0.5}, ("medium",), steps=2)
for _name in ("efsignsgd", "onebit"):
    _case(_name, _name, {"error_feedback": False}, _ALL)
    _case(f"{_name}-ef", _name, {}, ("small", "large", "sparse"), steps=3)
_case("topk+cnat", "topk+cnat", {"density": 0.01, "error_feedback": False}, ("medium", "large", "ties"), steps=2)
_case("topk+fp16", "topk+fp16", {"density": 0.01, "error_feedback": False}, ("medium", "wide"))
_case("randomk+cnat", "randomk+cnat", {"density": 0.01}, ("large",))

_CACHE: dict[str, torch.Tensor] = {}


def _input(name: str) -> torch.Tensor:
    if name not in _CACHE:
        _CACHE[name] = INPUTS[name]()
    return _CACHE[name].clone()


def digest(label: str) -> str:
    """SHA-256 over the case's messages: for every input and step, the body's length and bytes."""
    name, params, inputs, steps, worker = CASES[label]
    h = hashlib.sha256()
    for input_name in inputs:
        compressor = gradcomp.make(name, **params)
        bind_worker(compressor, worker)
        x = _input(input_name)
        slot = Slot(name=f"{label}/{input_name}", index=7, numel=x.numel())
        specs = compressor.specs(slot)
        for step in range(steps):
            # a step's input differs from the last (a training gradient does): feedback state is exercised
            given = x * (1.0 + 0.25 * step)
            before = given.clone()
            fields = compressor.compress(given, slot, step)
            assert torch.equal(given.view(torch.int32), before.view(torch.int32)), f"{label}: input modified"
            buf = encode(fields, specs)
            for got, sent in zip(decode(buf, specs), fields):
                assert torch.equal(got.reshape(-1).to(sent.dtype), sent.reshape(-1)), f"{label}: {input_name}"
            body = buf[HEADER_BYTES:].numpy().tobytes()
            h.update(f"{input_name}:{step}:{len(body)}:".encode())
            h.update(body)
    return h.hexdigest()


# Recorded before the speed-ups (see the module docstring).
DIGESTS: dict[str, str] = {
    "none": "63e7ac7b7630e91abcd4b730214de552f707a174b1616414d59e879cc4757a10",
    "fp16": "101c5510aa951354eed121974c5203d1a0aad841d2097fcc82169bd86b710ee7",
    "bf16": "886bcdc59c0924f940d6e622f9c545b503a87f8e696662806b87cde4ee4ac919",
    "topk-0.01": "9ac3bca4acd5fe9bd27a1a4676197fb2ebc4ed7e5f676b913da18d279b444340",
    "topk-0.001": "0aa249217456da954bb5e5eadda626500d4f3d32cbcf0d8cb0ebe6f8156976b0",
    "topk-0.05": "24e9e89a5d714f45b048fc438f8e589adf5478fb58b856558b96acd040ee4c62",
    "topk-0.01-golomb": "437897373c3b94808b47716c49b22ead158ccba07196eca08464d657229cc26c",
    "topk-0.3": "b4471da9b920f48246ebecfe9f6e47b607a09740d2f379b15583b31ce4eb5640",
    "topk-k7": "6e0fc4de6c63864bfc3d5ee8a86541bde149612b4ee5aa7059e79006117d75a2",
    "topk-0.01-ef": "d933f21df21f490026b376d5311369d9dfb4ca70bba1af3d1ab2dd6eaa8e5945",
    "randomk-0.01": "b897cc662d1f710aaf57cf42ee43296160c7462a23f5c1ef8ceb8644bce0cef4",
    "randomk-0.001-scaled": "a168d43cd0c154d4c5305edb0bdc81f1a7ea3096fb06b5ea07d761a644cb5e48",
    "randomk-0.3": "4765c3c4dc588e8a9e3097e94ec63420cb806c851011a04a329dfe875a58edbc",
    "randomk-k5": "ad148d987a21b7223d61524c98380ec08ae3b5ebff5554168aa9ba13d2ee5fd8",
    "randomblock-0.01": "fcd3cc5a0f737352dbd0b23897b158e0f523e0a34c6bbff4e2039345cba2b6cf",
    "randomblock-0.4-scaled": "a43908039b0594ea3c846c6ec260a318ab6151476d448b376ad3e8aa2195077f",
    "threshold-0.001": "8e702e162613b0dea00013e41c1ebce0842fb101bb2cb79fee564df9ed6f6712",
    "threshold-0.5": "972bdb122f04118e3427ef5c1f2cc49b4ff596d10648dbf1edd288ad96fba471",
    "threshold-1.25": "f580db5a23de2e290b64b243d39ce3a66a7ab778e0a9a57ed04d4df73523593e",
    "threshold-golomb": "034ae43868073aeca6ccacc52c320bd96a91f9d88298fe3ad875af8e92283141",
    "sbc-0.01": "a4a99f01f069fe1b096c0776104b98ae83786259c592890cf1757d5a4a544ca7",
    "sbc-0.001": "acd70ffd474ed35c797d29f69570052a11644ec320bdf7ca320cec2d54be4dc2",
    "sbc-0.05": "bfdaac8ad456c8d479a530b13de80c8dce519071b155ca9061487a12dae628e7",
    "sbc-0.01-fixed-ef": "157c084f979de0c8e294bd57560415eeac2aece3f57c2afee04b366c2a8d4545",
    "stc-0.01": "d4cff666a87472c98ef24b89f0e4e14ed7b059668652b34b166d3d5ef658401c",
    "stc-0.001": "d63d15a0fe00e22dff56922fea9a79b389d100460f6bb6ccf99e39513ca22ad6",
    "stc-0.05": "5aebb275cd9f8ed826b73805714a7c3b474c0c281b0619ba4cc80ca20bb04545",
    "stc-0.01-fixed-ef": "d75bed06cf736cb42aeeac5d3ac954b491c6d5c1a331b4f113bee6b87326fdc2",
    "dgc": "30ada3705012ec913f6d298b0acf370f79b2d790ae3d56597e3d9400345e9693",
    "dgc-0.01-fixed": "e93c9f70f96bb4d99193bda40ec4453970fbb32001a92fc431abadd131f81882",
    "dgc-warmup-clip": "3e9532b823da11a0d98ecc2d214ba2dc6c9819f4fc5133a7e1a914c0f5ae3940",
    "dgc-dense": "63174bf0b942fa29f4abca9f55955c7b74bbef09d972698ae90880c49ba741c8",
    "cnat": "77576d693cc8bb52c9966695c6c3f6f09b1de1d511b370c0f0c6cf3e78984f8c",
    "cnat-seed-worker": "c78c625037a9a2fc4247a65b313918614c187629d7a6859cc858a2d94a13cef2",
    "natural_dithering-1": "cca125bcbe7134e6fd1a8bf9f50935a21e2abb81af1538aba795870aaa46e51c",
    "natural_dithering-3": "2dba3505e83591e10ed428b48fe1d9745eecc3a20e517596a7eb73ee839bfb01",
    "natural_dithering-8": "c7651a6a1dcbb1e47338e34cbe5fb3be2ca658e15cb76bb1ced2ec8144a33888",
    "natural_dithering-inf-cnat": "881a523d7670e33bc6ef113d66b982a4baa83ada0d5b2371037cd4c171ed440e",
    "random_dithering-1": "73ef991e1f8f322a3164d9a99c3843fb538ade512ff98708409ee3c5155e08e1",
    "random_dithering-8": "ba2eed355ab49496b92500051f76cd0ffd461f03520ba50959abb5f49f93a3d5",
    "random_dithering-127": "d40eb91c5b9c64b86603cf9293f923f9313b140b359e94087c4c433e9e5f68ec",
    "random_dithering-1000": "571d0c1778a14f26e8013692f57270b88a72e4bdda4e5c06d4982eed15af7d85",
    "random_dithering-inf-cnat": "3ddf5d3cb1ad7e2f45135d9c53a50ddd826b1e3d702464f63ab51fa2fcf93b6e",
    "qsgd": "ba267a338ace07a168f0019d4ddaac70b76ab1a7fcbcb648ad1f943f0efc4aa9",
    "qsgd-7": "81cf2e5b7b87b1c0314b1ae9bad67ffc1b2e9d8bbe4bbcc2ec4813aba82240f2",
    "qsgd-elias": "89b957179998d7be0f369b3dfc4487fdb80dd4c78680cbe61e1ff77c721ed66e",
    "qsgd-1-elias": "683590e567569c5af8937029da5baaa9f8995dda98e2806fd891bef55b9948cc",
    "terngrad": "ce0195448f8ca7e894eb8e332c5fcfcaf7f3149e3719888a0dc73f8fe9b03315",
    "terngrad-noclip": "fb7c271487fad618f0f41fcba047966bbf0ddcb53b301de3b296d50421f3ad1b",
    "signsgd": "8a4e6754fb862ebc11955a9052808baf82e296f874b0cffc921755d26d89fd94",
    "signum": "8a4e6754fb862ebc11955a9052808baf82e296f874b0cffc921755d26d89fd94",
    "signum-0.5": "2485a9550fef481ab545a38d23fea97e22dbd873d3d2b444ba89901b0a356751",
    "efsignsgd": "ad077c7b3b0592d5769d49565c9bfb194c7d65baec442d58732be2a269044af6",
    "efsignsgd-ef": "8983c6e98b756deb7a014079d2679f0cba00e24a9ddc63671915965e32355134",
    "onebit": "29f0f3b2e72ee992ec6d141413e9182f1eed31a33c5ae11e3112a75d94517b38",
    "onebit-ef": "66b5bddddffb14e9ca6fa5e49de9aa9bbcd338ab873ac39b05217cab20da8a26",
    "topk+cnat": "46f8fa592e6094a27a2c929f1785c1c81dc8af7e255da50b089c854a18d53404",
    "topk+fp16": "72abd01b6bcdaa1b71270fd3c8ffd105690449d3d0666cb7002cadd8a2397966",
    "randomk+cnat": "835db728425b76e52cc494faf978db16badc123118a0f14647a128931a47d1d7",
}


def test_every_registered_compressor_has_a_case():
    from gradcomp.compressors.base import Compressor
    from gradcomp.registry import BUILTIN, compressor_class

    names = {case[0] for case in CASES.values()}
    # gradcomp's own methods (an installed plugin's wire format is its package's to keep)
    singles = [n for n in BUILTIN if issubclass(compressor_class(n), Compressor)]
    missing = [n for n in singles if n not in names]
    assert not missing, f"no wire-stability case for {missing}: add one (and its digest, recorded before any change)"


def test_every_case_has_a_digest():
    assert set(DIGESTS) == set(CASES)


@pytest.mark.parametrize("label", sorted(CASES))
def test_encoded_messages_are_unchanged(label, single_thread):  # one thread: reductions sum in a fixed order
    assert digest(label) == DIGESTS[label], (
        f"{label}: the encoded messages changed; a wire format must stay bit-exact (same codes for the same "
        "input, seed, step, slot and worker)"
    )


@pytest.fixture
def torch_paths(monkeypatch):
    """Switch off the CPU-only fast paths (compiled and numpy kernels, chunked loops): every helper then runs the torch
    ops it runs on other devices (CUDA), here on the CPU, where their messages can be compared."""
    from gradcomp.compressors import natural, sign, sparse
    from gradcomp.wire import bits

    monkeypatch.setattr(sparse, "_numpy_path", lambda t: False)
    monkeypatch.setattr(sign, "_numpy_path", lambda t: False)
    monkeypatch.setattr(natural, "_cpu_loop", lambda t: False)
    monkeypatch.setattr(bits, "_chunked", lambda values, width: False)
    monkeypatch.setenv("GRADCOMP_KERNELS", "0")  # the compiled kernels (gradcomp.kernels) too
    device_path(monkeypatch)  # and the wire's device path (deferred checks, one size read)


# the cases whose compressors have a CPU fast path and a torch path (one or two inputs each, for time)
GENERIC = [
    "topk-0.01",
    "topk-0.001",
    "topk-0.01-golomb",
    "randomk-0.01",
    "threshold-0.001",
    "sbc-0.01",
    "stc-0.01",
    "dgc",
    "dgc-0.01-fixed",
    "cnat",
    "natural_dithering-8",
    "random_dithering-127",
    "qsgd",
    "qsgd-elias",
    "signsgd",
    "signum",
    "efsignsgd",
    "onebit",
    "terngrad",
    "fp16",
    "bf16",
]


@pytest.mark.parametrize("label", GENERIC)
def test_the_torch_paths_send_the_same_messages(label, single_thread, torch_paths):
    assert digest(label) == DIGESTS[label], f"{label}: the torch (non-CPU) path sends other messages"


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("DIGESTS: dict[str, str] = {")
    for _label in CASES:
        print(f'    "{_label}": "{digest(_label)}",', flush=True)
    print("}")
    sys.exit(0)
