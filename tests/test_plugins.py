"""Methods from another package: examples/plugin (``gradcomp-blocksign``) ships a compressor (``blocksign``) and a
scheme (``scalecom``), found through the entry-point group ``gradcomp.methods``, listed by ``gradcomp list``, built
by ``make`` and trained by ``gradcomp train``.

The test set-up installs it (README's test command, ``.ci/run``: ``pip install --no-deps -e examples/plugin``);
gradcomp itself does not know its name anywhere.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
import torch

import gradcomp
from gradcomp import ErrorFeedback, Slot
from gradcomp.cli import main
from gradcomp.registry import BUILTIN, ENTRY_POINT_GROUP, compressor_class, origin
from gradcomp.schemes import Scheme
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES, decode, encode


@pytest.fixture(scope="module", autouse=True)
def installed():
    try:
        dist = distribution("gradcomp-blocksign")
    except PackageNotFoundError:
        pytest.fail("the example plugin is not installed: pip install --no-deps -e examples/plugin (README)")
    names = {ep.name for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP}
    assert names == {"blocksign", "scalecom"}


def test_the_plugin_is_found_and_is_no_builtin():
    assert "blocksign" in gradcomp.available() and "blocksign" not in BUILTIN
    assert origin("blocksign") == f"plugin gradcomp-blocksign {distribution('gradcomp-blocksign').version}"
    cls = compressor_class("blocksign")
    assert cls.__module__ == "gradcomp_blocksign" and issubclass(cls, gradcomp.Compressor)


def test_gradcomp_list_shows_the_plugin(capsys):
    assert main(["list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "plugin gradcomp-blocksign" in lines["blocksign"]
    assert "gathered" in lines["blocksign"] and "error feedback on" in lines["blocksign"]
    assert "block=None" in lines["blocksign"]
    assert "plugin" not in lines["topk"]


def test_make_builds_it_like_a_builtin():
    c = gradcomp.make("blocksign")
    assert isinstance(c, ErrorFeedback) and c.inner.name == "blocksign"  # the paper's error feedback, by default
    bare = gradcomp.make("blocksign", error_feedback=False, block=4)
    assert type(bare).__name__ == "BlockSign" and bare.params() == {"block": 4}
    with pytest.raises(gradcomp.ConfigError, match="block"):
        gradcomp.make("blocksign", block=0)
    with pytest.raises(gradcomp.ConfigError, match="no parameter 'density'"):
        gradcomp.make("blocksign", density=0.1)


def test_blockwise_scaled_sign_on_the_wire():
    c = gradcomp.make("blocksign", error_feedback=False, block=3)
    slot = Slot("w", 0, 7)
    x = torch.tensor([1.0, -2.0, 3.0, 0.0, -4.0, 5.0, -6.0])
    specs = c.specs(slot)
    fields = decode(encode(c.compress(x, slot, 0), specs), specs)
    # blocks [1, -2, 3], [0, -4, 5], [-6]: scales are the mean magnitudes, signs as sent (zero goes as +)
    assert torch.equal(fields[0], torch.tensor([2.0, 3.0, 6.0]))
    assert torch.equal(c.decompress(fields, slot, 0), torch.tensor([2.0, -2.0, 2.0, 3.0, -3.0, 3.0, -6.0]))
    whole = gradcomp.make("blocksign", error_feedback=False)  # the paper's block: the whole slot (a layer)
    assert torch.equal(whole.compress(x, slot, 0)[0], torch.tensor([3.0]))
    empty = Slot("e", 1, 0)
    assert whole.decompress(decode(encode(whole.compress(torch.zeros(0), empty, 0), whole.specs(empty)),
                                   whole.specs(empty)), empty, 0).numel() == 0


def _message_bits(numels: list[int]) -> int:
    """One step's encoded message of every slot, block=None: one float32 scale and d sign bits per slot."""
    sections = sum(2 * SECTION_HEADER_BYTES + 4 + -(-d // 8) for d in numels)
    return 8 * (HEADER_BYTES + sections)


@pytest.mark.slow
def test_gradcomp_train_trains_with_the_plugin(tmp_path):
    """Two spawned gloo workers, each of which finds the plugin itself; the bytes are the plugin's specs'."""
    out = tmp_path / "run.json"
    steps = 12
    args = ["train", "--dataset", "synthetic", "--model", "mlp", "--steps", str(steps), "--no-progress",
            "--workers", "2", "--compressor", "blocksign", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["compressor"] == "blocksign" and result["error_feedback"] and result["backend"] == "gloo"
    assert result["replicas_identical"]
    mlp_slots = [64 * 128, 128, 128 * 10, 10]
    assert result["bits_up_per_worker"] == steps * (_message_bits(mlp_slots) + 32)  # + the 4-byte agreement flag
    assert result["control_bits_up"] == steps * 32
    losses = [loss for _, loss in result["loss_curve"]]
    assert sum(losses[-3:]) / 3 < losses[0]  # it learns
    assert result["test_accuracy"] > 0.3  # ten classes: chance is 0.1


# -- the scheme: ScaleCom's cyclic local top-k (examples/plugin/gradcomp_scalecom.py) ------------------------------

def test_the_plugin_scheme_is_found_and_is_no_builtin():
    assert "scalecom" in gradcomp.available() and "scalecom" not in BUILTIN
    assert origin("scalecom") == f"plugin gradcomp-blocksign {distribution('gradcomp-blocksign').version}"
    cls = compressor_class("scalecom")
    assert cls.__module__ == "gradcomp_scalecom" and issubclass(cls, Scheme)


def test_gradcomp_list_shows_the_plugin_scheme(capsys):
    assert main(["list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "own rounds" in lines["scalecom"] and "plugin gradcomp-blocksign" in lines["scalecom"]
    assert lines["scalecom"].endswith("density=0.01 beta=1.0")


def test_make_builds_the_scheme_and_refuses_bad_parameters():
    s = gradcomp.make("scalecom", density=0.05, beta=0.5)
    assert type(s).__name__ == "ScaleCom" and isinstance(s, Scheme) and s.params() == {"density": 0.05, "beta": 0.5}
    assert gradcomp.make("scalecom").params() == {"density": 0.01, "beta": 1.0}
    for bad in ({"density": 0}, {"density": 1.5}, {"density": "0.1"}, {"density": math.nan}, {"density": True}):
        with pytest.raises(gradcomp.ConfigError, match=r"density .*must be a number in \(0, 1\]"):
            gradcomp.make("scalecom", **bad)
    for bad in ({"beta": 0}, {"beta": 1.01}, {"beta": None}):
        with pytest.raises(gradcomp.ConfigError, match=r"beta \(the memory's low-pass filter"):
            gradcomp.make("scalecom", **bad)
    with pytest.raises(gradcomp.ConfigError, match="no parameter 'k'"):
        gradcomp.make("scalecom", k=10)
    with pytest.raises(gradcomp.ConfigError, match="owns its rounds and takes no error feedback"):
        gradcomp.make("scalecom", error_feedback=True)


# three workers; slot w: k = ceil(0.5·6) = 3, slot b: k = 1, slot e: empty (nothing sent)
SCALECOM_SLOTS = [Slot("w", 0, 6), Slot("b", 1, 2), Slot("e", 2, 0)]
SCALECOM_GRADS = {  # rank → one gradient per slot, the same at every step
    0: [[4.0, -1.0, 0.0, 2.0, -3.0, 0.5], [0.5, -2.0], []],
    1: [[1.0, 5.0, -2.0, 0.0, 1.5, 0.0], [1.0, 1.0], []],
    2: [[0.0, 1.0, 1.0, -6.0, 2.0, 1.0], [-1.0, 3.0], []],
}


def _scalecom_cluster(world, grads, steps, density=0.5, beta=1.0, state=None):
    """Per worker: (list over steps of (outputs, payload bytes up, payload bytes down), state_dict at the end);
    ``state`` (a state_dict per rank) is loaded first; ``grads(rank, step)`` gives the tensors."""

    def worker(t):
        scheme = gradcomp.make("scalecom", density=density, beta=beta)
        if state is not None:
            scheme.load_state_dict(state[t.rank])
        ex = gradcomp.GradientExchange(scheme, t)
        history = []
        for step in steps:
            before = t.counter.snapshot()
            out = ex.exchange(SCALECOM_SLOTS, grads(t.rank, step), step)
            history.append(([o.clone() for o in out], t.counter.up_payload - before.up_payload,
                            t.counter.down_payload - before.down_payload))
        return history, scheme.state_dict()

    with gradcomp.SimulatedCluster(world, timeout=60) as cluster:
        return cluster.run(worker)


def test_scalecom_two_steps_by_hand():
    """Step 0: worker 0 leads; step 1: worker 1 leads, on v = memory + gradient (memory: v with the sent entries 0)."""
    runs = _scalecom_cluster(3, lambda r, step: [torch.tensor(g) for g in SCALECOM_GRADS[r]], range(2))
    # step 0, slot w: worker 0's 3 largest |g| are at 0, 3, 4; the sums there are 5, -4, 0.5. Slot b: at 1, sum 2
    # memories after it: w: [0, -1, 0, 0, 0, .5], [0, 5, -2, 0, 0, 0], [0, 1, 1, 0, 0, 1]; b: [.5, 0], [1, 0], [-1, 0]
    # step 1, v = memory + g; slot w: worker 1's v = [1, 10, -4, 0, 1.5, 0], largest at 1, 2, 4: sums 10, -2, 0.5;
    # slot b: worker 1's v = [2, 1], largest at 0: sum 1 + 2 - 2 = 1
    expected = [
        [[5 / 3, 0, 0, -4 / 3, 0.5 / 3, 0], [0, 2 / 3], []],
        [[0, 10 / 3, -2 / 3, 0, 0.5 / 3, 0], [1 / 3, 0], []],
    ]
    # the leader's positions: one container, a POSITIONS section per slot of ceil(k·bits_needed(d) / 8) bytes
    positions = HEADER_BYTES + 3 * SECTION_HEADER_BYTES + math.ceil(3 * 3 / 8) + math.ceil(1 * 1 / 8) + 0
    values = 4 * (3 + 1)  # the float32 sum-allreduce of the values at those positions
    for rank, (history, _) in enumerate(runs):
        for step, (out, up, down) in enumerate(history):
            for got, want in zip(out, expected[step]):
                assert torch.allclose(got, torch.tensor(want), rtol=0, atol=1e-6), (rank, step, got, want)
            leads = rank == step
            assert (up, down) == ((positions + values, values) if leads else (values, positions + values))


def _reference_scalecom(grads, world, steps, slots, density, beta):
    """The paper's arithmetic, without the library: per step the mean of v = m + g at the leader's top-k of |v|,
    then m ← (1 − β)·m + β·(v with those entries 0)."""
    memory = {(r, i): torch.zeros(s.numel) for r in range(world) for i, s in enumerate(slots)}
    outs = []
    for step in steps:
        leader, out = step % world, []
        for i, slot in enumerate(slots):
            v = {r: memory[r, i] + grads(r, step)[i] for r in range(world)}
            k = math.ceil(density * slot.numel)
            chosen = sorted(range(slot.numel), key=lambda j: -abs(float(v[leader][j])))[:k]
            result = torch.zeros(slot.numel)
            for j in chosen:
                result[j] = sum(float(v[r][j]) for r in range(world)) / world
            out.append(result)
            for r in range(world):
                left = v[r].clone()
                left[chosen] = 0
                memory[r, i] = (1 - beta) * memory[r, i] + beta * left
        outs.append(out)
    return outs


def _random_grads(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s.numel, generator=gen) * (1 + rank) for s in SCALECOM_SLOTS]


def test_scalecom_low_pass_memory_against_the_formula_and_resumes_from_its_state():
    world, steps, density, beta = 4, range(5), 0.34, 0.3
    runs = _scalecom_cluster(world, _random_grads, steps, density, beta)
    want = _reference_scalecom(_random_grads, world, steps, SCALECOM_SLOTS, density, beta)
    for history, _ in runs:  # every replica holds the same aggregate, the formula's
        for (out, _, _), expected in zip(history, want):
            for got, ref in zip(out, expected):
                assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    # the memory is the state: three steps, a state_dict, then new schemes that load it give steps 3 and 4 again
    first = _scalecom_cluster(world, _random_grads, range(3), density, beta)
    resumed = _scalecom_cluster(world, _random_grads, range(3, 5), density, beta, state=[s for _, s in first])
    for (history, _), (whole, _) in zip(resumed, runs):
        for (out, _, _), (expected, _, _) in zip(history, whole[3:]):
            assert all(torch.equal(a, b) for a, b in zip(out, expected))


def _scalecom_training(nan_at_step_2: bool | None):
    """Three simulated workers train a small model with scalecom for 6 steps; at step 2, rank 1's gradient is NaN
    (True), or step 2 never happens (None). Per worker: the steps that raised, the final parameters."""

    def fn(t):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        agg = gradcomp.GradientAggregator(model, gradcomp.make("scalecom", density=0.25, beta=0.5), t)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        raised = []
        for step in range(6):
            g = torch.Generator().manual_seed(10 * step + t.rank)
            x, y = torch.randn(5, 16, generator=g), torch.randint(0, 8, (5,), generator=g)
            if step == 2 and nan_at_step_2 is None:
                continue
            if step == 2 and t.rank == 1:
                x[0, 0] = float("nan")
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            try:
                agg.step()
            except gradcomp.NonFiniteGradientError as exc:
                raised.append(exc.step)
                continue
            opt.step()
        return raised, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    with gradcomp.SimulatedCluster(3, timeout=60) as cluster:
        return cluster.run(fn)


def test_scalecom_a_non_finite_step_is_undone_exactly():
    """Every worker abandons the step one worker's NaN spoils, and no worker's memory keeps anything of it."""
    with_nan, without = _scalecom_training(True), _scalecom_training(None)
    for (raised, p), (none_raised, q) in zip(with_nan, without):
        assert raised == [2] and none_raised == []
        assert torch.equal(p, q), "the state after the undone step differs from never having had it"


def _fuzz_wire():
    """scripts/fuzz_wire.py (as tests/test_wire_fuzz.py loads it)."""
    if "fuzz_wire" not in sys.modules:
        script = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_wire.py"
        spec = importlib.util.spec_from_file_location("fuzz_wire", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["fuzz_wire"]


def test_scalecom_sends_only_sums_and_containers_that_reject_mutations():
    """Two simulated workers, two steps (each leads once): the positions are a container, and every mutated copy
    of it replayed into the receiving worker's step is refused (a WireError), never a crash or a silent change."""
    fuzz_wire = _fuzz_wire()
    decoder = fuzz_wire.build_scheme_decoder("scalecom", "scalecom", {"density": 0.05}, "auto", 2)
    # per step, the one broadcast as each worker receives it (the leader decodes its own as well)
    assert decoder.unframed == [] and len(decoder.messages) == 4
    result = fuzz_wire.Result()
    fuzz_wire.fuzz_scheme(decoder, 48, 1, result)
    report = fuzz_wire.format_report(result)
    assert result.total(outcome="crash") == 0 and result.total(fuzz_wire.MUST_NOT_BE_SILENT, "silent") == 0, report
    for kind in fuzz_wire.KINDS:
        if kind not in ("payload+crc", "extend"):  # a checksum recomputed over changed data; bytes past the length
            tried = result.total([kind]) - result.total([kind], "unchanged")
            assert tried > 0 and result.total([kind], "rejected") == tried, kind


def test_gradcomp_train_trains_with_the_plugin_scheme(tmp_path, capsys):
    """The simulated cluster, through the command line; the bytes are the leader's positions and the values."""
    out = tmp_path / "run.json"
    steps = 12
    args = ["train", "--dataset", "synthetic", "--model", "mlp", "--steps", str(steps), "--no-progress",
            "--workers", "2", "--simulate", "--compressor", "scalecom", "--param", "density=0.1", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["compressor"] == "scalecom" and result["params"] == {"density": 0.1}
    assert result["replicas_identical"]
    mlp_slots = [64 * 128, 128, 128 * 10, 10]
    ks = [math.ceil(0.1 * d) for d in mlp_slots]
    positions = 8 * (HEADER_BYTES + sum(SECTION_HEADER_BYTES + -(-k * max(1, (d - 1).bit_length()) // 8)
                                        for k, d in zip(ks, mlp_slots)))
    values = 32 * sum(ks)
    # every step: the values and the 4-byte agreement flag; every other step (the 2 workers lead in turn): the positions
    assert result["bits_up_by_worker"] == [steps * (values + 32) + steps // 2 * positions] * 2
    losses = [loss for _, loss in result["loss_curve"]]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3  # it learns
    assert result["test_accuracy"] > 0.5  # ten classes: chance is 0.1
    assert main(args[:-4] + ["--param", "density=2"]) == 2
    err = capsys.readouterr().err
    assert "density (the fraction of each slot's entries sent) must be a number in (0, 1], got 2" in err


def test_the_docs_walkthrough_shows_the_plugins_code_as_it_is():
    """docs/adding-a-method.md quotes the compressor's class and the plugin's entry points: each quoted block
    stands verbatim in examples/plugin, so the page cannot drift from the code it walks through."""
    root = Path(__file__).resolve().parent.parent
    blocks = re.findall(r"```(\w+)\n(.*?)```", (root / "docs" / "adding-a-method.md").read_text(), re.S)
    compressor = (root / "examples" / "plugin" / "gradcomp_blocksign.py").read_text()
    project = (root / "examples" / "plugin" / "pyproject.toml").read_text()
    quoted = [b for lang, b in blocks if lang == "python" and b.startswith("class BlockSign(")]
    assert len(quoted) == 1 and quoted[0] in compressor
    tomls = [b for lang, b in blocks if lang == "toml"]
    assert tomls and all(b in project for b in tomls)
