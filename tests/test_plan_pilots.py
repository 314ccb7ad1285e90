"""`gradcomp plan`'s ranking by predicted time to a target (study/pilot.py): the curves' arithmetic on made-up
curves, and short real pilots on the tiny mlp: a diverging pilot marks its method, an unreachable target is one
line before the other pilots, a cached pilot of another model or gradcomp version is not reused."""

from __future__ import annotations

import time

import pytest

from gradcomp.errors import ConfigError
from gradcomp.experiments.study import pilot, plan

FP32 = [[10, 3.0], [20, 2.5], [30, 2.2], [40, 2.0], [50, 1.9], [60, 1.8]]  # bits/byte, lower is better


def test_crossing_interpolates_between_evaluations():
    assert pilot.crossing(FP32, 2.5, lower=True) == 20
    assert pilot.crossing(FP32, 2.1, lower=True) == pytest.approx(35)
    assert pilot.crossing(FP32, 1.0, lower=True) is None
    accuracy = [[10, 50.0], [20, 80.0], [30, 90.0]]
    assert pilot.crossing(accuracy, 85.0, lower=False) == pytest.approx(25)


def test_a_method_twice_as_slow_is_extrapolated_to_twice_fp32s_steps():
    slow = [[s, v] for (s, _), (_, v) in zip(FP32, [[0, 3.5], [0, 3.0], [0, 2.8], [0, 2.5], [0, 2.35], [0, 2.2]])]
    k, low, high = pilot.slowdown(slow, FP32, lower=True)
    # in the second half, at steps 30, 40, 50, 60, it is where fp32 was at 14, 20, ~26.7, 30
    ratios = [30 / 14, 40 / 20, 50 / (20 + 10 * 0.15 / 0.3), 60 / 30]
    assert (low, k, high) == pytest.approx((min(ratios), 2.0, max(ratios)))
    p = pilot.predict({"curve": slow}, {"curve": FP32}, target=1.8, lower=True, tolerance=0.5, fp32_steps=60)
    assert p.status == "extrapolated" and p.keeps_up and p.steps == pytest.approx(k * 60)
    assert p.steps_low == pytest.approx(min(ratios) * 60) and p.steps_high == pytest.approx(max(ratios) * 60)


def test_a_method_behind_beyond_the_noise_does_not_keep_up_and_says_by_how_much():
    behind = [[s, v + 0.3] for s, v in FP32]
    p = pilot.predict({"curve": behind}, {"curve": FP32}, target=1.8, lower=True, tolerance=0.05, fp32_steps=60)
    assert p.status == "does not keep up" and not p.keeps_up and p.gap == pytest.approx(0.3)
    assert "0.300 bits/byte behind fp32" in p.detail


def test_a_method_that_reaches_the_target_in_the_pilot_is_read_off_its_curve():
    p = pilot.predict({"curve": FP32}, {"curve": FP32}, target=2.1, lower=True, tolerance=0.05, fp32_steps=35)
    assert p.status == "reached" and p.steps == pytest.approx(35) and p.steps_low < 35 < p.steps_high


def test_a_diverged_pilot_is_marked_not_predicted():
    p = pilot.predict({"curve": [], "diverged": True, "error": "non-finite"}, {"curve": FP32}, 2.0, True, 0.05, 40)
    assert p.status == "diverged" and not p.keeps_up


def _opts(tmp_path, **kw):
    base = dict(model="mlp", dataset="synthetic", workers=2, link="1mbit", methods=["none", "topk:density=0.05"],
                cache_dir=str(tmp_path), batch_size=8, pilot_steps=12)
    return plan.PlanOptions(**{**base, **kw})


def test_a_plan_ranks_by_time_to_target_and_reuses_its_pilots(tmp_path):
    logs = []
    first = plan.run_plan(_opts(tmp_path), log=logs.append)
    assert first["target"]["value"] == first["target"]["pilots"]["fp32"]["curve"][-1][1]  # fp32's end by default
    assert any(line.startswith("pilots: 2 of 12 steps") for line in logs)  # the estimate, before they start
    rows = {r["label"]: r for r in first["rows"]}
    assert rows["none"]["status"] == "reached" and rows["none"]["time_s"] > 0
    assert rows["topk:density=0.05"]["status"] in ("reached", "extrapolated", "does not keep up")
    timed = [r["time_s"] for r in first["rows"] if r["time_s"] is not None]
    assert timed == sorted(timed)  # ranked by predicted time to the target
    second = plan.run_plan(_opts(tmp_path))
    assert second["cache"]["misses"] == 0 and second["target"] == first["target"]
    # another gradcomp version's (or model's) pilot is another key: not reused
    machine = plan.machine_identity("cpu")
    cfg = pilot.base_config("mlp", "synthetic", None, 8, 2, 12, 0)
    key = pilot.pilot_key(machine, cfg, {"m": 1})
    assert key != pilot.pilot_key({**machine, "gradcomp": "0.0.1"}, cfg, {"m": 1})
    other = pilot.base_config("convnet", "synthetic", None, 8, 2, 12, 0)
    assert key != pilot.pilot_key(machine, other, {"m": 1})


def test_an_unreachable_target_is_one_line_before_the_methods_pilots(tmp_path):
    logs = []
    with pytest.raises(ConfigError, match="is not reached by fp32 in its 12-step pilot") as info:
        plan.run_plan(_opts(tmp_path, target=100.5), log=logs.append)
    assert len(str(info.value).splitlines()) == 1
    assert not any("pilot 2/" in line for line in logs)  # the other pilots never started


def test_a_pilot_that_diverges_marks_its_method_and_the_plan_goes_on(tmp_path):
    result = plan.run_plan(_opts(tmp_path, methods=["none", "topk:density=0.05,sgd.lr=1e6"], link="10kbit"))
    rows = {r["label"]: r for r in result["rows"]}
    bad = rows["topk:density=0.05,sgd.lr=1e6"]
    assert bad["status"] == "diverged" and bad["time_s"] is None and "non-finite" in bad["detail"]
    assert "topk" not in result["recommendation"]  # never recommended


def test_bad_pilot_steps_are_refused_before_measuring(tmp_path):
    with pytest.raises(ConfigError, match="--pilot-steps must be a whole number"):
        plan.run_plan(_opts(tmp_path, pilot_steps=2))


def test_the_cli_writes_the_plot_and_the_json(tmp_path, capsys):
    import json

    from gradcomp.cli import main

    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--model", "mlp", "--dataset", "synthetic", "--workers", "2", "--link", "1mbit",
                 "--batch-size", "8", "--pilot-steps", "12", "--methods", "none", "cnat", "--json", str(out),
                 "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "time to target s" in text and "recommendation:" in text
    assert json.loads(out.read_text())["target"]["pilot_steps"] == 12
    assert png.stat().st_size > 1000


def test_a_language_models_pilot_is_the_first_steps_of_the_planned_run():
    """A pilot of 12 steps of the Transformer is the first 12 steps of `train`'s 300-step run (its warm-up of 30
    steps and its cosine over 300), not a 12-step run with the schedule squeezed into it; with --steps 1000 the
    schedule is the 1,000-step run's. A classifier's default (an epoch, constant lr) keeps its own length."""
    from types import SimpleNamespace

    def base(steps=None, model="transformer_tiny", dataset="pystdlib"):
        opts = SimpleNamespace(model=model, dataset=dataset, data_root=None, batch_size=None, workers=2, seed=0,
                               steps=steps)
        return pilot.pilot_base(opts, 12)

    default, longer = base(), base(1000)
    assert default.steps == 12 and default.schedule_steps == 300 and default.warmup_steps == 30
    assert longer.schedule_steps == 1000
    assert default.lr_at(11, default.schedule_steps) == pytest.approx(default.lr * 12 / 30)  # still warming up
    assert longer.lr_at(11, longer.schedule_steps) == default.lr_at(11, default.schedule_steps)
    assert base(model="mlp", dataset="synthetic").schedule_steps is None
    machine = plan.machine_identity("cpu")
    assert pilot.pilot_key(machine, default, {"m": 1}) != pilot.pilot_key(machine, longer, {"m": 1})


def test_a_run_with_a_longer_schedule_trains_exactly_the_first_steps_of_that_run():
    """schedule_steps: the first 6 steps of a 12-step run, bit for bit (the pilot's promise)."""
    from gradcomp.experiments.run.runner import run_simulated

    def losses(steps, schedule):
        cfg = pilot.base_config("transformer_tiny", "pystdlib", None, 4, 2, steps, 0,
                                run_steps=schedule)
        cfg.eval_every = 0
        return run_simulated(cfg)["loss_curve"]

    prefix, full = losses(6, 12), losses(12, None)
    assert prefix == [point for point in full if point[0] < 6]
    assert losses(6, None) != prefix  # a 6-step run of its own has another schedule: the test can tell


def test_a_schedule_shorter_than_the_run_is_refused():
    from gradcomp.experiments.run.config import TrainConfig

    with pytest.raises(ConfigError, match="schedule_steps must be a whole number >= the run's steps"):
        TrainConfig(model="mlp", dataset="synthetic", steps=10, schedule_steps=5).validate()


def test_pilots_after_fp32s_run_one_per_core_in_their_own_processes_with_the_same_curves(tmp_path, monkeypatch):
    """Two pilots at once (spawned processes, one torch thread each), a diverging one among them: the same curves
    and statuses as one after the other in this process."""
    methods = ["none", "topk:density=0.05", "cnat", "topk:density=0.05,sgd.lr=1e6"]
    monkeypatch.setattr(pilot, "parallel_pilots", lambda count: min(count, 2))
    logs = []
    together = plan.run_plan(_opts(tmp_path / "a", methods=methods, link="10kbit"), log=logs.append)
    assert any("2 at a time" in line for line in logs)
    monkeypatch.setattr(pilot, "parallel_pilots", lambda count: 1)
    alone = plan.run_plan(_opts(tmp_path / "b", methods=methods, link="10kbit"))
    for label, run in together["target"]["pilots"].items():
        other = alone["target"]["pilots"][label]
        assert run.get("diverged", False) == other.get("diverged", False), label
        assert [s for s, _ in run["curve"]] == [s for s, _ in other["curve"]], label
        assert [v for _, v in run["curve"]] == pytest.approx([v for _, v in other["curve"]], abs=1e-6), label
    statuses = {r["label"]: r["status"] for r in together["rows"]}
    assert statuses == {r["label"]: r["status"] for r in alone["rows"]}
    assert statuses["topk:density=0.05,sgd.lr=1e6"] == "diverged"


def test_a_failing_pilot_stops_the_others_and_leaves_no_process(monkeypatch):
    """A pilot that fails (not by diverging: its configuration cannot run) ends the plan with its error, and the
    pilot still running beside it is stopped: no process is left behind."""
    import dataclasses
    import multiprocessing

    monkeypatch.setattr(pilot, "parallel_pilots", lambda count: 2)
    good = pilot.base_config("transformer_tiny", "pystdlib", None, 4, 2, 3000, 0)
    bad = dataclasses.replace(good, batch_size=10**9)  # more than the data: refused when the pilot starts
    pending = [(2, "slow", good, None), (3, "bad", bad, None)]
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="cannot give each of 2 workers"):
        list(pilot._run_in_parallel(pending, 3, log=lambda line: None))
    assert multiprocessing.active_children() == []
    # stopped, not waited for: its 3,000 steps take minutes (a bound with ample slack, not a speed target)
    assert time.perf_counter() - started < 60
