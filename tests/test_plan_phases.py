"""`gradcomp plan` for methods whose steps are not all alike (study/phases.py): dense warm-ups, 1-bit Adam, local
steps, each planned phase by phase from measured exchanges."""

from __future__ import annotations

import pytest

from gradcomp.errors import ConfigError
from gradcomp.experiments.race.method import planned
from gradcomp.experiments.study import phases, plan
from gradcomp.train import zero_one_adam


def test_one_bit_adam_is_its_warm_up_then_sharded_signs():
    (warm, onebit) = phases.phases(planned("onebit_adam", {}), 1000)
    assert (warm.start, warm.stop, onebit.start, onebit.stop) == (0, 150, 150, 1000)  # 15 % of the run
    assert (warm.method.name, warm.method.ddp) == ("none", False)
    assert (onebit.method.name, onebit.method.topology, onebit.method.server) == ("efsignsgd", "sharded", "efsignsgd")
    (warm, _) = phases.phases(planned("onebit_adam:freeze_step=100,warmup=cnat", {}), 1000)
    assert (warm.stop, warm.method.name, warm.method.topology, warm.method.server) == (100, "cnat", "sharded", "cnat")
    (warm, _) = phases.phases(planned("onebit_adam:freeze_step=100,warmup=fp16", {}), 1000)
    assert (warm.method.name, warm.method.topology) == ("fp16", "auto")  # all-reduced, as OneBitAdam does


def test_dense_steps_and_local_steps():
    dense, rest = phases.phases(planned("topk:density=0.01,feedback=residual,dense_steps=100", {}), 1000)
    assert (dense.method.name, dense.stop, rest.method.name, rest.method.dense_steps, rest.start) == (
        "none", 100, "topk", 0, 100)
    (every,) = phases.phases(planned("diloco:local_steps=32", {}), 1000)
    assert (every.every, every.start, every.stop, every.method.local_steps, every.method.outer) == (32, 0, 1000, None, {})
    assert phases.phases(planned("topk:density=0.01", {}), 1000) is None  # one exchange a step


@pytest.mark.parametrize("text, steps, message", [
    ("zero_one_adam", None, "give the run's length, --steps N"),
    ("zero_one_adam:freeze_step=100", 100, "freeze step 100 must lie in"),
    ("onebit_adam", None, "give the run's length, --steps N"),
    ("onebit_adam:freeze_step=1000", 1000, "freeze step 1000 must lie in"),
    ("topk:density=0.01,dense_steps=200", 100, "dense_steps 200 must lie in"),
    ("topk:density=0.01,dense_steps=5,local_steps=4", 100, "dense steps or local steps, not both"),
    ("onebit_adam:warmup=nosuch", 100, "nosuch"),
])
def test_what_is_not_modelled_is_refused_before_measuring(text, steps, message):
    opts = plan.PlanOptions(shapes=[(64, 32)], model=None, workers=2, link="1gbit", methods=[text], steps=steps,
                            pilots=False, compute_ms=1.0, cache=False)
    with pytest.raises(ConfigError, match=message):
        opts.checked()


def _row(compute, compress, communicate, up):
    return plan.PlanRow("x", "x", compute, compress, communicate, up, up, {"all_reduce": 1.0})


def test_the_step_is_the_run_s_mean_and_its_time_is_summed_phase_by_phase():
    m = planned("topk:density=0.01,dense_steps=10", {})
    dense, rest = phases.phases(m, 100)
    row = phases.combine(m, [(dense, _row(1.0, 0.0, 9.0, 800.0)), (rest, _row(1.0, 0.5, 0.5, 8.0))], 100,
                         plan.PlanRow)
    assert row.step_s == pytest.approx((10 * 10.0 + 90 * 2.0) / 100)
    assert row.bits_up == pytest.approx((10 * 800 + 90 * 8) / 100)
    assert row.seconds_for(5) == pytest.approx(50.0)  # inside the warm-up: its own steps, not the mean
    assert row.seconds_for(40) == pytest.approx(100 + 30 * 2.0)
    assert row.seconds_for(150) == pytest.approx(100 + 140 * 2.0)  # beyond the run: the last phase's step
    (every,) = phases.phases(planned("diloco:local_steps=4", {}), 100)
    row = phases.combine(planned("diloco:local_steps=4", {}), [(every, _row(1.0, 0.4, 8.0, 400.0))], 100,
                         plan.PlanRow)
    assert row.step_s == pytest.approx(1.0 + 8.4 / 4) and row.bits_up == pytest.approx(100.0)


def test_a_plan_of_one_bit_adam_measures_its_phases_traffic():
    shapes = [(256, 256), (256,)]
    n = 256 * 256 + 256
    opts = plan.PlanOptions(shapes=shapes, model=None, workers=4, link="1mbit", steps=100, compute_ms=10.0,
                            methods=["none", "onebit_adam:freeze_step=20", "onebit_adam:freeze_step=20,warmup=cnat"],
                            pilots=False, cache=False)
    rows = {r["label"]: r for r in plan.run_plan(opts)["rows"]}
    fp32 = rows["none"]["bits_up"]
    assert fp32 == pytest.approx(32 * n, rel=0.01)
    for label in ("onebit_adam:freeze_step=20", "onebit_adam:freeze_step=20,warmup=cnat"):
        row = rows[label]
        warm, onebit = row["phases"]
        # sharded, W = 4: a worker sends 3/4 of its signs and its quarter of the aggregate: about 1 bit a coordinate
        assert n <= onebit["bits_up"] <= 1.1 * n and onebit["bits_down"] == pytest.approx(1.5 * onebit["bits_up"],
                                                                                           rel=0.02)
        assert row["bits_up"] == pytest.approx((20 * warm["bits_up"] + 80 * onebit["bits_up"]) / 100)
        assert onebit["step_s"] < warm["step_s"]
    assert rows["onebit_adam:freeze_step=20"]["phases"][0]["bits_up"] == pytest.approx(fp32, rel=0.01)
    cnat_warm = rows["onebit_adam:freeze_step=20,warmup=cnat"]["phases"][0]["bits_up"]
    assert 9 * n <= cnat_warm <= 9.5 * n  # C_nat's 9 bits, sharded both ways


def test_pilots_skip_a_phase_they_cannot_reach_and_time_the_others_phase_by_phase(tmp_path):
    opts = plan.PlanOptions(model="mlp", dataset="synthetic", workers=2, link="1mbit", batch_size=8, pilot_steps=12,
                            steps=100, cache_dir=str(tmp_path),
                            methods=["none", "topk:density=0.05,dense_steps=10", "topk:density=0.05,dense_steps=4",
                                     "onebit_adam"])
    result = plan.run_plan(opts)
    rows = {r["label"]: r for r in result["rows"]}
    late = rows["topk:density=0.05,dense_steps=10"]
    assert late["status"] == "not piloted" and "--pilot-steps 20" in late["detail"] and late["time_s"] is None
    assert rows["onebit_adam"]["status"] == "not piloted" and "is an Adam" in rows["onebit_adam"]["detail"]
    early = rows["topk:density=0.05,dense_steps=4"]
    if early["time_s"] is not None:  # its time is its phases' sum, not its mean step times the steps
        n = early["steps_to_target"]
        dense, rest = early["phases"]
        assert early["time_s"] == pytest.approx(min(n, 4) * dense["step_s"] + max(0, n - 4) * rest["step_s"])


def test_a_phased_row_is_never_taken_for_fp32s():
    """1-bit Adam and DiLoCo have no compressor ("none", fp32's name): the plan's "x fp32" column and its
    recommendation must still read fp32's own row."""
    opts = plan.PlanOptions(shapes=[(256, 256)], model=None, workers=4, link="1mbit", steps=100, compute_ms=10.0,
                            methods=["onebit_adam:freeze_step=20", "diloco:local_steps=4", "none"], pilots=False,
                            cache=False)
    result = plan.run_plan(opts)
    rows = {r["label"]: r for r in result["rows"]}
    assert [r["method"] for r in result["rows"]].count(plan.FP32) == 1
    assert rows["none"]["method"] == plan.FP32
    assert rows["onebit_adam:freeze_step=20"]["method"] == "none (onebit_adam)"
    fp32_column = plan.table_rows(result)[[r["label"] for r in result["rows"]].index("none")][2]
    assert fp32_column == "1.00"


@pytest.mark.parametrize("freeze,kappa,scaler,clipper", [(40, 4, 10, 8), (20, 100, 7, 4), (30, 16, 50, 16)])
def test_zero_one_adams_schedule_is_the_optimizers_own(freeze, kappa, scaler, clipper):
    """The planner's replay of 0/1 Adam's schedule against ZeroOneAdam itself: which steps update the variance
    and which sync, step by step, on a simulated worker."""
    import torch
    from torch import nn

    from gradcomp import SimulatedCluster
    from gradcomp.train.zero_one_adam import ZeroOneAdam

    steps = 120

    def worker(transport):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = ZeroOneAdam(model, transport, var_freeze_step=freeze, var_update_scaler=kappa, local_step_scaler=scaler,
                          local_step_clipper=clipper)
        seen = []
        for step in range(steps):
            model.zero_grad()
            g = torch.Generator().manual_seed(step)
            model(torch.randn(8, 4, generator=g)).square().mean().backward()
            before = opt.var_updates, opt.syncs
            opt.step()
            seen.append("variance" if opt.var_updates > before[0] else "sync" if opt.syncs > before[1] else
                        "gradient" if step < freeze else "local")
        return seen

    with SimulatedCluster(1) as cluster:
        (seen,) = cluster.run(worker)
    assert [kind for kind, _ in zero_one_adam.schedule(freeze, steps, kappa, scaler, clipper)] == seen


def test_zero_one_adam_is_planned_by_its_schedule():
    method = planned("zero_one_adam:freeze_step=100,var_update_scaler=1000,warmup=cnat,local_step_clipper=4", {})
    found = phases.phases(method, 1000)
    assert [(p.start, p.stop, p.every, p.method.name) for p in found] == [
        (0, 100, 1, "cnat"), (100, 150, 1, "efsignsgd"), (150, 200, 2, "efsignsgd"), (200, 1000, 4, "efsignsgd")]
    assert found[0].method.topology == "sharded" and found[1].method.server == "efsignsgd"
    default = phases.phases(planned("zero_one_adam", {}), 1000)  # kappa 16, freeze 150: 52 dense, 98 1-bit
    dense = sum(p.stop - p.start for p in default if p.method.name == "none")
    onebit_gradient = sum(p.stop - p.start for p in default if p.stop <= 150 and p.method.name == "efsignsgd")
    assert (dense, onebit_gradient) == (52, 98)
    with pytest.raises(ConfigError, match="is 0/1 Adam's"):
        planned("onebit_adam:local_step_clipper=4", {})


def test_a_plan_of_zero_one_adam_measures_its_two_exchanges_once():
    opts = plan.PlanOptions(shapes=[(256, 256)], model=None, workers=4, link="1mbit", steps=200, compute_ms=10.0,
                            methods=["none", "zero_one_adam:freeze_step=40"], pilots=False, cache=False)
    result = plan.run_plan(opts)
    rows = {r["label"]: r for r in result["rows"]}
    row = rows["zero_one_adam:freeze_step=40"]
    assert row["method"] == "none (zero_one_adam)" and len(row["phases"]) > 4
    # the run's mean over its phases: 28 of the first 40 steps dense fp32 (16, then every 2nd), the rest 1-bit or none
    assert row["bits_up"] == pytest.approx(sum((p["stop"] - p["start"]) * p["bits_up"] for p in row["phases"]) / 200)
    dense = sum(p["stop"] - p["start"] for p in row["phases"] if "AdamW" in p["what"])
    assert dense == 28 and row["bits_up"] < (dense + 10) / 200 * rows["none"]["bits_up"]
    assert row["step_s"] < rows["none"]["step_s"]
