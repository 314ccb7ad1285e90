"""gradcomp.allocator: freed host memory kept for reuse in gradcomp's own processes (glibc only).

Each case runs in a fresh interpreter: the setting is process-wide and cannot be undone.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the setting exists in glibc only"
)

# Page faults taken by re-allocating and filling a 40 MB tensor, after a warm-up: with the setting the freed
# block is reused (no fault), without it every round maps fresh pages (10,000 faults of 4 KiB, fewer with
# huge pages).
_FAULTS = """
import json, resource, sys, torch
from gradcomp import allocator
applied = allocator.keep_freed_memory(force=sys.argv[1] == "force")
def fill():
    t = torch.empty(10_000_000)
    t.fill_(1.0)
    return float(t[-1])
for _ in range(3):
    fill()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    fill()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
print(json.dumps({"applied": applied, "faults": faults, "state": allocator.state()}))
"""


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})}, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_freed_blocks_are_reused_without_page_faults():
    kept = _run(_FAULTS, "force")
    default = _run(_FAULTS, "no", env={"GRADCOMP_KEEP_FREED_MEMORY": "0"})
    assert kept["applied"] is True and "kept for reuse" in kept["state"]
    assert default["applied"] is False and "GRADCOMP_KEEP_FREED_MEMORY=0" in default["state"]
    # 40 MB of fresh pages per round without it (9,766 faults of 4 KiB here; fewer where transparent huge
    # pages are always on), none with it
    assert kept["faults"] < 100, kept
    assert default["faults"] > 10 * kept["faults"] + 10, (default, kept)


@glibc_only
def test_the_environment_variable_turns_it_off_and_force_overrides_it():
    off = _run(_FAULTS, "no", env={"GRADCOMP_KEEP_FREED_MEMORY": "off"})
    forced = _run(_FAULTS, "force", env={"GRADCOMP_KEEP_FREED_MEMORY": "0"})
    on_by_default = _run(_FAULTS, "no", env={"GRADCOMP_KEEP_FREED_MEMORY": ""})
    assert off["applied"] is False
    assert forced["applied"] is True
    assert on_by_default["applied"] is True


@glibc_only
def test_the_gradcomp_command_applies_it_and_bench_reports_it(tmp_path):
    """``gradcomp`` (cli.run) applies it and bench records it; main() called in a process of one's own does not
    touch that process's allocator."""
    argv = ["bench", "--size", "4096", "--repeats", "1", "--compressors", "fp16", "--no-model", "--quiet", "--json"]
    off = {"GRADCOMP_KEEP_FREED_MEMORY": "0"}
    for env, expected in (({}, "kept for reuse"), (off, "GRADCOMP_KEEP_FREED_MEMORY=0")):
        path = tmp_path / "b.json"
        subprocess.run([sys.executable, "-m", "gradcomp.cli", *argv, str(path)], check=True, timeout=120,
                       env={**os.environ, **env}, capture_output=True)
        with open(path) as f:
            assert expected in json.load(f)["meta"]["allocator"]
    in_process = (
        "import json; from gradcomp import allocator; from gradcomp.cli import main; "
        f"main({[*argv, str(tmp_path / 'c.json')]!r}); print(json.dumps({{'state': allocator.state()}}))"
    )
    assert "never asked" in _run(in_process)["state"]
    with open(tmp_path / "c.json") as f:
        assert "never asked" in json.load(f)["meta"]["allocator"]
