"""Defaults that train (issue 52): every method + feedback pair `gradcomp train` accepts runs at its defaults, and
the pairs measured not to train on the MNIST job are refused there before any worker starts, naming the remedy.
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

import gradcomp.experiments.run.launch as launch_module
from gradcomp.cli import main
from gradcomp.errors import ConfigError
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.run.defaults import RULES, accepted_pairs, refuse_untrained_defaults

TINY = ["--dataset", "synthetic", "--model", "mlp", "--workers", "2", "--simulate", "--no-progress"]
PAIRS = accepted_pairs(dataset="synthetic", model="mlp", workers=2, simulate=True)

# the pairs that docs/methods/feedback.md's sweep measured not to train at their defaults on MNIST, with the
# flags that ask for them: written out here (not read from RULES) so that a rule dropped is a test that fails
MC, MM = ["--feedback", "momentum_correction"], ["--feedback", "momentum_masking"]
REFUSED: list[tuple[str, list[str]]] = [
    ("randomk", ["--error-feedback"]), ("randomk", MC), ("randomk", MM),
    ("randomblock", []), ("randomblock", ["--feedback", "residual"]), ("randomblock", MC),
    ("randomblock", ["--param", "density=0.01", *MM]),  # a --param at its default is the default
    ("natural_dithering", ["--feedback", "residual"]), ("natural_dithering", MC), ("natural_dithering", MM),
    ("random_dithering", []), ("random_dithering", ["--error-feedback"]), ("random_dithering", MC),
    ("random_dithering", MM),
    ("qsgd", ["--error-feedback"]), ("qsgd", MC), ("qsgd", MM),
    ("signsgd", []), ("signsgd", ["--error-feedback"]), ("signsgd", MC), ("signsgd", MM),
    ("signum", []), ("signum", ["--error-feedback"]),
    ("efsignsgd", []), ("onebit", []), ("onebit", ["--no-error-feedback"]),
    ("sbc", []), ("sbc", ["--error-feedback"]),
]


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory):
    """A folder of MNIST-format IDX files, 512 training and 64 test images of noise: `--dataset mnist` (which the
    rules are scoped to) at a fraction of the real set's evaluation time."""
    folder = tmp_path_factory.mktemp("tiny_mnist")
    g = torch.Generator().manual_seed(0)
    for name, n in (("train", 512), ("t10k", 64)):
        images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
        labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        (folder / f"{name}-images-idx3-ubyte").write_bytes(struct.pack(">4I", 0x803, n, 28, 28) + images.numpy().tobytes())
        (folder / f"{name}-labels-idx1-ubyte").write_bytes(struct.pack(">2I", 0x801, n) + labels.numpy().tobytes())
    return folder


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if `gradcomp train` starts a worker (spawned, torchrun or simulated)."""
    def started(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch_module, "launch", started)


@pytest.mark.parametrize("method", sorted({name for name, _, _ in PAIRS}))
def test_every_accepted_pair_runs_finite_at_its_defaults(method, tmp_path, monkeypatch):
    for _, feedback, flags in (p for p in PAIRS if p[0] == method):
        out = tmp_path / f"{feedback}.json"
        assert main(["train", *TINY, "--steps", "5", "--compressor", method, *flags, "--json", str(out)]) == 0, feedback
        result = json.loads(out.read_text())
        assert result["steps"] == 5
        assert all(math.isfinite(loss) for _, loss in result["loss_curve"]), (method, feedback)


def test_the_sweep_covers_every_method_with_its_policies():
    names = {name for name, _, _ in PAIRS}
    from gradcomp.registry import BUILTIN

    assert names == set(BUILTIN)
    assert ("randomblock", "momentum_correction", ["--feedback", "momentum_correction"]) in PAIRS
    assert ("sbc", "residual", []) in PAIRS and ("sbc", "none", ["--feedback", "none"]) in PAIRS  # sbc's default: EF
    assert not [p for p in PAIRS if p[0] == "dgc" and p[1] != "none"]  # dgc keeps its own residual


@pytest.mark.parametrize(("method", "flags"), REFUSED, ids=[" ".join([m, *f]) for m, f in REFUSED])
def test_refused_before_any_worker_with_one_line_naming_the_remedy(method, flags, no_workers, capsys, monkeypatch):
    assert main(["train", "--steps", "5", "--no-progress", "--compressor", method, *flags]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("gradcomp: error:")]
    assert len(lines) == 1 and "does not train" in lines[0], err
    rule = next(r for r in RULES if r.method == method)
    named = lines[0].rsplit(": give ", 1)[1].split(" or ")
    assert len(named) == len(rule.remedies)
    for remedy, said in zip(rule.remedies, named):
        assert set(said.split()) <= set(remedy.split()), (said, remedy)  # less only the policy it already has


REMEDIES = [(rule, remedy) for rule in RULES for remedy in rule.remedies]


@pytest.mark.parametrize(("rule", "remedy"), REMEDIES, ids=[f"{r.method} {m}" for r, m in REMEDIES])
def test_the_remedy_runs(rule, remedy, tiny_mnist, tmp_path, monkeypatch):
    out = tmp_path / "run.json"
    flags = remedy.split()
    if "--feedback" not in flags:
        flags = ["--feedback", rule.feedbacks[0], *flags]
    args = ["train", "--data", str(tiny_mnist), "--steps", "3", "--workers", "2", "--simulate", "--no-progress",
            "--compressor", rule.method, *flags, "--json", str(out)]
    refused = [*args[:args.index("--compressor") + 2], "--feedback", rule.feedbacks[0]]
    assert main(refused) == 2  # without the remedy: refused, on these files too
    assert main(args) == 0
    assert all(math.isfinite(loss) for _, loss in json.loads(out.read_text())["loss_curve"])


def test_an_explicit_setting_is_not_refused_and_the_rules_can_be_turned_off(monkeypatch):
    if not RULES:
        pytest.skip("no rules")
    rule = RULES[0]
    fields = {"compressor": rule.method, "feedback": rule.feedbacks[0], "steps": 5}
    with pytest.raises(ConfigError, match="does not train"):
        refuse_untrained_defaults(TrainConfig(**fields))
    refuse_untrained_defaults(TrainConfig(**fields, lr=0.01))  # another lr: the user's choice
    refuse_untrained_defaults(TrainConfig(**fields, momentum=0.5))
    refuse_untrained_defaults(TrainConfig(**fields, model="mlp"))  # not measured there
    TrainConfig(**fields).validate()  # the library (sweep, race, plan) builds it unrefused


def test_the_command_line_flag_turns_the_refusal_off(no_workers, capsys):
    rule = RULES[0]
    argv = ["train", "--steps", "5", "--no-progress", "--compressor", rule.method, "--feedback", rule.feedbacks[0]]
    assert main(argv) == 2 and "does not train" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="a worker was started"):  # past the refusal, to the launch
        main([*argv, "--allow-untrained-defaults"])
