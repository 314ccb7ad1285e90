"""`gradcomp sweep --memory`: DGC's momentum policies as memory cells beside off / on (error feedback)."""

from __future__ import annotations

import json

import pytest

from gradcomp.cli import main
from gradcomp.errors import ConfigError
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.study.sweep import cell_config, cell_key, memory_of, render_table


def test_a_momentum_policy_cell_moves_the_optimizers_momentum_into_the_policy():
    base = TrainConfig(dataset="synthetic", model="mlp", steps=2, momentum=0.9)
    cell = {"scheme": "randomk", "density": 0.01, "granularity": "layer", "error_feedback": False, "seed": 0,
            "feedback": "momentum_masking"}
    cfg = cell_config(base, cell)
    assert cfg.feedback == "momentum_masking" and cfg.error_feedback is None
    assert cfg.momentum == 0.0 and cfg.feedback_momentum == 0.9
    plain = cell_config(base, {**{k: v for k, v in cell.items() if k != "feedback"}, "error_feedback": True})
    assert plain.feedback is None and plain.error_feedback is True and plain.momentum == 0.9
    assert memory_of(cell) == "momentum_masking" and memory_of({"error_feedback": True}) == "on"
    # cells recorded before policies existed keep their keys (a resumed sweep does not rerun them)
    old = {k: v for k, v in cell.items() if k != "feedback"}
    assert "feedback" not in json.loads(cell_key(old)) and cell_key(old) != cell_key(cell)


def test_the_table_has_one_line_per_memory_kind():
    result = {"test_accuracy": 0.5, "bits_up_per_worker": 1e6, "compression_ratio_up": 10.0, "compute_s": 1.0,
              "compress_s": 0.1, "communicate_s": 0.1}
    rows = [{"scheme": "topk", "density": 0.01, "granularity": "layer", "error_feedback": ef, "seed": 0,
             "result": result} for ef in (False, True)]
    rows += [{**rows[0], "feedback": f} for f in ("momentum_correction", "momentum_masking")]
    lines = render_table(rows).splitlines()[2:]
    assert [line.split(" | ")[3] for line in lines] == ["off", "on", "momentum_correction", "momentum_masking"]


def test_an_unknown_memory_is_refused_before_any_cell_runs(tmp_path):
    with pytest.raises(ConfigError, match="momentum_masking"):
        import argparse

        from gradcomp.experiments.study import sweep

        p = argparse.ArgumentParser()
        sweep.add_arguments(p)
        sweep.main(p.parse_args(["--memory", "on,momentum", "--out", str(tmp_path)]))
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.slow
def test_a_sweep_with_a_momentum_policy_runs_and_resumes(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["sweep", "--dataset", "synthetic", "--model", "mlp", "--steps", "3", "--workers", "2",
            "--schemes", "randomk", "--densities", "0.1", "--granularities", "layer",
            "--memory", "on,momentum_masking", "--seeds", "0", "--no-baseline", "--out", str(out)]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [memory_of(r) for r in rows] == ["on", "momentum_masking"]
    assert rows[1]["result"]["feedback"] == "momentum_masking"
    capsys.readouterr()
    assert main(args) == 0
    assert "2 already done, 0 to run" in capsys.readouterr().out
