"""Every example in examples/ runs to the end under torchrun with 2 gloo processes on the CPU.

Each example checks itself and prints what it found: the replicas are identical, and a run resumed from its
checkpoint (through the framework's own checkpointing) ends with the same parameters as the uninterrupted one
(the example's exit status is 1 otherwise).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RESUMED = "resumed at step {step}, ended identical to the uninterrupted run: True"


def _run(name: str, tmp_path: Path, *args: str) -> str:
    env = dict(os.environ, CHECKPOINT_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLES / name), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'gradcomp[integrations]')")


def test_own_loop(tmp_path):
    out = _run("own_loop.py", tmp_path)
    assert "replicas identical: True" in out
    assert "test accuracy 0." in out


def test_readme_shows_own_loop():
    """The README's "In your own training loop" block is examples/own_loop.py from its first import on."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme[readme.index("## In your own training loop") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    block = block[: block.index("```")]
    source = (EXAMPLES / "own_loop.py").read_text()
    assert block == source[source.index("\nimport os") + 1 :]


def test_torchrun_ddp(tmp_path):
    out = _run("torchrun_ddp.py", tmp_path, "--checkpoint-dir", str(tmp_path))
    assert "replicas identical: True" in out
    assert out.count(RESUMED.format(step=30)) == 2  # on both ranks


def test_torchrun_fsdp(tmp_path):
    out = _run("torchrun_fsdp.py", tmp_path, "--checkpoint-dir", str(tmp_path))
    assert out.count(RESUMED.format(step=30)) == 2
    assert "the compressor keeps 0 bytes" not in out  # top-k with error feedback keeps its residual


def test_torchrun_fsdp_amp(tmp_path):
    """fp16 parameters and gradients under FSDP2 with a ShardedGradScaler handed to compress_fsdp: the overflowed
    passes are skipped on both ranks alike (none raises) and the resume (the scaler's state in the checkpoint) is
    exact."""
    out = _run("torchrun_fsdp.py", tmp_path, "--checkpoint-dir", str(tmp_path), "--amp")
    assert out.count(RESUMED.format(step=30)) == 2
    # the ranks share one stdout and a line's text and its newline may be written apart (rank 1's line can follow
    # "scale 16384" directly), so the scale is matched as a number, not up to the next space
    skipped = re.findall(r"rank (\d): (\d+) backward passes skipped on every rank, scale ([0-9.e+-]+)", out)
    assert sorted(r for r, _, _ in skipped) == ["0", "1"], out[-3000:]
    assert len({(n, scale) for _, n, scale in skipped}) == 1 and int(skipped[0][1]) > 0, skipped


def test_lightning_ddp(tmp_path):
    _needs("lightning")
    out = _run("lightning_ddp.py", tmp_path)
    assert "replicas identical: True" in out
    assert out.count(RESUMED.format(step=20)) == 2
    assert " 0 bytes up" not in out  # the hook ran on the CPU (Lightning alone would have skipped it)


def test_lightning_ddp_amp(tmp_path):
    """fp16 autocast with a GradScaler whose first scale overflows: the callback hands Lightning's scaler to the hook,
    so every rank skips the same steps (the scale halves alike on both) instead of raising at the first overflow,
    and the resume from the checkpoint (the scaler's state in it) is still exact."""
    _needs("lightning")
    out = _run("lightning_ddp.py", tmp_path, "--amp")
    assert "replicas identical: True" in out
    assert out.count(RESUMED.format(step=20)) == 2
    halvings = re.findall(r"rank (\d): scale [0-9.e+-]+ after 40 steps: (\d+) halvings", out)
    assert sorted(r for r, _ in halvings) == ["0", "1"], out[-3000:]
    assert len({h for _, h in halvings}) == 1 and int(halvings[0][1]) > 0, halvings  # the same skips, some


def test_accelerate_ddp(tmp_path):
    _needs("accelerate")
    out = _run("accelerate_ddp.py", tmp_path)
    assert "replicas identical: True" in out
    assert out.count(RESUMED.format(step=30)) == 2
    assert " 0 bytes up" not in out


@pytest.mark.parametrize("method", ["onebit_adam", "zero_one_adam", "diloco", "dense_topk"])
def test_adam_loop(tmp_path, method):
    out = _run("adam_loop.py", tmp_path, "--method", method)
    assert f"{method}: test accuracy 0." in out and "replicas identical: True" in out
    assert out.count(RESUMED.format(step=60)) == 2
