"""scripts/gpu_check.sh and its two Python parts run where no GPU is: shell syntax, the skipping path, and a smoke run
of the benchmarks' code on the CPU (GRADCOMP_BENCH_CPU=1: gloo, tiny sizes), so that the check works the first time
a GPU is lent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(args, **env):
    full = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHON": sys.executable, **env}
    return subprocess.run(args, cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)


def test_the_script_parses():
    assert _run(["bash", "-n", "scripts/gpu_check.sh"]).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skipping path needs a machine without CUDA")
def test_without_a_gpu_every_part_says_it_is_skipped(tmp_path):
    done = _run(["bash", "scripts/gpu_check.sh", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("skipped, no CUDA device") == 5, done.stdout
    assert "no CUDA device: every GPU part is skipped" in done.stdout


def test_a_missing_dependency_is_named_before_any_part_runs(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "google_crc32c.py").write_text("raise ImportError('not on this machine')\n")
    path = f"{shadow}{os.pathsep}{ROOT / 'src'}"
    done = _run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], PYTHONPATH=path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "missing dependencies" in done.stdout and "== 1." not in done.stdout, done.stdout


def test_the_hook_benchmark_runs_on_the_cpu():
    done = _run([sys.executable, "benchmarks/gpu_hook.py", "sync", "--only", "none", "topk"], GRADCOMP_BENCH_CPU="1")
    assert done.returncode == 0, done.stderr
    assert "total 0" in done.stdout and "error" not in done.stdout, done.stdout  # no sync warnings exist on a CPU
    for method in ("none", "topk"):
        assert f"  {method} " in done.stdout


def test_the_topologies_part_runs_on_the_cpu():
    done = _run([sys.executable, "benchmarks/gpu_hook.py", "topologies", "--workers", "2"], GRADCOMP_BENCH_CPU="1")
    assert done.returncode == 0, done.stderr
    assert "above the budgets 0" in done.stdout and "error" not in done.stdout, done.stdout
    for topology in ("allgather", "sharded", "ps"):
        assert done.stdout.count(f"  {topology} ") == 3, done.stdout  # C_nat, top-k, none


def test_the_encode_benchmark_runs_on_the_cpu():
    done = _run([sys.executable, "benchmarks/cuda_encode.py", "--only", "none", "threshold", "stc", "dgc"],
                GRADCOMP_BENCH_CPU="1")
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stdout, done.stdout
    for method in ("threshold", "stc", "dgc"):  # each selection timed both ways
        assert f"{method:18s} selection: compress_slots" in done.stdout, done.stdout
    for cast in ("fp16", "bf16"):  # against a cast + the wire's checksum of it, judged on 1.25
        line = next(line for line in done.stdout.splitlines() if line.startswith(f"{cast}: compress + encode"))
        assert "x (cast + checksum" in line and "(target <= 1.25: " in line and "encode + decode" in line, line
