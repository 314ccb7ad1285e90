"""Options that cannot work are refused before any worker starts: `gradcomp: error: ...`, exit code 2.

Each case names the option and the value it got. Starting a worker process or a simulated cluster fails
these tests, so a check that happens only inside the workers (or after the training) shows up as a failure.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing

import gradcomp
from gradcomp.cli import main
from gradcomp.experiments.run import runner

SMALL = ["--dataset", "synthetic", "--model", "mlp", "--steps", "2", "--no-progress", "--workers", "2"]


@pytest.fixture
def no_workers(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started")

    for name in ("spawn", "start_processes"):
        monkeypatch.setattr(torch.multiprocessing, name, refuse)
    monkeypatch.setattr(runner.SimulatedCluster, "run", refuse)


def refused(capsys, argv) -> str:
    """The error line of a command that must fail with exit code 2 and no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("gradcomp: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--timeout", "0"], ["--timeout", "0"]),
        (["--timeout", "-5"], ["--timeout", "-5"]),
        (["--timeout", "inf"], ["--timeout", "inf"]),
        (["--batch-size", "100000"], ["--batch-size 100000"]),
        (["--momentum", "-1"], ["--momentum", "-1"]),
        (["--momentum", "-1", "--compressor", "signum", "--lr", "0.001"], ["--momentum", "-1"]),  # before hand-over
        (["--weight-decay", "-1"], ["--weight-decay", "-1"]),
        (["--lr", "inf"], ["--lr", "inf"]),
        (["--latency", "50us"], ["--latency 50us", "--bandwidth"]),
        (["--latency", "fast", "--bandwidth", "1Gbit"], ["latency", "fast"]),
        (["--eval-every", "-1"], ["--eval-every", "-1"]),
        (["--compressor", "topk", "--param", "density=0.01", "--param", "density=0.02"],
         ["--param density given twice", "density=0.02"]),
        (["--compressor", "topk", "--param", "k=4", "--param", "k=4"], ["--param k given twice"]),
        (["--topology", "ps", "--server-compressor", "topk", "--server-param", "density=0.1",
          "--server-param", "density=0.2"], ["--server-param density given twice"]),
    ],
)
def test_bad_numbers_and_repeated_options_fail_before_any_worker(extra, expected, no_workers, capsys):
    err = refused(capsys, ["train", *SMALL, *extra])
    for text in expected:
        assert text in err, err


@pytest.mark.parametrize("option", ["--json", "--save"])
def test_an_output_into_a_missing_folder_fails_before_the_training(option, tmp_path, no_workers, capsys):
    target = tmp_path / "missing" / "out.file"
    err = refused(capsys, ["train", *SMALL, option, str(target)])
    assert f"{option} {target}" in err and "does not exist" in err
    err = refused(capsys, ["train", *SMALL, option, str(tmp_path)])  # a folder where a file is asked for
    assert f"{option} {tmp_path}" in err and "folder" in err


def test_sweep_bench_and_curves_check_their_outputs_first(tmp_path, no_workers, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    err = refused(capsys, ["sweep", *SMALL[:4], "--steps", "2", "--out", str(a_file)])
    assert f"--out {a_file}" in err and "not a folder" in err
    err = refused(capsys, ["bench", "--size", "1000", "--repeats", "1", "--json", str(tmp_path / "no" / "b.json")])
    assert "--json" in err and "does not exist" in err
    run = tmp_path / "run.json"
    run.write_text('{"accuracy_curve": [[1, 0.5]], "steps": 1, "test_accuracy": 0.5}')
    err = refused(capsys, ["curves", str(run), "--out", str(tmp_path / "no" / "c.png")])
    assert "--out" in err and "does not exist" in err
    assert capsys.readouterr().out == ""  # the table is not printed before the error


def test_make_with_a_name_that_is_not_a_string_is_a_config_error():
    with pytest.raises(gradcomp.ConfigError, match="string.*123"):
        gradcomp.make(123)
    with pytest.raises(gradcomp.ConfigError, match="string"):
        gradcomp.make(None, error_feedback=True)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has N CUDA devices (the checks only ask torch how many)."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return set_count


def test_cuda_without_a_gpu_is_refused(gpus, no_workers, capsys):
    gpus(0)
    err = refused(capsys, ["train", *SMALL, "--device", "cuda"])
    assert "no CUDA device" in err


def test_more_nccl_workers_than_gpus_are_refused_before_they_start(gpus, no_workers, monkeypatch, capsys):
    # NCCL itself says "Duplicate GPU detected", but only once the workers have joined the group
    gpus(1)
    err = refused(capsys, ["train", *SMALL, "--device", "cuda"])
    assert "--workers 2" in err and "1 GPU(s) visible" in err and "--simulate" in err, err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    err = refused(capsys, ["train", *SMALL, "--device", "cuda"])
    assert "CUDA_VISIBLE_DEVICES=3" in err, err


def test_torchrun_counts_the_processes_of_this_machine_not_the_world(gpus, monkeypatch):
    from gradcomp.experiments.run.config import TrainConfig

    gpus(2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")  # 4 machines of 2 GPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = TrainConfig(dataset="synthetic", model="mlp", steps=2, workers=8, device="cuda", progress=False)
    cfg.validate()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(gradcomp.ConfigError, match=r"LOCAL_WORLD_SIZE=3 .*2 GPU\(s\) visible"):
        cfg.validate()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(gradcomp.ConfigError, match="LOCAL_WORLD_SIZE must be a whole number"):
        cfg.validate()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # another launcher (srun, mpirun): WORLD_SIZE spans machines
    cfg.validate()


def test_a_simulated_cluster_shares_one_gpu(gpus):
    from gradcomp.experiments.run.config import TrainConfig

    gpus(1)
    TrainConfig(dataset="synthetic", model="mlp", steps=2, workers=4, device="cuda", simulate=True).validate()


@pytest.mark.skipif(
    "device_id" not in __import__("inspect").signature(torch.distributed.init_process_group).parameters,
    reason="torch < 2.3 has no device_id",
)
def test_nccl_groups_are_bound_to_the_rank_s_gpu():
    from gradcomp.transport.dist import bind_device

    assert bind_device("nccl", torch.device("cuda", 1)) == {"device_id": torch.device("cuda", 1)}
    assert bind_device("gloo", torch.device("cpu")) == {}
    assert bind_device("gloo", torch.device("cuda", 0)) == {}  # gloo on CUDA tensors: no binding
    assert bind_device("nccl", None) == {}
