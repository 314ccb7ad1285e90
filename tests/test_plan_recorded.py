"""`gradcomp plan --recorded` (study/recorded.py): steps to the target from a user's own recorded runs."""

from __future__ import annotations

import json
import os

import pytest

from gradcomp.errors import ConfigError
from gradcomp.experiments.study import pilot, plan, recorded

TRAIN = ["train", "--dataset", "synthetic", "--model", "mlp", "--no-progress", "--steps", "30", "--workers", "2",
         "--simulate", "--eval-every", "5"]
RACE_1GBIT = os.path.join(os.path.dirname(__file__), "..", "docs", "race", "1gbit", "race.json")
TIMING_RACE = os.path.join(os.path.dirname(__file__), "..", "docs", "race", "adam-100mbit", "link-100mbit", "race.json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Real `gradcomp train --json` results: fp32 on seeds 0 and 1, C_nat on seed 0, fp32 at another lr."""
    from gradcomp.cli import main

    where = tmp_path_factory.mktemp("recorded")
    made = {}
    for name, extra in (("fp32-s0", ["--seed", "0"]), ("fp32-s1", ["--seed", "1"]),
                        ("cnat-s0", ["--seed", "0", "--compressor", "cnat"]),
                        ("fp32-lr", ["--seed", "0", "--lr", "0.2"])):
        path = where / f"{name}.json"
        assert main([*TRAIN, *extra, "--json", str(path)]) == 0
        made[name] = str(path)
    return made


def _opts(tmp_path, paths, methods=("none", "cnat", "topk:density=0.1,feedback=residual"), **kw):
    return plan.PlanOptions(model="mlp", dataset="synthetic", workers=2, link="1mbit", methods=list(methods),
                            cache_dir=str(tmp_path / "cache"), recorded=tuple(paths), **kw)


def test_a_plan_reads_steps_to_the_target_from_recorded_runs(runs, tmp_path):
    paths = [runs["fp32-s0"], runs["fp32-s1"], runs["cnat-s0"], runs["fp32-lr"]]
    result = plan.run_plan(_opts(tmp_path, paths))
    rows = {r["label"]: r for r in result["rows"]}
    target = result["target"]
    assert target["source"] == "recorded" and target["recorded_steps"] == 30
    # the target: the least good of fp32's two final accuracies (each seed reaches it)
    finals = [100 * json.load(open(runs[k]))["accuracy_curve"][-1][1] for k in ("fp32-s0", "fp32-s1")]
    assert target["value"] == pytest.approx(min(finals))
    assert target["recorded_used"] == 3  # fp32 at lr 0.2 is another training: not used
    fp32 = rows["none"]
    expected = [pilot.crossing([[s, 100 * v] for s, v in json.load(open(runs[k]))["accuracy_curve"]],
                               target["value"], lower=False) for k in ("fp32-s0", "fp32-s1")]
    assert fp32["status"] == "reached" and fp32["steps_to_target"] == pytest.approx(sum(expected) / 2)
    assert fp32["time_s"] == pytest.approx(fp32["step_s"] * fp32["steps_to_target"])
    assert "2 recorded seeds" in fp32["detail"]
    assert rows["cnat"]["status"] in ("reached", "extrapolated", "does not keep up")
    assert "1 recorded seed" in rows["cnat"]["detail"] or rows["cnat"]["status"] == "does not keep up"
    topk = rows["topk:density=0.1,feedback=residual"]
    assert topk["status"] == "no recorded run" and topk["time_s"] is None
    assert "topk" not in result["recommendation"].split(":")[0]
    assert "recorded" in plan.format_text(result)


def test_a_method_behind_on_one_seed_does_not_keep_up_and_unpaired_seeds_are_not_used():
    fp32 = {0: recorded.Run("a", {}, 0, [[10, 3.0], [20, 2.0]]), 1: recorded.Run("b", {}, 1, [[10, 3.0], [20, 2.0]])}
    good = recorded.Run("c", {}, 0, [[10, 3.0], [20, 2.01]])
    behind = recorded.Run("d", {}, 1, [[10, 3.5], [20, 2.5]])
    one = recorded._combined({0: good}, fp32, 2.05, lower=True, tolerance=0.05)
    assert one.status == "reached" and 10 < one.steps < 20
    both = recorded._combined({0: good, 1: behind}, fp32, 2.05, lower=True, tolerance=0.05)
    assert both.status == "does not keep up" and "1 of 2" in both.detail and both.gap == pytest.approx(0.255)
    unpaired = recorded._combined({5: good}, fp32, 2.05, lower=True, tolerance=0.05)
    assert unpaired.status == "no recorded run" and "seeds 5" in unpaired.detail


def test_json_lines_of_results_are_read_and_failed_commands_skipped(runs, tmp_path):
    lines = tmp_path / "results.jsonl"
    with open(lines, "w") as f:
        for key in ("fp32-s0", "cnat-s0"):
            f.write(json.dumps({"key": key, "returncode": 0, "result": json.load(open(runs[key]))}) + "\n")
        f.write(json.dumps({"key": "broken", "returncode": 1, "result": None}) + "\n")
    found = recorded.load([str(lines)])
    assert [r.identity["compressor"] for r in found] == ["none", "cnat"]
    assert found[0].source.endswith(":1") and found[0].curve[0][0] == 5


def test_a_recorded_race_is_matched_through_the_planners_names():
    found = recorded.load([RACE_1GBIT])
    by = {r.source.split(": ", 1)[1]: r for r in found}
    opts = plan.PlanOptions(model="convnet", dataset="mnist", batch_size=32, workers=4, link="1gbit")
    # torch's fp32 and fp16 hooks are the trainings of gradcomp's none and fp16
    assert recorded._same(by["torch-fp32"].identity, recorded.planned_identity(opts, "none", 400))
    assert recorded._same(by["torch-fp16"].identity, recorded.planned_identity(opts, "fp16", 400))
    assert not recorded._same(by["torch-fp16"].identity, recorded.planned_identity(opts, "none", 400))
    assert not recorded._same(by["torch-fp32"].identity, recorded.planned_identity(opts, "none", 300))
    signum = by["signum:sgd.lr=0.001"]
    assert recorded._same(signum.identity, recorded.planned_identity(opts, "signum:sgd.lr=0.001", 400))
    assert all(r.curve and 0 < r.curve[-1][1] <= 100 for r in found)  # accuracy in %, as the pilots'


@pytest.mark.parametrize("make,message", [
    (lambda d: str(d / "missing.json"), "No such file"),
    (lambda d: _write(d / "empty.jsonl", ""), "holds no recorded run"),
    (lambda d: _write(d / "bad.jsonl", "{\"returncode\": 1, \"result\": null}\nnot json\n"), "line 2 is not JSON"),
    (lambda d: _write(d / "other.json", json.dumps({"hello": 1})), "not a gradcomp train --json result"),
    (lambda d: TIMING_RACE, "a timing race"),
])
def test_bad_recorded_input_is_one_clear_error_before_anything_is_measured(make, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        plan.run_plan(_opts(tmp_path, [make(tmp_path)]))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_without_a_recorded_fp32_run_the_plan_stops_before_measuring(runs, tmp_path):
    with pytest.raises(ConfigError, match="no recorded fp32 run"):
        plan.run_plan(_opts(tmp_path, [runs["cnat-s0"]], steps=30))
    with pytest.raises(ConfigError, match="give --steps N"):
        plan.run_plan(_opts(tmp_path, [runs["cnat-s0"]]))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_zero_one_adam_run_matches_only_its_own_schedule():
    opts = plan.PlanOptions(model="mlp", dataset="synthetic", batch_size=32, workers=2, link="1gbit")
    default = recorded.planned_identity(opts, "zero_one_adam", 30)
    other = recorded.planned_identity(opts, "zero_one_adam:local_step_clipper=4", 30)
    assert default["local_step_clipper"] == 16 and not recorded._same(default, other)
    unknown = {k: v for k, v in default.items() if k != "var_update_scaler"}  # a result from before it was recorded
    assert not recorded._same(recorded._identity(unknown), default)
