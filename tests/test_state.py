"""gradcomp.compressors.state: the one per-slot store (keys, retain, state dict, checked loading, the journal that
undoes one call, held fields for state that is not a tensor) and the momentum arithmetic that
feedback.MomentumCorrection, DGC and the sketched-SGD methods share, and Signum's moving average."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import gradcomp
from gradcomp.compressors.base import Slot
from gradcomp.errors import ConfigError
from gradcomp.feedback import ErrorFeedback, MomentumCorrection
from gradcomp.compressors.state import Momentum, MovingAverage, SlotState, journal, slot_key

SRC = Path(gradcomp.__file__).parent
A, B = Slot("a.weight", 0, 6), Slot("b.bias", 1, 3)


def test_keyed_by_name_and_size_and_retain_drops_the_rest():
    state = SlotState("test", ["x", "y"])
    state.put("x", A, torch.ones(6))
    state.put("y", A, torch.ones(6))
    state.put("x", B, torch.ones(3))
    assert slot_key(A) == "a.weight#6" and set(state["x"]) == {"a.weight#6", "b.bias#3"}
    assert state.get("x", Slot("a.weight", 5, 6)) is state["x"]["a.weight#6"]  # the index plays no part
    assert state.get("x", Slot("a.weight", 0, 7)) is None  # another size: another tensor
    state.retain([B])
    saved = state.state_dict()
    assert set(saved["x"]) == {"b.bias#3"} and saved["y"] == {} and torch.equal(saved["x"]["b.bias#3"], torch.ones(3))


def test_state_dict_copies_and_load_round_trips():
    state = SlotState("test", ["x"])
    state.put("x", A, torch.arange(6.0))
    saved = state.state_dict()
    state["x"]["a.weight#6"].add_(1)
    assert torch.equal(saved["x"]["a.weight#6"], torch.arange(6.0))  # a copy, not the live tensor
    other = SlotState("test", ["x"])
    other.load_state_dict(saved)
    saved["x"]["a.weight#6"].add_(5)
    assert torch.equal(other["x"]["a.weight#6"], torch.arange(6.0))  # loaded as a copy too


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"z": {}}, "unexpected test state keys"),
        ({"x": {"a.weight": torch.zeros(6)}}, "bad test state key"),
        ({"x": {"a.weight#6": [0.0] * 6}}, "tensors"),
        ({"x": {"a.weight#6": torch.zeros(6, dtype=torch.float64)}}, "float32"),
        ({"x": {"a.weight#6": torch.zeros(5)}}, r"expected \(6,\)"),
        ({"x": {"a.weight#6": torch.zeros(2, 3)}}, r"expected \(6,\)"),
        ({"x": {"b.bias#3": torch.zeros(3), "a.weight#6": torch.zeros(4)}}, "a.weight#6"),
        ({"x": []}, "tensors"),
    ],
)
def test_a_bad_state_is_refused_and_changes_nothing(bad, match):
    state = SlotState("test", ["x"])
    state.put("x", A, torch.ones(6))
    with pytest.raises(ConfigError, match=match):
        state.load_state_dict(bad)
    assert set(state["x"]) == {"a.weight#6"} and torch.equal(state["x"]["a.weight#6"], torch.ones(6))


def test_a_restored_tensor_is_moved_next_to_the_gradient_once():
    state = SlotState("test", ["x"])
    state.load_state_dict({"x": {"a.weight#6": torch.arange(6.0)}})
    like = torch.zeros(6)
    t = state.get("x", A, like)
    assert t.dtype == torch.float32 and t.is_contiguous() and state.get("x", A, like) is t


def test_momentum_arithmetic_and_release():
    m = Momentum(0.5, "test")
    g1, g2 = torch.tensor([1.0, -2.0, 4.0]), torch.tensor([2.0, 2.0, -4.0])
    u, v = m.step(B, g1)
    assert torch.equal(u, g1) and torch.equal(v, g1) and u is not g1
    m.sent(B, torch.tensor([2]), torch.tensor([4.0]))  # v − sent, u masked where a nonzero went out
    assert torch.equal(v, torch.tensor([1.0, -2.0, 0.0])) and torch.equal(u, torch.tensor([1.0, -2.0, 0.0]))
    u, v = m.step(B, g2)
    assert torch.equal(u, torch.tensor([2.5, 1.0, -4.0])) and torch.equal(v, torch.tensor([3.5, -1.0, -4.0]))
    m.sent(B, torch.tensor([0, 1]), torch.tensor([3.5, 0.0]))  # nothing went out at 1: its momentum stays
    assert torch.equal(u, torch.tensor([0.0, 1.0, -4.0])) and torch.equal(v, torch.tensor([0.0, -1.0, -4.0]))
    m.sent(B, torch.tensor([2]))  # all of v went out there
    assert torch.equal(u, torch.tensor([0.0, 1.0, 0.0])) and torch.equal(v, torch.tensor([0.0, -1.0, 0.0]))
    u, none = m.step(A, torch.ones(6), accumulate=False)
    assert none is None and set(m.state["accumulated"]) == {"b.bias#3"}
    with pytest.raises(ConfigError, match="momentum"):
        Momentum(1.0, "test")


def test_moving_average_is_signums_arithmetic_bit_for_bit():
    """m ← β·m + (1 − β)·g, m = 0 before the first step, with the float ops Signum has always used (so its
    signs and its checkpoints do not move): g·(1 − β) first, then m·β + (1 − β)·g in place, whole or by chunks."""
    beta, gen = 0.9, torch.Generator().manual_seed(0)
    average = MovingAverage(beta, "test")
    g1, g2 = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    m, update = average.step(A, g1)
    assert update is None and torch.equal(m, g1 * (1.0 - beta)) and average.state.get("momentum", A) is m
    m, update = average.step(A, g2)
    assert torch.equal(m, g1 * (1.0 - beta))  # not yet: the caller runs the update, chunk by chunk
    update(0, 4)
    update(4, 6)
    assert torch.equal(m, (g1 * (1.0 - beta)).mul_(beta).add_(g2, alpha=1.0 - beta))
    shaped = torch.randn(2, 3, generator=gen)  # a gradient not flat: updated at once
    expected = m.clone().mul_(beta).add_(shaped.reshape(-1), alpha=1.0 - beta)
    m, update = average.step(A, shaped)
    assert update is None and torch.equal(m, expected)
    with pytest.raises(ConfigError, match="momentum"):
        MovingAverage(1.0, "test")


class _Counter:
    """A held object: state that is not a tensor, changed in place."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_held_fields_are_kept_saved_loaded_and_undone_like_tensors():
    state = SlotState("test", ["x"], held=["object", "flag"])
    obj = state.put("object", A, _Counter())
    state.put("flag", A, True)
    state.put("x", A, torch.ones(6))
    obj.count = 2
    saved = state.state_dict()
    assert saved["object"] == {"a.weight#6": {"count": 2}} and saved["flag"] == {"a.weight#6": True}
    obj.count = 5
    state.load_state_dict(saved)  # the object that holds the key takes the saved state in place
    assert state.get("object", A) is obj and obj.count == 2
    state.load_state_dict({"object": {"a.weight#6": {"count": 7}, "b.bias#3": {"count": 1}}})
    assert obj.count == 7 and state["object"]["b.bias#3"] == {"count": 1}  # none for B: kept as saved
    assert state.get("flag", A) is None and state["x"] == {}  # what the state did not have is gone
    with journal() as touched:
        state.get("object", A).count = 9
        state.put("flag", B, True)
    touched.undo()
    assert obj.count == 7 and state.get("flag", B) is None
    state.retain([B])
    assert set(state["object"]) == {"b.bias#3"}
    with pytest.raises(ConfigError, match="bad test state key"):
        state.load_state_dict({"object": {"b.bias": {"count": 1}}})
    assert set(state["object"]) == {"b.bias#3"}


def test_every_stateful_method_keeps_its_state_in_one_slot_state():
    topk = gradcomp.make("topk", density=0.5, error_feedback=False)
    stores = {
        "error feedback": ErrorFeedback(topk).state,
        "momentum correction": MomentumCorrection(topk).state,
        "dgc": gradcomp.make("dgc").memory.state,
        "sketch": gradcomp.make("sketch").memory.state,
        "local_topk": gradcomp.make("local_topk").memory.state,
        "true_topk": gradcomp.make("true_topk").memory.state,
        "powersgd": gradcomp.make("powersgd").state,
        "signum": gradcomp.make("signum").average.state,
        "lgc": gradcomp.make("lgc").state,  # residuals, autoencoders and their flags
    }
    for what, store in stores.items():
        assert isinstance(store, SlotState), what


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_no_cycle_between_dgc_and_feedback():
    """DGC and the feedback wrappers both build on gradcomp.compressors.state, which imports neither."""
    assert "gradcomp.feedback" not in _imports(SRC / "compressors" / "dgc.py")
    assert "gradcomp.compressors.state" in _imports(SRC / "compressors" / "dgc.py") & _imports(SRC / "feedback.py")
    assert {m for m in _imports(SRC / "compressors" / "state.py") if m.startswith("gradcomp")} == {
        "gradcomp.compressors.base",
        "gradcomp.errors",
        "gradcomp.step_state",  # a leaf: the thread's step record, where the open journal is kept
    }


# single-message compressors that keep per-slot state, as make() builds them (what compress_fsdp may carry)
STATEFUL = {
    "topk-ef": ("topk", {"density": 0.3, "error_feedback": True}),
    "efsignsgd": ("efsignsgd", {}),
    "onebit": ("onebit", {}),
    "signum": ("signum", {}),
    "dgc": ("dgc", {"density": 0.3}),
    "topk-momentum-masking": ("topk", {"density": 0.3, "feedback": "momentum_masking"}),
    "randomk-ef": ("randomk", {"density": 0.3, "error_feedback": True}),
}


@pytest.mark.parametrize("label", sorted(STATEFUL))
def test_a_journal_undoes_exactly_what_a_step_changed(label):
    """Two steps make state; a third, compressed inside ``journal()`` over A and a slot seen for the first time,
    is undone: the state dict is the one before it, bit for bit, and the new slot has no state again."""
    from distributed import same

    name, params = STATEFUL[label]
    compressor = gradcomp.make(name, **params)
    g = torch.Generator().manual_seed(0)
    big_a, new = Slot("a.weight", 0, 60), Slot("c.weight", 2, 40)
    for step in range(2):
        compressor.compress(torch.randn(60, generator=g), big_a, step)
    before = compressor.state_dict()
    with journal() as touched:
        compressor.compress(torch.randn(60, generator=g), big_a, 2)
        compressor.compress(torch.randn(40, generator=g), new, 2)
    assert not same(before, compressor.state_dict())  # the step did change it
    touched.undo()
    assert same(before, compressor.state_dict())
    compressor.compress(torch.randn(60, generator=g), big_a, 2)  # and the slots go on from there
