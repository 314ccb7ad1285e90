"""`gradcomp train` and `gradcomp list` end to end."""

from __future__ import annotations

import json

import pytest

from gradcomp.cli import main

REQUIRED_KEYS = {
    "compressor", "params", "workers", "steps", "test_accuracy", "bits_up_per_worker", "bits_down_per_worker",
    "dense_bits_per_worker", "compression_ratio_up", "padding_bits", "wall_time_s", "compute_s", "compress_s",
    "communicate_s",
}
SMALL = ["--dataset", "synthetic", "--model", "mlp", "--steps", "12", "--no-progress"]
MLP_PARAMETERS = 64 * 128 + 128 + 128 * 10 + 10


@pytest.mark.slow
def test_train_spawns_real_workers_and_reports_measured_bits(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["train", *SMALL, "--workers", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert REQUIRED_KEYS <= set(result)
    assert result["workers"] == 3 and result["backend"] == "gloo" and result["replicas_identical"]
    # fp32 allreduce: exactly 4 bytes per parameter up and down each step, nothing else
    assert result["bits_up_per_worker"] == 32 * MLP_PARAMETERS * 12 == result["dense_bits_per_worker"]
    assert result["bits_down_per_worker"] == result["bits_up_per_worker"]
    assert result["compression_ratio_up"] == 1.0 and result["padding_bits"] == 0
    assert 0.0 <= result["test_accuracy"] <= 1.0
    # the once-per-run slot check, apart from the steps: two int64 up, and from each of the two others down
    assert result["setup_bits"] == 8 * (16 + 2 * 16)
    printed = capsys.readouterr().out
    assert "test accuracy" in printed and "bits up / worker" in printed
    assert "set-up" in printed and "384 bit" in printed and "once (the slot check" in printed


@pytest.mark.slow
def test_train_topk_with_parameter_server_and_simulated_cluster(tmp_path):
    out = tmp_path / "run.json"
    args = ["train", *SMALL, "--workers", "5", "--simulate", "--compressor", "topk", "--param", "density=0.05",
            "--error-feedback", "--topology", "ps", "--server-compressor", "topk", "--server-param", "density=0.1",
            "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "simulated" and result["workers"] == 5
    assert result["compression_ratio_up"] > 5
    assert result["server_bits_in"] > 0 and result["server_bits_out"] > 0
    # every worker received the same downstream buffers
    assert len(set(result["bits_down_by_worker"])) == 1


def test_bad_parameter_is_reported_without_a_traceback(capsys):
    assert main(["train", *SMALL, "--compressor", "topk", "--param", "density=3"]) == 2
    err = capsys.readouterr().err
    assert "--compressor topk: density must lie in (0, 1]" in err and "Traceback" not in err  # names the method
    assert main(["train", *SMALL, "--compressor", "topk", "--server-compressor", "qsgd", "--server-param",
                 "levels=0", "--topology", "ps"]) == 2  # fmt: skip
    assert "--server-compressor qsgd: levels" in capsys.readouterr().err


def test_what_bad_input_names(capsys, tmp_path):
    """A mistyped torch baseline lists the baselines (it listed the compressors); a --data that is a file says so
    (it said "does not exist")."""
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert main(["train", "--steps", "2", "--no-progress", "--data", str(a_file)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert main(["race", "--method", "torch-fp31", "--link", "none", "--steps", "2"]) == 2
    assert "unknown torch baseline 'torch-fp31'; known: torch-fp32, torch-fp16" in capsys.readouterr().err


def test_list_names_every_compressor(capsys):
    assert main(["list"]) == 0
    printed = capsys.readouterr().out
    for name in ("none", "fp16", "topk", "randomk", "threshold"):
        assert name in printed
    lines = {line.split()[0]: line for line in printed.splitlines()}
    for name in ("sbc", "stc", "efsignsgd", "onebit"):  # make(name) adds error feedback unless told not to
        assert "error feedback on" in lines[name], lines[name]
    assert "error feedback" not in lines["topk"]


@pytest.mark.slow
def test_simulated_train_gives_the_spawned_runs_model(tmp_path):
    results = []
    for extra in ([], ["--simulate"]):
        out = tmp_path / f"run{len(results)}.json"
        args = ["train", *SMALL, "--workers", "3", "--compressor", "sbc", "--param", "density=0.05",
                "--local-steps", "2", "--json", str(out), *extra]
        assert main(args) == 0
        results.append(json.loads(out.read_text()))
    real, sim = results
    assert real["backend"] == "gloo" and sim["backend"] == "simulated"
    assert sim["parameter_digest"] == real["parameter_digest"]
    assert sim["bits_up_by_worker"] == real["bits_up_by_worker"]
    assert sim["syncs"] == real["syncs"] == 6


def test_list_into_a_reader_that_leaves_early_is_quiet():
    """`gradcomp list | head -1`: the closed pipe ends the command without a traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = "import sys; from gradcomp.cli import run; sys.argv = ['gradcomp', 'list']; run()"
    lister = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              bufsize=0)
    lister.stdout.close()  # the reader is gone before the command writes its first line
    stderr = lister.stderr.read().decode()
    assert lister.wait(timeout=120) == 1
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


@pytest.mark.slow
def test_train_as_launched_by_torchrun(tmp_path):
    import os
    import subprocess
    import sys

    from gradcomp.experiments.run.launch import free_port

    out = tmp_path / "run.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    command = [*torchrun, "-m", "gradcomp.cli", "train", *SMALL, "--compressor", "topk", "--param", "density=0.1",
               "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["workers"] == 2 and result["backend"] == "gloo" and result["replicas_identical"]
    assert done.stdout.count("test accuracy") == 1  # only rank 0 reports


@pytest.mark.slow
@pytest.mark.parametrize("method", [["none"], ["powersgd", "--param", "rank=1"], ["topk", "--param", "density=0.05"]])
def test_train_through_the_ddp_hook(tmp_path, method):
    out = tmp_path / "run.json"
    args = ["train", *SMALL, "--workers", "2", "--ddp", "--bucket-cap-mb", "0.01", "--compressor", *method,
            "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["replicas_identical"] and result["backend"] == "gloo"
    if method[0] == "none":
        # the hook's own transport counted exactly fp32 allreduce: 4 bytes per parameter up and down each step
        assert result["bits_up_per_worker"] == 32 * MLP_PARAMETERS * 12 == result["dense_bits_per_worker"]
    else:
        assert 0 < result["bits_up_per_worker"] < result["dense_bits_per_worker"] / 2


@pytest.mark.parametrize(
    ("extra", "match"),
    [(["--ddp", "--simulate"], "drop --simulate"), (["--ddp", "--local-steps", "2"], "local-steps"),
     (["--ddp", "--granularity", "model"], "granularity layer"), (["--bucket-cap-mb", "1"], "needs --ddp")],
)
def test_ddp_options_are_checked_before_any_worker(extra, match, capsys):
    assert main(["train", *SMALL, *extra]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--server-param", "density=0.01"], "--server-param needs --server-compressor (with --topology ps): "
                                             "without a server compressor density would be ignored"),
        (["--no-server-error-feedback"], "--no-server-error-feedback needs --server-compressor"),
        (["--checkpoint-keep", "3"], "--checkpoint-keep needs --checkpoint DIR"),
        (["--checkpoint-every", "10"], "--checkpoint-every needs --checkpoint DIR: where the checkpoints go"),
        (["--ddp", "--bucket-cap-mb", "0"], "--bucket-cap-mb must be a positive size in MB, got 0.0"),
    ],
)
def test_an_option_that_would_be_ignored_or_is_out_of_range_is_refused(extra, message, tmp_path, capsys):
    assert main(["train", *SMALL, *extra]) == 2
    assert message in capsys.readouterr().err


def test_checkpoint_every_below_one_names_the_value(tmp_path, capsys):
    assert main(["train", *SMALL, "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", "0"]) == 2
    assert "--checkpoint-every must be a number of steps >= 1, got 0" in capsys.readouterr().err


def _summary(bits_up: float, dense: float) -> dict:
    return {
        "compressor": "topk", "params": {"density": 0.9}, "error_feedback": False, "workers": 4, "backend": "gloo",
        "steps": 10, "epochs": 0.1, "test_accuracy": 0.5, "bits_up_per_worker": bits_up,
        "bits_down_per_worker": dense / 4, "dense_bits_per_worker": dense, "padding_bits": 0.0, "compute_s": 1.0,
        "compress_s": 0.1, "communicate_s": 0.2, "wall_time_s": 2.0, "replicas_identical": True,
    }


def test_the_summary_says_more_when_a_run_sent_more_than_fp32():
    from gradcomp.experiments.run.report import format_summary

    text = format_summary(_summary(bits_up=2.5e6, dense=1e6))
    assert "x2.5 more than fp32" in text and "fewer" not in text.split("bits down")[0]
    assert "x4.0 fewer than fp32" in text  # the way down
    assert "as much as fp32" in format_summary(_summary(bits_up=1e6, dense=1e6))


def test_the_summary_says_its_times_are_per_worker_means():
    from gradcomp.experiments.run.report import format_summary

    times = "compute 1.0 s, compress 0.1 s, communicate 0.2 s per worker (mean); wall 2.0 s"
    assert times + "\n" in format_summary(_summary(bits_up=1e6, dense=1e6)) + "\n"
    simulated = format_summary({**_summary(bits_up=1e6, dense=1e6), "backend": "simulated"})
    assert times + " for all 4 in one process" in simulated


def test_list_aligns_long_names_and_shows_effective_defaults(monkeypatch, capsys):
    from gradcomp import registry
    from gradcomp.compressors import TopK

    monkeypatch.setitem(registry._REGISTERED, "a_compressor_with_a_rather_long_name", TopK)
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("a_compressor_with_a_rather_long_name ") for line in lines)
    flags_start = {len(line) - len(line[line.index(" "):].lstrip()) for line in lines}  # after each name's padding
    assert len(flags_start) == 1, lines
    topk = next(line for line in lines if line.startswith("topk "))
    assert "density=0.01" in topk and "density=None" not in topk  # top-k keeps 1 % unless told otherwise


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for option, default in (("--workers", "4"), ("--lr", "0.05"), ("--batch-size", "32"), ("--timeout", "120.0"),
                            ("--momentum", "0.9"), ("--compressor", "none")):
        after = text[text.index(f" {option} "):]
        assert f"(default: {default})" in after[: after.index(" --", 3)], option
    assert "The longest normal wait" in text  # --timeout says why its default is what it is
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    assert "default: 0,1" in " ".join(capsys.readouterr().out.split())  # an option without help text too
