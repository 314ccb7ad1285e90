"""What a new user hit: checkpoint places checked before any worker starts, a resumable failure says so,
Ctrl-C ends with one line and status 130, a worker's gradcomp error without its module path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gradcomp.errors as gradcomp_errors
from gradcomp.cli import main
from gradcomp.experiments.run import checkpoint, launch
from gradcomp.experiments.run.config import TrainConfig
from crash import crash_at

SMALL = ["--dataset", "synthetic", "--model", "mlp", "--no-progress"]
TOPK = ["--compressor", "topk", "--param", "density=0.05", "--error-feedback"]
REPO = Path(__file__).resolve().parents[1]


def run(capsys, *args: str) -> tuple[int, str, float]:
    capsys.readouterr()
    started = time.perf_counter()
    code = main(["train", *SMALL, *args])
    return code, capsys.readouterr().err, time.perf_counter() - started


def test_an_unusable_checkpoint_directory_is_refused_before_any_worker_starts(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    # 100,000 steps of 2 gloo workers would run for many minutes if the directory were checked at the first write
    code, err, took = run(capsys, "--workers", "2", "--steps", "100000", "--checkpoint", str(a_file / "ckpt"))
    assert code == 2 and f"--checkpoint {a_file / 'ckpt'}: cannot be written" in err, err
    assert took < 20
    code, err, _ = run(capsys, "--workers", "2", "--steps", "100000", "--checkpoint", str(a_file))
    assert code == 2 and "is a file, not a folder" in err
    if os.geteuid() != 0:  # root writes anywhere; a read-only place for everyone else
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        code, err, _ = run(capsys, "--workers", "2", "--steps", "100000", "--checkpoint", str(ro / "c"))
        assert code == 2 and "cannot be written" in err


def test_a_truncated_rank_file_is_found_before_the_workers_start(tmp_path, capsys):
    root = tmp_path / "ckpt"
    assert main(["train", *SMALL, *TOPK, "--simulate", "--workers", "2", "--steps", "2", "--checkpoint", str(root)]) == 0
    rank1 = root / "step-000002" / "rank-0001.pt"
    rank1.write_bytes(rank1.read_bytes()[:100])
    code, err, _ = run(capsys, *TOPK, "--workers", "2", "--steps", "4", "--resume", str(root))  # gloo workers
    assert code == 2
    assert err.strip() == (
        f"gradcomp: error: checkpoint file {rank1} is truncated: 100 bytes, the manifest says "
        f"{json.loads((root / 'step-000002' / 'manifest.json').read_text())['files']['rank-0001.pt']['bytes']}"
    )


def test_a_failure_during_training_names_the_checkpoint_to_resume_from(tmp_path, capsys, monkeypatch):
    root = tmp_path / "ckpt"
    crash_at(monkeypatch, 3)  # rank 1 fails before step 3; the checkpoint of step 2 is in place
    code, err, _ = run(capsys, *TOPK, "--simulate", "--workers", "2", "--steps", "6", "--checkpoint", str(root),
                       "--checkpoint-every", "2")  # fmt: skip
    assert code == 2
    assert f"the checkpoint of step 2 in {root} is intact: continue with --resume {root}" in err
    assert checkpoint.resume_hint(TrainConfig(checkpoint_dir=str(tmp_path / "none"))) == ""


def test_a_worker_error_is_shown_without_its_module_path():
    line = "gradcomp.experiments.run.checkpoint.CheckpointError: checkpoint file x is truncated"
    assert launch._QUALIFIED_ERROR_NAME.sub("", line) == "CheckpointError: checkpoint file x is truncated"
    assert launch._QUALIFIED_ERROR_NAME.sub("", "ValueError: gradcomp.x") == "ValueError: gradcomp.x"


def test_ctrl_c_ends_with_one_line_and_status_130_after_the_progress_bar():
    command = ["train", "--dataset", "synthetic", "--model", "mlp", "--simulate", "--workers", "2", "--steps", "100000"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "gradcomp.cli", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)  # fmt: skip
    err = b""
    while b"step/s" not in err:  # training has started: the bar shows a rate
        chunk = os.read(proc.stderr.fileno(), 4096)
        assert chunk, err.decode()
        err += chunk
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    err = (err + rest).decode()
    assert proc.returncode == 130, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1] == "gradcomp: interrupted (Ctrl-C)", lines[-3:]
    assert "Traceback" not in err


@pytest.mark.parametrize("option", ["--json", "--save"])
def test_an_output_file_in_a_folder_that_takes_no_file_is_refused_before_training(tmp_path, capsys, option):
    """/proc exists and its permission bits say root may write there, but no file can be created in it: the check
    used os.access (which root passes), so the run trained to the end and then failed to write (--json), or failed
    with torch's own "open file failed" (--save). It now creates a probe file, as the folder check does."""
    code, err, took = run(capsys, "--workers", "2", "--steps", "100000", option, "/proc/gradcomp-result")
    assert code == 2 and f"{option} /proc/gradcomp-result: not writable" in err, err
    assert took < 20


def test_steps_below_one_name_the_steps():
    """--steps 0 was reported as "--warmup-steps 0 leaves no step of the 0 to train ...": the warm-up's check ran
    first."""
    with pytest.raises(gradcomp_errors.ConfigError, match=r"^--steps must be >= 1, got 0$"):
        TrainConfig(steps=0, workers=2).validate()
