"""`gradcomp curves`: steps to a target accuracy, the curve table and plot, from real run results."""

from __future__ import annotations

import json

import pytest

from gradcomp.cli import main
from gradcomp.experiments.study.curves import first_reaching


def test_first_reaching_is_the_first_recorded_step_at_or_above_the_target():
    curve = [[10, 0.5], [20, 0.97], [30, 0.96], [40, 0.99]]
    assert first_reaching(curve, 0.97) == 20
    assert first_reaching(curve, 0.98) == 40
    assert first_reaching(curve, 0.995) is None


@pytest.fixture
def run_json(tmp_path):
    path = tmp_path / "run.json"
    assert main(["train", "--simulate", "--no-progress", "--dataset", "synthetic", "--model", "mlp",
                 "--workers", "2", "--steps", "6", "--eval-every", "2", "--json", str(path)]) == 0
    return path


def test_curves_table_and_plot_from_a_real_run(run_json, tmp_path, capsys):
    capsys.readouterr()
    assert main(["curves", f"{run_json}=plain", "--targets", "0.01"]) == 0
    text = capsys.readouterr().out
    curve = json.loads(run_json.read_text())["accuracy_curve"]
    assert [s for s, _ in curve] == [2, 4, 6]
    assert "| plain | 6 |" in text and "step 2" in text  # any accuracy is at least 1 %
    for step, acc in curve:
        assert f"| {step} | {100 * acc:.2f} |" in text
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")  # a skip is reported, not a pass
    out = tmp_path / "curves.png"
    assert main(["curves", f"{run_json}=plain", "--targets", "0.01", "--out", str(out)]) == 0
    assert capsys.readouterr().out == text  # the same table, and the plot
    assert out.stat().st_size > 1000
    assert main(["curves", str(run_json), "--x", "bits", "--out", str(out)]) == 0


def test_curves_reject_runs_without_a_curve_and_bad_targets(tmp_path, capsys):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"accuracy_curve": [], "steps": 3}))
    assert main(["curves", str(bare)]) == 2
    assert "--eval-every" in capsys.readouterr().err
    assert main(["curves", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bare.write_text(json.dumps({"accuracy_curve": [[1, 0.5]], "steps": 1, "test_accuracy": 0.5}))
    assert main(["curves", str(bare), "--targets", "97"]) == 2
    assert "(0, 1]" in capsys.readouterr().err


def _fake_run(path):
    """A finished run's result as curves reads it, without training one."""
    path.write_text(json.dumps({"accuracy_curve": [[1, 0.5], [2, 0.6]], "steps": 2, "test_accuracy": 0.6,
                                "compressor": "none", "bits_up_per_worker": 1000}))
    return path


def test_curves_refuse_json_that_is_no_result(tmp_path, capsys):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")  # valid JSON, but no result object
    assert main(["curves", str(listed)]) == 2
    captured = capsys.readouterr()
    assert "not a result of gradcomp train" in captured.err and captured.out == ""


def test_curves_refuse_an_out_that_is_no_image_before_printing(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--out needs matplotlib")
    run = _fake_run(tmp_path / "run1.json")
    existing = tmp_path / "existing.json"
    existing.write_text('{"keep": 1}')
    for out in (existing, run):  # not even over the run it reads
        before = out.read_text()
        assert main(["curves", str(run), "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert "cannot write a .json plot" in captured.err and ".png" in captured.err and captured.out == ""
        assert out.read_text() == before


def test_curves_out_that_cannot_be_written_is_a_clear_error(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--out needs matplotlib")
    from gradcomp.errors import GradcompError
    from gradcomp.experiments.study.curves import load_run, render_plot

    run = _fake_run(tmp_path / "run1.json")
    # /proc takes no new file, but root's os.access says it does: refused by trying, before the table
    assert main(["curves", str(run), "--out", "/proc/gradcomp-curves.png"]) == 2
    captured = capsys.readouterr()
    assert "gradcomp: error: --out /proc/gradcomp-curves.png" in captured.err and captured.out == ""
    with pytest.raises(GradcompError, match="cannot write the plot"):  # should it fail only when saved
        render_plot([load_run(str(run))], "/proc/gradcomp-curves.png", "steps")
