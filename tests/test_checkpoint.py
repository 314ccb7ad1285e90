"""Resumable checkpoints: bit-exact resume, atomic writes, refusal of another configuration, damaged files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gradcomp.cli import main
from gradcomp.errors import ConfigError
from gradcomp.experiments.run import checkpoint
from crash import crash_at as inject_crash, environment

from gradcomp.experiments.run.checkpoint import CheckpointError, find_checkpoint
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.run.runner import run_simulated, worker_threads

SMALL = ["--dataset", "synthetic", "--model", "mlp", "--no-progress", "--eval-every", "2"]
TOPK = ["--compressor", "topk", "--param", "density=0.05", "--error-feedback"]
REPO = Path(__file__).resolve().parents[1]


def train(out: Path, *args: str, steps: int = 8, workers: int = 3, simulate: bool = True) -> dict:
    argv = ["train", *SMALL, "--steps", str(steps), "--workers", str(workers), *args, "--json", str(out)]
    assert main(argv + (["--simulate"] if simulate else [])) == 0
    return json.loads(out.read_text())


def same_run(a: dict, b: dict) -> None:
    """b (interrupted and resumed) reports what a (uninterrupted) reports: model, bits, curves, syncs."""
    assert b["parameter_digest"] == a["parameter_digest"]
    assert b["replicas_identical"] and a["replicas_identical"]
    for key in ("bits_up_by_worker", "bits_down_by_worker", "padding_bits", "control_bits", "steps", "syncs",
                "loss_curve", "accuracy_curve", "final_loss", "test_accuracy", "server_bits_in"):  # fmt: skip
        assert b[key] == a[key], key


def interrupted_and_resumed(tmp_path: Path, monkeypatch, capsys, args: list[str], crash_at: int, every: int,
                            workers: int = 3, simulate: bool = True) -> dict:  # fmt: skip
    root = tmp_path / "ckpt"
    inject_crash(monkeypatch, crash_at)  # rank 1 fails before step crash_at
    argv = ["train", *SMALL, "--steps", "8", "--workers", str(workers), *args, "--checkpoint", str(root),
            "--checkpoint-every", str(every)] + (["--simulate"] if simulate else [])  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    assert "rank 1: stopped before step" in capsys.readouterr().err
    inject_crash(monkeypatch, None)
    kw = {"workers": workers, "simulate": simulate}
    assert find_checkpoint(root).name == checkpoint.step_dir_name(crash_at // every * every)
    resumed = train(tmp_path / "resumed.json", *args, "--checkpoint", str(root), "--resume", str(root), **kw)
    assert resumed["resumed_from_step"] == crash_at // every * every
    return resumed


METHODS = {
    "topk+ef": (TOPK, 6, 4),
    "sbc, local steps 3": (["--compressor", "sbc", "--param", "density=0.05", "--local-steps", "3"], 6, 4),
    "powersgd": (["--compressor", "powersgd", "--param", "rank=2"], 6, 4),
    "randomk": (["--compressor", "randomk", "--param", "density=0.1", "--lr", "0.01"], 5, 2),
    "qsgd": (["--compressor", "qsgd", "--param", "levels=3"], 6, 4),
    "topk+momentum masking": (["--compressor", "topk", "--param", "density=0.05",
                               "--feedback", "momentum_masking"], 6, 4),
    "ps, server residual": ([*TOPK, "--topology", "ps", "--server-compressor", "topk",
                             "--server-param", "density=0.1"], 6, 4),
    "sketch": (["--compressor", "sketch", "--param", "density=0.05"], 6, 4),
    "lgc (autoencoder)": (["--compressor", "lgc", "--param", "dense_steps=2", "--param", "topk_steps=3",
                           "--param", "density=0.05"], 7, 3),
    "1-bit adam, resumed before its freeze": (["--optimizer", "onebit_adam", "--freeze-step", "4", "--lr", "0.01"],
                                              6, 3),
    "1-bit adam, C_nat warm-up, resumed in it": (["--optimizer", "onebit_adam", "--freeze-step", "4",
                                                  "--warmup-compressor", "cnat", "--lr", "0.01"], 6, 2),
    "0/1 adam, resumed after its freeze": (["--optimizer", "zero_one_adam", "--freeze-step", "3",
                                            "--local-step-scaler", "2", "--lr", "0.01"], 7, 5),
    "diloco (outer nesterov)": (["--optimizer", "adamw", "--lr", "0.01", "--local-steps", "3",
                                 "--outer-optimizer", "nesterov"], 7, 3),
    "topk+ef after dense steps": ([*TOPK, "--dense-steps", "3"], 6, 2),
}  # fmt: skip


@pytest.mark.parametrize("name", list(METHODS))
def test_resumed_simulated_run_is_bit_identical_to_the_uninterrupted_one(tmp_path, monkeypatch, capsys, name):
    args, crash_at, every = METHODS[name]
    reference = train(tmp_path / "reference.json", *args)
    same_run(reference, interrupted_and_resumed(tmp_path, monkeypatch, capsys, args, crash_at, every))


@pytest.mark.parametrize("skipped", ["optimizer", "exchange"])
def test_the_bit_exact_check_sees_a_missing_part_of_the_state(tmp_path, monkeypatch, capsys, skipped):
    """Without the optimizer's momentum, or without the residuals, the resumed run goes elsewhere."""
    reference = train(tmp_path / "reference.json", *TOPK)
    if skipped == "optimizer":
        monkeypatch.setattr(checkpoint, "_restore_optimizer", lambda optimizer, state: None)
    else:
        from gradcomp.train.aggregator import GradientAggregator

        monkeypatch.setattr(GradientAggregator, "load_state_dict", lambda self, state: None)
    resumed = interrupted_and_resumed(tmp_path, monkeypatch, capsys, TOPK, 6, 4)
    assert resumed["parameter_digest"] != reference["parameter_digest"]


def test_a_folder_that_lost_its_latest_pointer_is_not_taken_for_empty(tmp_path, capsys):
    """A checkpoint folder whose 'latest' file is gone still holds complete checkpoints. It was taken for an empty
    folder: a fresh run (or --resume-if-present) wrote into it and pruned the earlier run's checkpoints. Now every
    way in is refused, naming the newest complete checkpoint, and nothing in the folder changes."""
    root = tmp_path / "ckpt"
    train(tmp_path / "a.json", *TOPK, "--checkpoint", str(root), "--checkpoint-every", "2", steps=6)
    (root / checkpoint.LATEST).unlink()
    before = sorted((p.relative_to(root), p.stat().st_size) for p in root.rglob("*"))
    capsys.readouterr()
    for args in (["--checkpoint", str(root)], ["--checkpoint", str(root), "--resume-if-present"],
                 ["--resume", str(root)]):  # fmt: skip
        assert main(["train", *SMALL, "--simulate", "--steps", "8", "--workers", "3", *TOPK, *args]) == 2
        err = capsys.readouterr().err
        assert "step-000006" in err and "Traceback" not in err, err
    assert sorted((p.relative_to(root), p.stat().st_size) for p in root.rglob("*")) == before
    resumed = train(tmp_path / "b.json", *TOPK, "--resume", str(root / "step-000006"), steps=8)
    assert resumed["resumed_from_step"] == 6


def test_a_cosine_schedule_cannot_be_continued_over_another_length(tmp_path, capsys):
    """Cosine decays to 0 at the run's last step: 4 steps continued to 8 matched neither run, silently. The length
    is in the cosine schedule's fingerprint now; a step schedule may still be extended."""
    root = tmp_path / "ckpt"
    train(tmp_path / "a.json", *TOPK, "--lr-schedule", "cosine", "--checkpoint", str(root), steps=4)
    capsys.readouterr()
    argv = ["train", *SMALL, "--simulate", "--steps", "8", "--workers", "3", *TOPK, "--lr-schedule", "cosine",
            "--resume", str(root)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "lr schedule: the checkpoint was made with cosine warmup=0 step=None gamma=0.1 over 4 steps, this run " \
           "asks for cosine warmup=0 step=None gamma=0.1 over 8 steps" in err, err
    assert "optimizer" not in err and "context" not in err  # only what differs (both were listed as unrecorded)
    step = ["--lr-schedule", "step", "--lr-step-size", "3"]
    train(tmp_path / "b.json", *TOPK, *step, "--checkpoint", str(tmp_path / "s"), steps=4)
    extended = train(tmp_path / "c.json", *TOPK, *step, "--resume", str(tmp_path / "s"), steps=8)
    assert extended["parameter_digest"] == train(tmp_path / "d.json", *TOPK, *step, steps=8)["parameter_digest"]
    # a constant-rate checkpoint resumed with cosine: the schedule alone differs
    train(tmp_path / "e.json", *TOPK, "--checkpoint", str(tmp_path / "c"), steps=4)
    capsys.readouterr()
    assert main(argv[:-1] + [str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("the checkpoint was made with") == 1 and "made with constant warmup=0" in err, err


def test_what_the_launcher_checks_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    """A checkpoint past this run's --steps, and a rank file whose bytes changed but not its size, were found only
    inside the workers (after they started), and the failure then called the checkpoint "intact". Both are
    refused before launch now, and a failure's hint checks the digests before it calls a checkpoint intact."""
    from gradcomp.experiments.run import launch

    root = tmp_path / "ckpt"
    train(tmp_path / "a.json", *TOPK, "--checkpoint", str(root), steps=4)
    monkeypatch.setattr(launch, "launch", lambda cfg: pytest.fail("a worker was started"))
    capsys.readouterr()
    argv = ["train", *SMALL, "--simulate", "--workers", "3", *TOPK, "--resume", str(root)]
    assert main([*argv, "--steps", "2"]) == 2
    assert "is at step 4, past this run's 2 steps: give --steps 4 or more" in capsys.readouterr().err
    rank1 = root / "step-000004" / "rank-0001.pt"
    flipped = bytearray(rank1.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    rank1.write_bytes(bytes(flipped))
    assert main([*argv, "--steps", "8"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file {rank1} is corrupted" in err and "intact" not in err
    cfg = TrainConfig(checkpoint_dir=str(root))
    assert checkpoint.resume_hint(cfg) == ""  # not "intact"
    # a refused resume into a new --checkpoint folder leaves no empty folder behind
    fresh = tmp_path / "new-folder"
    assert main([*argv, "--steps", "8", "--checkpoint", str(fresh)]) == 2
    assert not fresh.exists()


@pytest.mark.slow
def test_resumed_gloo_run_is_bit_identical_to_the_uninterrupted_one(tmp_path):
    """Two spawned gloo workers: the run that wrote the checkpoints, and one resumed from its step 4.

    (Killing a gloo worker and resuming is the torchrun test's job; two launches instead of three here.)
    """
    first = tmp_path / "first"
    reference = train(tmp_path / "reference.json", *TOPK, "--checkpoint", str(first), "--checkpoint-every", "4",
                      workers=2, simulate=False)  # fmt: skip
    resumed = train(tmp_path / "resumed.json", *TOPK, "--resume", str(first / "step-000004"),
                    "--checkpoint", str(tmp_path / "second"), workers=2, simulate=False)  # fmt: skip
    assert resumed["backend"] == "gloo" and resumed["resumed_from_step"] == 4
    same_run(reference, resumed)
    assert find_checkpoint(tmp_path / "second") == tmp_path / "second" / "step-000008"


@pytest.mark.parametrize("crash_in", ["rank file", "manifest", "latest"])
def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch, crash_in):
    reference = train(tmp_path / "reference.json", *TOPK)
    root = tmp_path / "ckpt"
    write = checkpoint.write_atomic

    def power_cut(path: Path, data: bytes) -> None:
        hit = {"rank file": "rank-0001.pt", "manifest": checkpoint.MANIFEST, "latest": checkpoint.LATEST}[crash_in]
        if path.name == hit and (crash_in == "latest" and b"step-000008" in data or path.parent.name == "step-000008"):
            path.with_name(f".{path.name}.tmp").write_bytes(data[: len(data) // 2])  # half written, then dark
            raise RuntimeError("power cut")
        write(path, data)

    monkeypatch.setattr(checkpoint, "write_atomic", power_cut)
    with pytest.raises(RuntimeError, match="power cut"):
        train(tmp_path / "cut.json", *TOPK, "--checkpoint", str(root), "--checkpoint-every", "4", steps=12)
    monkeypatch.setattr(checkpoint, "write_atomic", write)
    assert (root / checkpoint.LATEST).read_text().strip() == "step-000004"
    assert find_checkpoint(root) == root / "step-000004"
    resumed = train(tmp_path / "resumed.json", *TOPK, "--checkpoint", str(root), "--resume", str(root))
    same_run(reference, resumed)
    # the abandoned step-000008 was replaced by the resumed run's complete one, and it is the latest
    assert find_checkpoint(root) == root / "step-000008"
    assert not list((root / "step-000008").glob(".*.tmp"))


def test_a_checkpoint_of_another_configuration_is_refused_naming_the_difference(tmp_path, capsys):
    root = tmp_path / "ckpt"
    train(tmp_path / "a.json", *TOPK, "--checkpoint", str(root), steps=4, workers=4)
    capsys.readouterr()
    cases = {
        "compressor": (["--compressor", "randomk", "--param", "density=0.05"], 4,
                       "compressor: the checkpoint was made with topk(density=0.05, positions=fixed), this run asks "
                       "for randomk(density=0.05, scale=False, seed=0)"),
        "granularity": ([*TOPK, "--granularity", "model"], 4,
                        "granularity: the checkpoint was made with layer, this run asks for model"),
        "world size": (TOPK, 2, "world size: the checkpoint was made with 4, this run asks for 2"),
    }  # fmt: skip
    for args, workers, message in cases.values():
        argv = ["train", *SMALL, "--simulate", "--steps", "8", "--workers", str(workers), *args, "--resume", str(root)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    # the workers check too (a library caller of run_simulated, no command line in between)
    cfg = TrainConfig(compressor="topk", params={"density": 0.05}, error_feedback=True, workers=2, steps=8,
                      dataset="synthetic", model="mlp", progress=False, simulate=True,
                      resume_dir=str(root))  # fmt: skip
    with pytest.raises(ConfigError, match="world size: the checkpoint was made with 4, this run asks for 2"):
        run_simulated(cfg)


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path, capsys):
    root = tmp_path / "ckpt"
    train(tmp_path / "a.json", *TOPK, "--checkpoint", str(root), steps=4)
    step_dir = root / "step-000004"
    rank1 = step_dir / "rank-0001.pt"
    intact = rank1.read_bytes()

    def resume_error() -> str:
        capsys.readouterr()
        argv = ["train", *SMALL, "--simulate", "--steps", "8", "--workers", "3", *TOPK, "--resume", str(root)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err

    rank1.write_bytes(intact[: len(intact) // 3])
    assert f"checkpoint file {rank1} is truncated" in resume_error()
    flipped = bytearray(intact)
    flipped[len(flipped) // 2] ^= 0xFF
    rank1.write_bytes(bytes(flipped))
    assert f"checkpoint file {rank1} is corrupted" in resume_error()
    rank1.unlink()
    assert "could not be read" in resume_error()
    rank1.write_bytes(intact)
    manifest = step_dir / checkpoint.MANIFEST
    manifest.write_text(manifest.read_text()[:40])
    assert "manifest.json is truncated or corrupted" in resume_error()
    (root / checkpoint.LATEST).write_text("../../etc\n")
    assert "latest is corrupted" in resume_error()
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        find_checkpoint(rank1)
    with pytest.raises(CheckpointError, match="does not exist"):
        find_checkpoint(tmp_path / "nowhere")


def test_options_fresh_starts_resume_if_present_and_pruning(tmp_path, capsys):
    root = tmp_path / "ckpt"
    # --resume-if-present with nothing there starts fresh; with a checkpoint there it resumes
    first = train(tmp_path / "a.json", *TOPK, "--checkpoint", str(root), "--checkpoint-every", "2",
                  "--resume-if-present", steps=6)  # fmt: skip
    assert first["resumed_from_step"] is None
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000004", "step-000006"]  # keep 2
    longer = train(tmp_path / "b.json", *TOPK, "--checkpoint", str(root), "--checkpoint-every", "2",
                   "--checkpoint-keep", "0", "--resume-if-present", steps=10)  # fmt: skip
    assert longer["resumed_from_step"] == 6 and longer["steps"] == 10
    assert [p.name for p in sorted(root.glob("step-*"))] == [f"step-{s:06d}" for s in (4, 6, 8, 10)]
    assert longer["parameter_digest"] == train(tmp_path / "c.json", *TOPK, steps=10)["parameter_digest"]
    # resuming an older checkpoint into the same directory drops the abandoned newer ones
    train(tmp_path / "d.json", *TOPK, "--checkpoint", str(root), "--resume", str(root / "step-000006"), steps=6)
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-000004", "step-000006"]
    assert find_checkpoint(root) == root / "step-000006"
    shutil.copytree(root / "step-000004", tmp_path / "copy")  # a checkpoint outside the directory
    capsys.readouterr()
    refused = {
        "already holds a checkpoint": ["--checkpoint", str(root)],
        f"--checkpoint {root} already holds": ["--checkpoint", str(root), "--resume", str(tmp_path / "copy")],
        "--checkpoint-every needs --checkpoint DIR": ["--checkpoint-every", "2"],
        "--resume-if-present resumes from the --checkpoint directory": ["--resume-if-present"],
        "no checkpoint at": ["--resume", str(tmp_path / "missing")],
    }
    for message, args in refused.items():
        assert main(["train", *SMALL, "--simulate", "--steps", "8", "--workers", "3", *TOPK, *args]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_training_continues_from_the_checkpoint(tmp_path):
    """`torchrun --max-restarts 1`: rank 1 is SIGKILLed before step 11; the restarted workers resume at 8."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this python")
    root, out = tmp_path / "ckpt", tmp_path / "run.json"
    # the simulated reference below runs each worker at worker_threads(2) intra-op threads, as the spawning
    # launcher does; torchrun's workers get theirs from OMP_NUM_THREADS (other counts round conv backward
    # otherwise: seen on a 16-core machine)
    env = {**environment(11), "OMP_NUM_THREADS": str(worker_threads(2))}
    command = [str(torchrun), "--standalone", "--max-restarts", "1", "--nproc-per-node", "2", "-m", "gradcomp.cli",
               "train", *SMALL, *TOPK, "--steps", "16", "--checkpoint", str(root), "--checkpoint-every", "4",
               "--resume-if-present", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1: stopped before step 11" in done.stderr
    assert f"resuming from {root / 'step-000008'} (step 8 of 16)" in done.stderr
    result = json.loads(out.read_text())
    assert result["backend"] == "gloo" and result["resumed_from_step"] == 8 and result["replicas_identical"]
    assert [step for step, _ in result["accuracy_curve"]] == list(range(2, 17, 2))  # the curve goes on
    # and it is the uninterrupted run's (the simulated cluster gives the gloo model for gathered messages)
    reference = train(tmp_path / "reference.json", *TOPK, steps=16, workers=2)
    assert result["accuracy_curve"] == reference["accuracy_curve"]
    assert result["bits_up_by_worker"] == reference["bits_up_by_worker"]
    assert result["parameter_digest"] == reference["parameter_digest"]
