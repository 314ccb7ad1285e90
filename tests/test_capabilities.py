"""Compressor capabilities: each class declares the optional shortcuts it provides, and only those run.

``Compressor.capabilities`` (a ``Capabilities``) is set in each class's own body and never inherited; callers go
through ``compressors.base``'s functions (``accumulate``, ``compress_slots``, ``sent_entries``, ``subtract_sent``,
``compress_sum``, ``new_tally``, ``select_sized``), which take a shortcut only where it is declared.
"""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp import Slot
from gradcomp.compressors import base
from gradcomp.compressors.base import Capabilities, Compressor
from gradcomp.compressors.sparse import TopK
from gradcomp.registry import BUILTIN, compressor_class

# What every built-in single-message compressor declares (what the method-resolution inference it replaced gave).
EXPECTED = {
    "none": {"subtract_sent"}, "fp16": {"subtract_sent"}, "bf16": {"subtract_sent"},
    "topk": {"accumulate", "sent_entries"},
    "threshold": {"accumulate", "sent_entries", "select_sized", "compress_slots"},
    "randomk": {"accumulate", "sent_entries"}, "randomblock": {"accumulate", "sent_entries"},
    "sbc": {"accumulate", "sent_entries"},
    "stc": {"accumulate", "sent_entries", "select_sized", "compress_slots"},
    "dgc": {"accumulate", "select_sized", "compress_slots"},
    "cnat": {"accumulate"}, "random_dithering": {"accumulate"}, "natural_dithering": {"accumulate"},
    "terngrad": {"accumulate"}, "qsgd": {"accumulate"},
    "signsgd": {"accumulate", "subtract_sent", "tally"}, "signum": {"accumulate", "subtract_sent", "tally"},
    "efsignsgd": {"accumulate", "subtract_sent", "compress_sum"},
    "onebit": {"accumulate", "subtract_sent", "compress_sum"},
}
HOOKS = {"accumulate": "accumulate", "sent_entries": "sent_entries", "subtract_sent": "subtract_sent",
         "compress_sum": "compress_sum", "tally": "new_tally", "select_sized": "select_sized",
         "compress_slots": "compress_slots"}


def _declared(cls: type) -> set[str]:
    return {flag for flag in HOOKS if getattr(cls.capabilities, flag)}


def test_every_builtin_declares_what_it_did():
    singles = {n for n in BUILTIN if issubclass(compressor_class(n), Compressor)}
    assert singles == set(EXPECTED)
    for name, flags in EXPECTED.items():
        assert _declared(compressor_class(name)) == flags, name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_declared_capability_has_its_method(name):
    """A declaration is not a promise without code: the class (or a parent) defines the method it declares."""
    cls = compressor_class(name)
    for flag in _declared(cls):
        assert callable(getattr(cls, HOOKS[flag], None)), (name, HOOKS[flag])


def test_the_base_defines_no_shortcut_and_a_declaration_without_its_method_is_refused():
    """The shortcuts are opt-in: the Compressor base has none of them (the generic routes are base's functions),
    and a class that declares one without writing it fails at its class statement."""
    assert not any(hasattr(Compressor, method) for method in HOOKS.values())
    with pytest.raises(TypeError, match=r"declares Capabilities\(accumulate=True\) but defines no accumulate"):

        class Promised(Compressor):  # the class statement itself raises
            capabilities = Capabilities(accumulate=True)

            def specs(self, slot):
                return []

            def compress(self, x, slot, step):
                return []

            def decompress(self, fields, slot, step):
                return torch.zeros(slot.numel)


def test_wrappers_declare_what_they_forward():
    ef = gradcomp.make("signum", error_feedback=True)
    assert _declared(type(ef)) == {"accumulate", "tally", "select_sized", "compress_slots"}
    # error feedback forwards select_sized only where its inner compressor declares it (else None, untouched)
    assert base.select_sized(ef, [torch.randn(100)], [Slot("w", 0, 100)], 0) is None and not ef.residuals
    slot = Slot("w", 0, 100)
    assert isinstance(base.new_tally(ef, slot, torch.device("cpu")), base.Tally)  # the inner vote, forwarded
    composed = gradcomp.make("topk+cnat", error_feedback=False)
    assert _declared(type(composed)) == {"accumulate", "sent_entries"}


def test_a_subclass_that_declares_nothing_has_nothing():
    class Quiet(TopK):
        pass

    class Same(TopK):
        capabilities = TopK.capabilities

    assert Quiet.capabilities == Capabilities() and Same.capabilities == TopK.capabilities
    slot = Slot("w", 0, 50)
    x = torch.randn(50, generator=torch.Generator().manual_seed(1))
    fields = Quiet(density=0.2).compress(x, slot, 0)
    assert base.sent_entries(Quiet(density=0.2), fields, slot, 0) is None
    assert base.sent_entries(Same(density=0.2), fields, slot, 0) is not None


def test_a_subclass_that_decodes_otherwise_gets_the_generic_routes():
    """Doubled inherits top-k's scatter-add and sent entries, written for top-k's decompress: not used for it."""

    class Doubled(TopK):
        def decompress(self, fields, slot, step):
            return 2 * super().decompress(fields, slot, step)

    c, slot = Doubled(density=0.2), Slot("w", 0, 50)
    x = torch.randn(50, generator=torch.Generator().manual_seed(2))
    fields = c.compress(x, slot, 0)
    total = torch.ones(50)
    base.accumulate(c, fields, slot, 0, total)
    assert torch.equal(total, 1 + c.decompress(fields, slot, 0))
    residual = x.clone()
    base.subtract_sent(c, fields, slot, 0, residual)
    assert torch.equal(residual, x - c.decompress(fields, slot, 0))


def test_capabilities_must_be_a_capabilities():
    with pytest.raises(TypeError, match="must be a Capabilities"):

        class Wrong(TopK):  # the class statement itself raises
            capabilities = {"accumulate": True}


def test_the_base_interface_is_eight_methods():
    """The Compressor base is the narrow core (issue: at most 8 methods): a new method writes specs, compress and
    decompress; params, aggregate, retain and the state pair have defaults. Everything else is a function of
    compressors.base or a class attribute."""
    methods = sorted(n for n, v in vars(Compressor).items() if callable(v) and not n.startswith("__"))
    assert methods == ["aggregate", "compress", "decompress", "load_state_dict", "params", "retain", "specs",
                       "state_dict"]


@pytest.mark.parametrize("name, kwargs, wrapped", [
    ("cnat", {"error_feedback": True}, ["inner"]),
    ("dgc", {}, ["selector"]),  # DGC and its sampled top-k
])
def test_bind_worker_gives_the_rank_to_every_wrapped_compressor(name, kwargs, wrapped):
    """Stochastic rounding salted by the rank must see the rank inside error feedback and DGC too: else every
    worker would round alike (correlated errors that averaging does not reduce)."""
    c = gradcomp.make(name, **kwargs)
    base.bind_worker(c, 3)
    assert c.worker == 3
    for path in wrapped:
        target = c
        for part in path.split("."):
            target = getattr(target, part)
        assert target.worker == 3, path


def test_a_class_still_defining_bind_worker_is_refused_at_its_class_statement():
    with pytest.raises(TypeError, match="bind_worker is never called"):

        class Old(Compressor):
            def bind_worker(self, worker):
                self.worker = worker
