"""`gradcomp sweep`: a small grid on the simulated cluster, resuming, table and plots."""

from __future__ import annotations

import json

import pytest

from gradcomp.cli import main


@pytest.mark.slow
def test_sweep_runs_the_grid_resumes_and_renders(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["sweep", "--dataset", "synthetic", "--model", "mlp", "--steps", "4", "--workers", "2",
            "--schemes", "topk,randomblock,threshold", "--densities", "0.1", "--granularities", "layer,model",
            "--memory", "on", "--seeds", "0", "--out", str(out), "--bandwidth", "1Gbit"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 1 + 6  # the uncompressed reference first, then the grid
    assert rows[0]["scheme"] == "none" and rows[0]["result"]["compression_ratio_up"] == pytest.approx(1.0, rel=0.01)
    rows = rows[1:]
    assert {r["scheme"] for r in rows} == {"topk", "randomblock", "threshold"}
    for r in rows:
        assert r["result"]["steps"] == 4 and r["result"]["error_feedback"] is True
        assert "modelled_communicate_s" in r["result"]
    threshold = [r for r in rows if r["scheme"] == "threshold"][0]
    assert threshold["params"]["threshold"] > 0  # calibrated to the density
    table = (out / "table.md").read_text()
    assert table.count("\n|") == 1 + 7 and "randomblock" in table
    assert "calibrated" in table  # the threshold cells' density is a calibration target, said under the table
    assert table.splitlines()[2].startswith("| none (fp32) |")
    capsys.readouterr()
    assert main(args) == 0  # resume: nothing left to run
    assert "7 already done, 0 to run" in capsys.readouterr().out
    assert len((out / "results.jsonl").read_text().splitlines()) == 7
    pytest.importorskip("matplotlib", reason="the plots need matplotlib")  # a skip is reported, not a pass
    assert (out / "accuracy_vs_bits.png").stat().st_size > 1000
    assert (out / "time_split.png").stat().st_size > 1000


def test_sweep_rejects_unknown_schemes():
    assert main(["sweep", "--schemes", "topk,zip", "--out", "/nonexistent/never"]) == 2


def test_a_diverging_cell_is_recorded_and_the_sweep_goes_on(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["sweep", "--dataset", "synthetic", "--model", "mlp", "--steps", "6", "--workers", "2",
            "--schemes", "topk", "--densities", "0.5", "--granularities", "layer,model", "--memory", "off",
            "--seeds", "0", "--lr", "1e30", "--momentum", "0", "--no-baseline", "--out", str(out)]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2  # both cells ran although each one diverged
    for r in rows:
        assert r["result"]["diverged"] is True
        assert 0 < r["result"]["diverged_at_step"] < 6
        assert "non-finite" in r["result"]["error"]
    table = (out / "table.md").read_text()
    assert table.count("diverged at step") == 2
    captured = capsys.readouterr()
    assert "non-finite" in captured.out
    assert "table.md only, no plots: no cell finished without diverging" in captured.err
    assert main(args) == 0  # a diverged cell counts as done
    assert "2 already done, 0 to run" in capsys.readouterr().out


@pytest.mark.slow
def test_a_diverging_real_worker_is_recorded_too(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "--real", "--dataset", "synthetic", "--model", "mlp", "--steps", "6", "--workers", "2",
                 "--schemes", "topk", "--densities", "0.5", "--granularities", "layer", "--memory", "off",
                 "--seeds", "0", "--lr", "1e30", "--momentum", "0", "--no-baseline", "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert row["result"]["diverged"] is True and 0 < row["result"]["diverged_at_step"] < 6


def test_table_of_a_resumed_sweep_with_mixed_pricing_and_unknown_divergence_steps():
    from gradcomp.experiments.study.sweep import render_table

    def row(seed, **result):
        finished = {"test_accuracy": 0.9, "bits_up_per_worker": 1e6, "compression_ratio_up": 10.0,
                    "compute_s": 1.0, "compress_s": 0.5, "communicate_s": 0.1}
        return {"scheme": "topk", "density": 0.1, "granularity": "layer", "error_feedback": False, "seed": seed,
                "result": result or finished}

    priced = row(0)
    priced["result"]["modelled_communicate_s"] = 2.0
    table = render_table([priced, row(1)])  # seed 1 was run without --bandwidth
    assert table.splitlines()[2].endswith("| – |") and "90.00" in table
    lost = [row(0, diverged=True, diverged_at_step=7, error="x"), row(1, diverged=True, diverged_at_step=None,
                                                                     error="y")]
    assert "diverged at step 7, ?" in render_table(lost)


def test_without_matplotlib_the_sweep_says_it_wrote_no_plots(tmp_path, capsys, monkeypatch):
    from gradcomp.experiments.study import sweep

    monkeypatch.setattr(sweep, "render_plots", lambda rows, out_dir: [])  # as when matplotlib cannot be imported
    monkeypatch.setattr(sweep, "matplotlib_missing", lambda: True)
    args = ["sweep", "--dataset", "synthetic", "--model", "mlp", "--steps", "2", "--workers", "2",
            "--schemes", "topk", "--densities", "0.5", "--granularities", "layer", "--memory", "off", "--seeds", "0",
            "--no-baseline", "--out", str(tmp_path / "s")]
    assert main(args) == 0
    assert "gradcomp sweep: table.md only, no plots: matplotlib is not installed" in capsys.readouterr().err
    assert (tmp_path / "s" / "table.md").exists()


def test_a_sweep_run_again_with_other_settings_is_refused_and_the_same_settings_resume(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["sweep", "--dataset", "synthetic", "--model", "mlp", "--steps", "1", "--workers", "2", "--schemes", "topk",
            "--densities", "0.5", "--granularities", "layer", "--memory", "off", "--no-baseline", "--out", str(out)]
    assert main([*args, "--seeds", "0"]) == 0
    results = (out / "results.jsonl").read_text()
    capsys.readouterr()
    assert main([*args, "--seeds", "0", "--steps", "2", "--lr", "0.1"]) == 2  # the later --steps wins
    captured = capsys.readouterr()
    assert "other settings" in captured.err and "--steps 1 there, 2 now" in captured.err
    assert "--lr 0.05 there, 0.1 now" in captured.err and "new --out" in captured.err
    assert captured.out == "" and (out / "results.jsonl").read_text() == results  # nothing ran
    assert main([*args, "--seeds", "0,1"]) == 0  # the same settings: resumed, and the grid extended
    assert "2 cells, 1 already done, 1 to run" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["settings"] == rows[1]["settings"]  # each cell records what it ran with
    assert rows[0]["settings"]["steps"] == 1 and rows[0]["settings"]["lr"] == 0.05
