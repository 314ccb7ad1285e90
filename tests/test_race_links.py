"""`gradcomp race --link A,B`: one training at A, a timed window of steps at B, the time to target estimated."""

from __future__ import annotations

import json

import pytest

from gradcomp import cli
from gradcomp.errors import ConfigError
from gradcomp.experiments.race import links, netns, race
from gradcomp.experiments.run.config import TrainConfig

NEEDS_NETNS = pytest.mark.skipif(
    netns.missing_tools(shaped=True) is not None,
    reason=f"needs root and iproute2 (ip, tc): {netns.missing_tools(shaped=True)}",
)


def config(text: str, steps: int = 1000, **base):
    method = race.parse_method(text)
    return method, method.config(TrainConfig(steps=steps, **base))


def test_parse_links():
    assert links.parse_links("10mbit, 100mbit") == ["10mbit", "100mbit"]
    assert links.parse_links("100mbit") == ["100mbit"]
    for bad in ("10mbit,", "10mbit,10mbit", "10mbit,0.1bit", ",100mbit", "10mbit,10Mbit"):
        with pytest.raises(ConfigError):
            links.parse_links(bad)


def test_prediction_uses_the_window_s_own_steps_then_its_steady_mean():
    ends = [10.0, 20.0, 30.0, 31.0, 32.0, 33.0, 34.0]  # 3 slow warm-up steps, then steps of 1 s
    assert links.predict(ends, 2, steady=3) == 20.0  # inside the window: measured, not estimated
    assert links.predict(ends, 7, steady=3) == 34.0
    assert links.predict(ends, 107, steady=3) == pytest.approx(134.0)
    assert links.predict(ends, 0, steady=3) == 0.0


def test_prediction_is_over_whole_rounds():
    # rounds of 2 steps: a local step of 1 s, then a synchronising step of 3 s
    ends = [1.0, 4.0, 5.0, 8.0, 9.0]  # the last round is cut in half: it does not enter the mean
    assert links.predict(ends, 9, steady=0, round_steps=2) == pytest.approx(9.0 + 4 * 2.0)
    with pytest.raises(ValueError, match="no whole round"):
        links.predict([1.0, 2.0], 9, steady=1, round_steps=4)
    with pytest.raises(ValueError, match="never becomes steady"):
        links.predict([1.0, 2.0], 9, steady=None)


def test_windows_cover_each_method_s_warm_up():
    m, cfg = config("torch-fp32")
    assert links.steady_from(m, cfg) == 0 and links.window_steps(m, cfg, 50) == 50
    m, cfg = config("topk:density=0.01,feedback=residual,dense_steps=100")
    assert links.window_steps(m, cfg, 50) == 150
    m, cfg = config("onebit_adam", optimizer="adamw", momentum=0.0)  # its freeze step: 15 % of the full run's steps
    assert links.steady_from(m, cfg) == 150 and links.window_steps(m, cfg, 50) == 200
    m, cfg = config("onebit_adam:freeze_step=100,warmup=cnat", optimizer="adamw", momentum=0.0)
    assert links.window_steps(m, cfg, 50) == 150
    m, cfg = config("diloco:local_steps=32", optimizer="adamw", momentum=0.0)
    assert links.round_length(cfg) == 32 and links.window_steps(m, cfg, 50) == 64  # two whole rounds
    m, cfg = config("torch-powersgd:start_iter=10")
    assert links.window_steps(m, cfg, 50) == 60
    # LGC's own stages (its dense_steps default 100, top-k 100) after the run's 20 dense steps
    m, cfg = config("lgc:variant=ring,dense_steps=20,topk_steps=100,density=0.001")
    assert links.steady_from(m, cfg) == 220
    m, cfg = config("zero_one_adam", optimizer="adamw", momentum=0.0)  # its schedule never settles: all steps
    assert links.steady_from(m, cfg) is None and links.window_steps(m, cfg, 50) == 1000
    # capped at 2 local steps: H = 1 for 50 steps after the freeze at 100, then rounds of 2 from step 150
    m, cfg = config("zero_one_adam:freeze_step=100,var_update_scaler=1000,local_step_clipper=2", optimizer="adamw",
                    momentum=0.0)
    assert links.steady_from(m, cfg) == 150 and links.round_length(cfg) == 2
    assert links.window_steps(m, cfg, 50) == 200
    m, cfg = config("topk:density=0.01,feedback=residual,dense_steps=100", steps=120)
    assert links.window_steps(m, cfg, 50) == 120  # never more than the run


def test_a_timing_race_keeps_the_full_run_s_freeze_step():
    opts = race.Options(methods=[race.parse_method("onebit_adam")], hosts=2, link="none", dataset="synthetic",
                        model="mlp", steps=100, train_extra={"optimizer": "adamw"}, momentum=0.0, out=None)
    configs, _ = race.plan(opts, log=lambda text: None)
    timing = links.timing_options(opts, configs, 5, "1gbit")
    (cfg,), _ = race.plan(timing, log=lambda text: None)
    assert (cfg.steps, cfg.freeze_step) == (20, 15)  # 15 % of the full run's 100 steps, not of the window's 20


def test_bad_window_and_unshapeable_link_are_refused_before_anything_starts(tmp_path):
    common = ["race", "--method", "torch-fp32", "--hosts", "2", "--dataset", "synthetic", "--model", "mlp",
              "--steps", "4", "--out", str(tmp_path / "out")]
    assert cli.main(common + ["--link", "none,1gbit", "--link-window", "0"]) != 0
    assert cli.main(common + ["--link", "none,1gbit", "--no-netns"]) != 0
    assert not (tmp_path / "out").exists()


@NEEDS_NETNS
def test_tiny_race_at_two_links(tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["race", "--method", "torch-fp32", "--method", "topk:density=0.1,feedback=residual,dense_steps=3",
                     "--hosts", "2", "--link", "none,1gbit", "--link-window", "4", "--dataset", "synthetic",
                     "--model", "mlp", "--steps", "20", "--eval-every", "5", "--compute-steps", "3",
                     "--target", "0.3", "--timeout", "60", "--quiet", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    combined = json.loads((out / "race-links.json").read_text())
    assert (out / "race-links.md").read_text() == combined["table"] and combined["table"] in captured.out
    full = json.loads((out / "link-none" / "race.json").read_text())
    timing = json.loads((out / "link-1gbit" / "race.json").read_text())
    assert timing["network"]["link"] == "1gbit" and full["network"]["link"] == "none"
    steps = {m["label"]: m["steps"] for m in timing["methods"]}
    assert steps == {"torch-fp32": 4, "topk:density=0.1,feedback=residual,dense_steps=3": 7}
    assert all(m["steps"] == 20 for m in full["methods"])
    for row in combined["methods"]:
        first = next(m for m in full["methods"] if m["label"] == row["label"])
        assert row["steps_to_target"] == first["steps_to_target"] is not None
        at_a, at_b = row["links"]["none"], row["links"]["1gbit"]
        assert at_a["time_to_target_s"] == first["time_to_target_s"]
        assert 0.2 < at_a["check"] < 5  # the window's estimate against the full run's clock, tiny noisy steps
        assert at_b["time_to_target_s"] > 0 and at_b["window_steps_timed"] == steps[row["label"]]
        assert at_b["estimated"] == (row["steps_to_target"] > steps[row["label"]])
    fp32 = combined["methods"][0]["links"]
    assert fp32["none"]["vs_fp32_time"] == fp32["1gbit"]["vs_fp32_time"] == 1.0
