"""Workloads beyond MNIST: the byte-level Transformer and its corpus, the ResNet's BatchNorm buffers, AdamW and
learning-rate schedules, and several seeds. Tiny configurations, a few steps each."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from gradcomp.cli import main
from gradcomp.errors import ConfigError
from gradcomp.experiments.run import checkpoint
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.run.data import TextDataset, corpus_files, load_dataset, split_files, stdlib_dir
from gradcomp.experiments.run.models import ResNet, TransformerLM, build_model
from gradcomp.experiments.run.report import aggregate_seeds, mean_std, parse_seeds
from crash import crash_at

TINY_LM = ["--model", "transformer_tiny", "--context", "32", "--no-progress", "--simulate", "--workers", "2"]


# -- the corpus ---------------------------------------------------------------------------------------------


def test_the_corpus_split_is_deterministic_disjoint_and_complete():
    files = corpus_files(stdlib_dir())
    assert len(files) >= 10 and [f.name for f in files] == sorted(f.name for f in files)
    train, val = split_files(files)
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(files)
    assert [f.name for f in val] == [f.name for i, f in enumerate(files) if i % 10 == 9]
    a = load_dataset("pystdlib", context=32)
    b = load_dataset("pystdlib", context=32)
    assert isinstance(a, TextDataset) and a.sha256 == b.sha256
    assert set(a.train_files).isdisjoint(a.validation_files)
    whole = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    assert a.sha256 == whole
    assert a.train_bytes == sum(f.stat().st_size for f in train)
    assert a.validation_bytes == sum(f.stat().st_size for f in val)
    # windows and their next-byte targets
    assert a.train_x.shape[1] == 32 and torch.equal(a.train_x[0, 1:], a.train_y[0, :-1])
    assert torch.equal(a.train_x[1, 0:1], a.train_y[0, -1:])
    # the unigram entropy of the training split, from its byte counts
    assert 3.0 < a.unigram_entropy_bits() < 8.0


def test_a_corpus_that_cannot_be_found_says_where_it_looked(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path / "nowhere")):
        load_dataset("pystdlib", root=tmp_path / "nowhere")
    (tmp_path / "few").mkdir()
    (tmp_path / "few" / "a.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match=r"holds 1 top-level \*\.py files"):
        load_dataset("pystdlib", root=tmp_path / "few")


def test_a_corpus_of_ones_own_files_splits_by_file(tmp_path):
    for i in range(20):
        (tmp_path / f"m{i:02d}.py").write_bytes(bytes([65 + i]) * 100)
    data = load_dataset("pystdlib", root=tmp_path, context=8)
    assert data.validation_files == ("m09.py", "m19.py")
    assert set(data.test_x.unique().tolist()) <= {65 + 9, 65 + 19}  # validation bytes come from those files only
    assert 65 + 9 not in data.train_text.unique().tolist()


# -- the Transformer ----------------------------------------------------------------------------------------


def test_the_transformer_is_causal_and_its_embeddings_are_tied():
    torch.manual_seed(0)
    model = TransformerLM(vocab=256, context=16, layers=2, dim=32, heads=2).eval()
    assert model.head.weight is model.embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and "head.weight" not in names  # exchanged once
    x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    changed = x.clone()
    changed[:, 10] = (changed[:, 10].long() + 1).to(torch.uint8)
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])  # earlier positions do not see the future token
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_the_default_transformer_has_one_to_three_million_parameters():
    data = load_dataset("pystdlib")
    n = sum(p.numel() for p in build_model("transformer", data, 0).parameters())
    assert 1_000_000 <= n <= 3_000_000


def test_models_and_data_of_the_wrong_kind_are_refused():
    with pytest.raises(ConfigError, match="language model"):
        build_model("transformer", load_dataset("synthetic"), 0)
    with pytest.raises(ConfigError, match="text"):
        build_model("cnn", load_dataset("pystdlib", context=16), 0)
    with pytest.raises(ConfigError, match="unknown model"):
        build_model("gpt5", load_dataset("synthetic"), 0)


def test_a_tiny_transformer_trains_and_reports_bits_per_byte(tmp_path):
    out = tmp_path / "lm.json"
    assert main(["train", *TINY_LM, "--steps", "6", "--eval-every", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["optimizer"] == "adamw" and r["lr_schedule"] == "cosine" and r["dataset"] == "pystdlib"
    assert r["replicas_identical"]
    assert [s for s, _ in r["val_loss_curve"]] == [3, 6]
    assert r["val_loss_curve"][-1][1] == pytest.approx(r["val_bits_per_byte"])
    assert r["val_perplexity"] == pytest.approx(2 ** r["val_bits_per_byte"])
    assert r["val_bits_per_byte"] < 8.0  # below a uniform guess over 256 byte values
    assert r["corpus"]["corpus_sha256"] and r["corpus"]["train_bytes"] > 0
    assert r["bits_up_per_worker"] == r["dense_bits_per_worker"]  # fp32: every parameter once (tied: once)


def test_curves_reads_a_language_model_run_by_loss_lower_is_better(tmp_path, capsys):
    out = tmp_path / "lm.json"
    assert main(["train", *TINY_LM, "--steps", "4", "--eval-every", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    reached = r["val_loss_curve"][0][1]
    capsys.readouterr()
    assert main(["curves", f"{out}=lm", "--target-loss", f"{reached + 1e-9},0.01"]) == 0
    text = capsys.readouterr().out
    assert "first ≤" in text and "| lm | 4 | 1 |" in text and "step 2 | – |" in text


# -- the ResNet and its BatchNorm buffers -------------------------------------------------------------------


@pytest.mark.slow
def test_batchnorm_buffers_stay_identical_across_gloo_workers_and_are_counted_apart(tmp_path):
    out = tmp_path / "resnet.json"
    steps = 3
    assert main(["train", "--model", "resnet", "--dataset", "synthetic", "--workers", "2", "--steps", str(steps),
                 "--no-progress", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backend"] == "gloo" and r["replicas_identical"]  # parameters and buffers, digest for digest
    model = ResNet(1, 10)
    floats = sum(b.numel() * b.element_size() for b in model.buffers())
    assert r["num_buffer_elements"] == sum(b.numel() for b in model.buffers())
    # one broadcast from rank 0 before every step and one after the last: rank 0 sends, rank 1 receives
    total = 8 * floats * (steps + 1)
    assert r["buffer_bits_up_per_worker"] == total / 2 and r["buffer_bits_down_per_worker"] == total / 2
    assert r["bits_up_per_worker"] == r["dense_bits_per_worker"]  # the gradient bits leave the buffers out


def test_batchnorm_buffers_differ_between_replicas_without_the_broadcast(monkeypatch, tmp_path):
    from gradcomp.experiments.run import runner

    out = tmp_path / "resnet.json"
    args = ["train", "--model", "resnet", "--dataset", "synthetic", "--workers", "2", "--steps", "2",
            "--no-progress", "--simulate", "--json", str(out)]
    assert main(args) == 0
    assert json.loads(out.read_text())["replicas_identical"]
    monkeypatch.setattr(runner, "synced_buffers", lambda model: [])
    assert main(args) == 0
    assert not json.loads(out.read_text())["replicas_identical"]  # each replica's own running statistics


# -- AdamW and learning-rate schedules ----------------------------------------------------------------------


def test_learning_rate_schedules_at_given_steps():
    cfg = TrainConfig(lr=1.0, lr_schedule="cosine", warmup_steps=4)
    assert [cfg.lr_at(s, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cfg.lr_at(4, 14) == 1.0
    assert cfg.lr_at(9, 14) == pytest.approx(0.5)  # halfway through the 10 steps after the warm-up
    assert cfg.lr_at(14, 14) == pytest.approx(0.0)
    step = TrainConfig(lr=0.1, lr_schedule="step", lr_step_size=3, lr_gamma=0.5)
    assert [step.lr_at(s, 100) for s in (0, 2, 3, 6, 9)] == pytest.approx([0.1, 0.1, 0.05, 0.025, 0.0125])
    assert TrainConfig(lr=0.3).lr_at(50, 100) == 0.3


def test_adamw_takes_its_hyper_parameters_and_the_optimizer_runs_at_the_scheduled_rate(tmp_path):
    from gradcomp.experiments.run.runner import make_optimizer, set_lr

    cfg = TrainConfig(optimizer="adamw", momentum=0.0, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    model = torch.nn.Linear(3, 1)
    opt = make_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6 and group["weight_decay"] == 0.1
    set_lr(opt, cfg.lr_at(0, 10))
    assert group["lr"] == 0.01
    # one AdamW step from zero state moves every weight by lr·(1 ± tiny) opposite its gradient's sign (and decays)
    before = model.weight.detach().clone()
    model.weight.grad = torch.tensor([[1.0, -2.0, 3.0]])
    model.bias.grad = torch.zeros(1)
    opt.step()
    expected = before * (1 - 0.01 * 0.1) - 0.01 * torch.sign(torch.tensor([[1.0, -2.0, 3.0]]))
    assert torch.allclose(model.weight.detach(), expected, atol=1e-5)


def test_adamw_and_a_cosine_schedule_resume_bit_exactly(tmp_path, monkeypatch, capsys):
    args = [*TINY_LM, "--steps", "6", "--compressor", "topk", "--param", "density=0.1", "--error-feedback"]
    ref = tmp_path / "ref.json"
    assert main(["train", *args, "--json", str(ref)]) == 0
    root = tmp_path / "ckpt"
    crash_at(monkeypatch, 5)
    assert main(["train", *args, "--checkpoint", str(root), "--checkpoint-every", "2"]) == 2
    crash_at(monkeypatch, None)
    resumed = tmp_path / "resumed.json"
    assert main(["train", *args, "--resume", str(root), "--json", str(resumed)]) == 0
    a, b = json.loads(ref.read_text()), json.loads(resumed.read_text())
    assert b["resumed_from_step"] == 4
    assert b["parameter_digest"] == a["parameter_digest"] and b["val_bits_per_byte"] == a["val_bits_per_byte"]
    # the optimizer is part of what a checkpoint must match
    capsys.readouterr()
    assert main(["train", *args, "--optimizer", "sgd", "--lr", "0.1", "--resume", str(root)]) == 2
    assert "optimizer" in capsys.readouterr().err


def test_adamw_state_is_needed_for_the_bit_exact_resume(tmp_path, monkeypatch, capsys):
    args = [*TINY_LM, "--steps", "6"]
    ref = tmp_path / "ref.json"
    assert main(["train", *args, "--json", str(ref)]) == 0
    root = tmp_path / "ckpt"
    crash_at(monkeypatch, 5)
    assert main(["train", *args, "--checkpoint", str(root), "--checkpoint-every", "2"]) == 2
    crash_at(monkeypatch, None)
    monkeypatch.setattr(checkpoint, "_restore_optimizer", lambda optimizer, state: None)
    resumed = tmp_path / "resumed.json"
    assert main(["train", *args, "--resume", str(root), "--json", str(resumed)]) == 0
    assert json.loads(resumed.read_text())["parameter_digest"] != json.loads(ref.read_text())["parameter_digest"]


# -- refusals, before any worker starts ---------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--compressor", "signum"], "signum applies momentum on the worker"),
    (["--compressor", "dgc"], "dgc applies momentum on the worker"),
    (["--compressor", "topk", "--feedback", "momentum_correction"], "AdamW has no momentum"),
    (["--lr-schedule", "step"], "--lr-schedule step needs --lr-step-size"),
    (["--lr-step-size", "5"], "--lr-step-size applies to --lr-schedule step"),
    (["--momentum", "0.9"], "--momentum is SGD's"),
    (["--optimizer", "sgd", "--beta1", "0.8"], "AdamW's"),
    (["--warmup-steps", "10", "--steps", "5"], "--warmup-steps 10 leaves no step"),
    (["--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
    (["--seeds", "0,x"], "--seeds takes comma-separated whole numbers"),
    (["--seeds", "1,1"], "seed 1 is given twice"),
])  # fmt: skip
def test_bad_workload_options_are_refused_before_any_worker_starts(argv, message, capsys, monkeypatch):
    from gradcomp.experiments.run import launch

    monkeypatch.setattr(launch, "launch", lambda cfg: pytest.fail("a worker was started"))
    capsys.readouterr()
    assert main(["train", *TINY_LM, "--steps", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradcomp: error:") and message in err and err.count("\n") == 1


def test_unknown_model_and_optimizer_are_refused(capsys):
    assert main(["train", "--model", "gpt", "--simulate", "--no-progress", "--steps", "1"]) == 2
    assert "unknown model 'gpt'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown optimizer"):
        TrainConfig(optimizer="adam").validate()
    with pytest.raises(SystemExit):  # argparse's choices
        main(["train", "--optimizer", "adam"])


# -- several seeds ------------------------------------------------------------------------------------------


def test_mean_and_sample_standard_deviation():
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert mean_std([5.0]) == (5.0, 0.0)
    mean, std = mean_std([0.97, 0.98, 0.99, 0.96])
    assert mean == pytest.approx(0.975) and std == pytest.approx(math.sqrt(0.0005 / 3))


def test_parse_seeds():
    assert parse_seeds("0, 1,2") == [0, 1, 2]
    for bad in ("x", "0,0", "", "-1", "1.5"):
        with pytest.raises(ConfigError):
            parse_seeds(bad)


def test_aggregate_seeds_keeps_every_seed_and_their_spread():
    runs = [{"seed": s, "test_accuracy": acc, "bits_up_per_worker": 10.0, "replicas_identical": True,
             "val_bits_per_byte": None} for s, acc in ((0, 0.9), (1, 0.8), (2, 0.7))]
    agg = aggregate_seeds(runs)
    assert agg["seeds"] == [0, 1, 2] and agg["per_seed"]["test_accuracy"] == [0.9, 0.8, 0.7]
    assert agg["mean"]["test_accuracy"] == pytest.approx(0.8) and agg["std"]["test_accuracy"] == pytest.approx(0.1)
    assert agg["std"]["bits_up_per_worker"] == 0.0
    assert "val_bits_per_byte" not in agg["mean"]  # a metric no run has is left out, not averaged as 0


def test_train_with_seeds_reports_each_seed_and_mean_std(tmp_path, capsys):
    out = tmp_path / "seeds.json"
    capsys.readouterr()
    assert main(["train", "--dataset", "synthetic", "--model", "mlp", "--simulate", "--no-progress", "--workers",
                 "2", "--steps", "3", "--seeds", "0,1,2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["seeds"] == [0, 1, 2] and [x["seed"] for x in r["runs"]] == [0, 1, 2]
    accs = [x["test_accuracy"] for x in r["runs"]]
    assert r["per_seed"]["test_accuracy"] == accs
    assert (r["mean"]["test_accuracy"], r["std"]["test_accuracy"]) == pytest.approx(mean_std(accs))
    assert len({x["parameter_digest"] for x in r["runs"]}) == 3  # three different trainings
    text = capsys.readouterr().out
    assert "over seeds 0, 1, 2" in text and f"{100 * accs[1]:.2f}" in text


# -- race: a target loss for the language model, and several seeds ----------------------------------------------


def test_race_checks_the_target_kind_before_anything_starts():
    from gradcomp.experiments.race import race, seeds

    text = race.Options(methods=[race.parse_method("none")], hosts=2, link="none", model="transformer_tiny",
                        dataset="pystdlib", steps=4, train_extra={"optimizer": "adamw", "momentum": 0.0,
                                                                  "context": 32}, momentum=0.0)
    with pytest.raises(ConfigError, match="--target-loss"):
        race.plan(text, log=lambda _: None)
    image = race.Options(methods=[race.parse_method("none")], hosts=2, link="none", model="mlp",
                         dataset="synthetic", target_loss=2.0)
    with pytest.raises(ConfigError, match="applies to a language model"):
        race.plan(image, log=lambda _: None)


def test_race_times_a_loss_target_lower_is_better_and_summarises_seeds():
    from gradcomp.experiments.race import race, seeds

    curve = [[10, 1.0, 5.0], [20, 2.0, 3.1], [30, 3.0, 2.9], [40, 4.0, 3.0]]
    assert race.first_reaching(curve, 3.0, lower=True) == (30, 3.0)
    assert race.first_reaching(curve, 3.0) == (10, 1.0)  # an accuracy target would take the first point
    runs = [{"summary": {"lower_is_better": True, "effective_target": 3.0},
             "methods": [{"label": "a", "time_to_target_s": t, "final_accuracy": f}]}
            for t, f in ((1.0, 2.5), (3.0, 2.7), (None, 3.2))]
    s = seeds.seeds_summary(runs, [0, 1, 2])
    row = s["methods"][0]
    assert row["time_to_target_s"] == [1.0, 3.0, None]
    assert row["time_mean_std"] == pytest.approx((2.0, math.sqrt(2.0)))
    assert row["final_mean_std"] == pytest.approx(mean_std([2.5, 2.7, 3.2]))
    assert "2 of 3 reached" in s["table"] and "1, 3, –" in s["table"]


def test_curves_reads_a_seeds_result_as_mean_and_std(tmp_path, capsys):
    out = tmp_path / "seeds.json"
    assert main(["train", *TINY_LM, "--steps", "4", "--eval-every", "2", "--seeds", "0,1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    at4 = [dict(x["val_loss_curve"])[4] for x in r["runs"]]
    capsys.readouterr()
    assert main(["curves", f"{out}=lm", "--target-loss", "20"]) == 0
    text = capsys.readouterr().out
    mean, std = mean_std(at4)
    assert "| lm | 4 | 2 |" in text and f"| 4 | {mean:.4f} ± {std:.4f} |" in text


def test_race_merge_seeds_keeps_the_last_race_s_methods_and_times_fixed_targets(tmp_path):
    """scripts/race_merge_seeds.py: a full race of one seed joins a seeds race of fewer methods; the fixed-target
    table reads every seed's curve at the same threshold (– where a method never got there)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "race_merge_seeds", Path(__file__).resolve().parents[1] / "scripts" / "race_merge_seeds.py")
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)

    def race_json(seed: int, methods: dict) -> str:
        path = tmp_path / f"race{seed}.json"
        path.write_text(json.dumps({"summary": {"lower_is_better": True, "effective_target": 3.0}, "methods": [
            {"label": label, "curve": curve, "time_to_target_s": next((c[1] for c in curve if c[2] <= 3.0), None),
             "final_accuracy": curve[-1][2]} for label, curve in methods.items()]}))
        return str(path)

    full = race_json(0, {"fp32": [[10, 1.0, 3.5], [20, 2.0, 2.9]], "extra": [[10, 1.0, 9.0]],
                         "cnat": [[10, 1.5, 2.8], [20, 3.0, 2.7]]})
    other = race_json(1, {"fp32": [[10, 1.0, 3.8], [20, 2.0, 3.3]], "cnat": [[10, 1.2, 3.2], [20, 2.4, 2.95]]})
    out = tmp_path / "merged.md"
    assert merge.main([full, other, "--seeds", "0,1", "--thresholds", "3.0,3.4", "--out", str(out)]) == 0
    text = out.read_text()
    assert "extra" not in text
    assert "| fp32 | 2.0, – | 2.0, 2.0 |" in text and "| cnat | 1.5, 2.4 | 1.5, 1.2 |" in text
    assert "| cnat | 1.95 ± 0.64 (2 of 2 reached)" in text
    with pytest.raises(SystemExit):
        merge.main([full, other, "--seeds", "0"])  # two races, one seed
