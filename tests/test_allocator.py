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
    assert kept["faults"] < 100, kept
    assert default["faults"] > 1000, default  # 40 MB of fresh pages per round: what the setting removes


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
    code = (
        "import json, sys; from gradcomp import allocator; from gradcomp.cli import main; "
        "main(['bench', '--size', '4096', '--repeats', '1', '--compressors', 'fp16', '--no-model', '--quiet', "
        f"'--json', {str(tmp_path / 'b.json')!r}]); print(json.dumps({{'state': allocator.state()}}))"
    )
    for env, expected in (({}, "kept for reuse"), ({"GRADCOMP_KEEP_FREED_MEMORY": "0"}, "allocator defaults")):
        state = _run(code, env=env)["state"]
        assert expected in state
        with open(tmp_path / "b.json") as f:
            assert json.load(f)["meta"]["allocator"] == state
