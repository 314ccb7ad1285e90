"""`gradcomp plan`: measured sizes, pricing, recommendation, cache, refusals (tiny model, seconds)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import gradcomp
from gradcomp.cli import main
from gradcomp.experiments.run.runner import run_simulated, worker_threads
from gradcomp.experiments.study import plan, plan_local
from gradcomp.netmodel import NetworkModel

TINY = [(128, 64), (128,), (10, 128), (10,)]  # the mlp on the synthetic dataset


def _per_step_ops(ops: dict, steps: int) -> dict:
    return {op: [calls / steps, nbytes / steps] for op, (calls, nbytes) in ops.items()}


@pytest.mark.parametrize("text", ["none", "topk:density=0.05", "powersgd:rank=2", "signsgd",
                                  "cnat:topology=sharded,server=cnat", "qsgd:topology=ps"])
def test_sizes_equal_what_a_real_simulated_training_step_counts(text):
    method = plan.parse_method(text + ("," if ":" in text else ":") + "ddp=off")  # the aggregator's path
    assert plan.model_shapes("mlp", "synthetic", None) == TINY
    measured = plan.Traffic.from_measurement(plan.measure_method(method, TINY, 3, timed=2))
    steps = 3
    cfg = dataclasses.replace(method.config(), model="mlp", dataset="synthetic", workers=3, steps=steps,
                              simulate=True, progress=False, batch_size=8)
    result = run_simulated(cfg)
    assert measured.bits_up == pytest.approx(result["bits_up_per_worker"] / steps)
    assert measured.bits_down == pytest.approx(result["bits_down_per_worker"] / steps)


def _ddp_hook_ops(rank: int, world: int, texts: list[str]) -> dict:
    """Per collective, the calls and bytes of one step of a real DDP model with gradcomp's hook (steps 2-3:
    DDP rebuilds its buckets after the first), for each method."""
    import torch

    from gradcomp.experiments.race.method import parse_method

    out = {}
    for text in texts:
        method = parse_method(text)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=method.bucket_cap_mb)
        compressor, _ = method.config().build_compressors()
        state = gradcomp.register_ddp_hook(ddp, compressor)
        counts = []
        for step in range(3):
            torch.manual_seed(100 * rank + step)
            ddp(torch.randn(8, 64)).square().mean().backward()
            state.wait()
            counts.append({op: list(v) for op, v in state.transport.counter.ops.items()})
        state.close()
        out[text] = {op: [(c - counts[0].get(op, [0, 0])[0]) / 2, (b - counts[0].get(op, [0, 0])[1]) / 2]
                     for op, (c, b) in counts[2].items()}
    return out


def test_ddp_path_calls_and_bytes_equal_a_real_ddp_hook_s():
    """With ddp on (the default) the plan runs the hook's work bucket by bucket: DDP's rebuilt buckets (a cap of
    0.004 MB splits the MLP in two), PowerSGD's rounds and top-k's gather once per bucket, the dense all-reduce of
    tensors too small to compress (top-k at 60 %). The calls and bytes are those of a real DDP model on gloo."""
    from distributed import run_workers

    texts = ["none:bucket_cap_mb=0.004", "topk:density=0.05,bucket_cap_mb=0.004",
             "topk:density=0.6,bucket_cap_mb=0.004", "powersgd:rank=2,bucket_cap_mb=0.004"]
    assert plan.ddp_buckets(TINY, 0.004) == [[3, 2], [1, 0]]
    assert plan.ddp_buckets(TINY) == [[3, 2, 1, 0]]
    real = run_workers(_ddp_hook_ops, 2, texts, timeout=240)[0]
    for text in texts:
        traffic = plan.Traffic.from_measurement(plan.measure_method(plan.parse_method(text), TINY, 2, timed=2))
        assert traffic.ops_by_worker[0] == real[text], text
    # two buckets: two exchanges a step where the aggregator has one
    two = plan.Traffic.from_measurement(plan.measure_method(plan.parse_method(texts[3]), TINY, 2, timed=1))
    one = plan.Traffic.from_measurement(plan.measure_method(plan.parse_method("powersgd:rank=2,ddp=off"), TINY, 2,
                                                            timed=1))
    assert sum(c for c, _ in two.ops_by_worker[0].values()) > sum(c for c, _ in one.ops_by_worker[0].values())


def test_per_collective_calls_and_bytes_equal_the_transports_counts():
    import torch

    from gradcomp.train.aggregator import GradientAggregator
    from gradcomp.transport.sim import SimulatedCluster

    method = plan.parse_method("topk:density=0.05,ddp=off")
    traffic = plan.Traffic.from_measurement(plan.measure_method(method, TINY, 2, warmup=0, timed=1))

    def one_step(transport):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in TINY]
        agg = GradientAggregator([(f"p{i}", p) for i, p in enumerate(params)], method.config().build_compressors()[0],
                                 transport)
        agg.aggregate([torch.randn(s) for s in TINY])
        return transport.counter.ops

    with SimulatedCluster(2) as cluster:
        ops = cluster.run(one_step)
    assert traffic.ops_by_worker == [{op: [float(c), float(b)] for op, (c, b) in o.items()} for o in ops]


def _traffic(text: str, compress_s: float) -> plan.Traffic:
    measured = plan.Traffic.from_measurement(plan.measure_method(plan.parse_method(text), TINY, 4, timed=1))
    return dataclasses.replace(measured, compress_s=compress_s)


def test_pricing_is_monotone_in_bandwidth():
    for text in ("none", "topk:density=0.05", "cnat:topology=sharded,server=cnat"):
        traffic = _traffic(text, 0.001)
        steps = [plan.price(text, text, traffic, NetworkModel(rate, 1e-5), 4, 0.01).step_s
                 for rate in (1e5, 1e6, 1e7, 1e8, 1e9, 1e10)]
        assert all(a > b for a, b in zip(steps, steps[1:])), steps


def test_slow_link_compressed_wins_fast_link_with_expensive_compression_fp32_wins():
    fp32 = _traffic("none", 0.0)
    topk = _traffic("topk:density=0.01", 0.050)  # a given compression cost: 50 ms, independent of this machine
    for rate, winner in ((1e6, "topk"), (1e12, "none")):
        network = NetworkModel(rate)
        rows = [plan.price("none", "none", fp32, network, 4, 0.01),
                plan.price("topk", "topk", topk, network, 4, 0.01)]
        best = min(rows, key=lambda r: r.step_s)
        assert best.method == winner
        text = plan.recommend(rows)
        assert ("uncompressed fp32 is fastest here" in text) == (winner == "none"), text


def test_compressed_messages_are_priced_cheaper_than_fp32():
    network = NetworkModel(1e8)
    fp32 = plan.communication_seconds(_traffic("none", 0), network, 4)
    assert plan.communication_seconds(_traffic("topk:density=0.01", 0), network, 4) < fp32 / 10
    assert plan.communication_seconds(_traffic("fp16", 0), network, 4) == pytest.approx(fp32 / 2, rel=0.01)


def test_cache_hit_and_miss(tmp_path, monkeypatch):
    opts = plan.PlanOptions(pilots=False, model="mlp", dataset="synthetic", workers=2, link="1gbit", methods=["none", "signsgd"],
                            cache_dir=str(tmp_path), batch_size=8)
    first = plan.run_plan(opts)
    assert first["cache"]["hits"] == 0 and first["cache"]["misses"] == 3  # compute + two methods

    def never(*args, **kwargs):
        raise AssertionError("measured although cached")

    monkeypatch.setattr(plan, "measure_method", never)
    monkeypatch.setattr(plan, "measure_compute", never)
    second = plan.run_plan(opts)
    assert second["cache"] == {**first["cache"], "hits": 3, "misses": 0}
    assert second["rows"] == first["rows"]
    # another W is another measurement; --no-cache measures again
    with pytest.raises(AssertionError, match="measured although cached"):
        plan.run_plan(dataclasses.replace(opts, workers=3))
    with pytest.raises(AssertionError, match="measured although cached"):
        plan.run_plan(dataclasses.replace(opts, cache=False))


@pytest.mark.parametrize(("change", "message"), [
    ({"model": "no-such-model"}, "unknown model"),
    ({"methods": ["nosuchmethod"]}, "nosuchmethod"),
    ({"methods": ["topk:density=2"]}, "density"),
    ({"methods": ["torch-powersgd:rank=0"]}, "rank must be a positive integer"),
    ({"link": "fast"}, "--link must look like"),
    ({"link": "-1gbit"}, "--link must be a finite rate above 0"),
    ({"link": "1e999"}, "--link must be a finite rate above 0"),
    ({"latency": "-1ms"}, "--latency must be a finite number >= 0"),
    ({"latency": "1e999"}, "--latency must be a finite number >= 0"),
    ({"burst": "-1"}, "--burst must be a finite number >= 0"),
    ({"burst": "100mbps"}, "--burst must look like 256kb"),
    ({"workers": 1}, "workers must be an integer >= 2"),
    ({"compute_ms": -1.0}, "compute-ms"),
    ({"colocated": 0}, "colocated must be an integer >= 1"),
])
def test_bad_input_is_refused_before_measuring(change, message, monkeypatch, tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("measured")

    monkeypatch.setattr(plan, "measure_method", never)
    monkeypatch.setattr(plan, "measure_compute", never)
    opts = plan.PlanOptions(pilots=False, model="mlp", dataset="synthetic", workers=2, link="1gbit", methods=["none"],
                            cache_dir=str(tmp_path))
    with pytest.raises(gradcomp.ConfigError, match=message):
        plan.run_plan(dataclasses.replace(opts, **change))


def test_colocated_workers_are_measured_at_once_in_their_own_processes(tmp_path):
    """--colocated N below W times compute and compression in N processes at once; the traffic is the same bytes."""
    opts = plan.PlanOptions(pilots=False, model="mlp", dataset="synthetic", workers=3, link="1gbit", methods=["topk:density=0.05"],
                            cache_dir=str(tmp_path), batch_size=8)
    alone, shared = plan.run_plan(opts), plan.run_plan(dataclasses.replace(opts, colocated=2))
    assert shared["cache"]["misses"] == 2  # not the cached single-worker ones
    assert shared["colocated"] == 2 and alone["colocated"] == 1 and not shared["local_race"]
    for a, b in zip(alone["rows"], shared["rows"]):
        assert (a["bits_up"], a["bits_down"], a["calls"]) == (b["bits_up"], b["bits_down"], b["calls"])
        assert b["compress_s"] > 0 and b["compute_s"] > 0 and b["local_collectives_s"] is None
        assert b["communicate_s"] == b["priced_s"]
    assert "2 workers at once" in plan.format_text(shared) and "2 at once" in shared["compute_from"]
    each = plan.colocated(plan.measure_compute, 2, "mlp", "synthetic", None, 8, "cpu", 0)
    assert len(each) == 2 and all(m["threads"] == worker_threads(2) for m in each)
    # a measurement that fails in a colocated process is raised here, with the child's traceback
    with pytest.raises(RuntimeError, match="unknown model"):
        plan.colocated(plan.measure_compute, 2, "no-such-model", "synthetic", None, 8, "cpu", 0)


def test_merge_colocated_takes_each_workers_median_and_keeps_the_traffic():
    def copy(*seconds):
        return {"workers": [[{"compress_s": s, "bytes_up": 7, "ops": {"all_reduce": [1, 7]}} for s in seconds]]}

    merged = plan.merge_colocated([copy(1.0, 5.0), copy(3.0, 4.0), copy(2.0, 9.0)])
    assert [s["compress_s"] for s in merged["workers"][0]] == [2.0, 5.0]
    assert all(s["bytes_up"] == 7 and s["ops"] == {"all_reduce": [1, 7]} for s in merged["workers"][0])
    assert merged["colocated"] == 3


def test_a_plan_too_large_for_memory_is_refused_before_measuring(monkeypatch, tmp_path):
    monkeypatch.setattr(plan, "measure_method", lambda *a, **k: pytest.fail("measured"))
    opts = plan.PlanOptions(pilots=False, model=None, shapes=[(1_000_000, 1_000)], workers=64, link="1gbit", methods=["none"],
                            compute_ms=1.0, cache_dir=str(tmp_path))
    with pytest.raises(gradcomp.ConfigError, match="GB, more than half"):
        plan.run_plan(opts)


def test_bad_shapes_file_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([[3, 0]]))
    assert main(["plan", "--shapes", str(bad), "--link", "1gbit"]) == 2
    assert "positive integers" in capsys.readouterr().err


def test_cli_with_shapes_json_and_markdown(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRADCOMP_CACHE_DIR", str(tmp_path / "cache"))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([list(s) for s in TINY]))
    out = tmp_path / "plan.json"
    code = main(["plan", "--shapes", str(shapes), "--workers", "2", "--link", "10kbit", "--compute-ms", "5",
                 "--methods", "none", "topk:density=0.05", "--json", str(out), "--markdown"])
    assert code == 0
    text = capsys.readouterr().out
    assert "| topk:density=0.05 |" in text and "recommendation: use topk:density=0.05" in text
    written = json.loads(out.read_text())
    assert written["num_parameters"] == 128 * 64 + 128 + 10 * 128 + 10
    assert [r["label"] for r in written["rows"]] == ["topk:density=0.05", "none"]
    assert written["rows"][1]["bits_up"] == 32 * written["num_parameters"]


@pytest.mark.parametrize("text", ["none", "topk:density=0.05", "signsgd", "cnat:topology=sharded,server=cnat",
                                  "powersgd:rank=2"])
def test_fit_over_workers_predicts_the_bytes_measured_at_a_larger_world(text):
    method = plan.parse_method(text)
    measured = {w: plan.Traffic.from_measurement(plan.measure_method(method, TINY, w, warmup=1, timed=1))
                for w in (2, 4, 8)}
    fitted = plan.fit_in_workers({2: measured[2], 4: measured[4]})
    at8 = measured[8].ops_by_worker[0]
    assert set(fitted.ops) == set(at8)
    for op, (calls, nbytes) in at8.items():
        assert fitted.ops[op][0] == calls
        assert fitted.bytes_per_call(op, 8) == pytest.approx(nbytes / calls, rel=0.02), op  # padding aside
    network = NetworkModel(1e9, 1e-5)
    exact = network.seconds(at8, 8)
    assert fitted.communication_s(network, 8) == pytest.approx(exact, rel=0.02)
    assert fitted.compress_s(8) >= 0


def test_a_small_margin_is_called_small():
    fp32 = plan.PlanRow("none", "none", 1.0, 0.0, 0.1, 32.0, 32.0, {})
    close = plan.PlanRow("topk", "topk", 1.0, 0.05, 0.03, 1.0, 3.0, {})
    far = plan.PlanRow("topk", "topk", 1.0, 0.0, 0.0, 1.0, 3.0, {})
    assert "hardly pays" in plan.recommend([fp32, close])
    assert "hardly pays" not in plan.recommend([fp32, far]) and plan.recommend([fp32, far]).startswith("use topk")


def test_every_worker_on_this_machine_is_planned_from_a_local_race(tmp_path, monkeypatch):
    """--colocated W with a model: each method's compute, compression and time in collectives come from a real
    race of W processes on an unshaped network; the second plan takes them from the cache, races nothing."""
    monkeypatch.setattr(plan_local, "LOCAL_STEPS", 4)
    monkeypatch.setattr(plan_local, "LOCAL_COMPUTE_STEPS", 2)
    opts = plan.PlanOptions(pilots=False, model="mlp", dataset="synthetic", workers=2, colocated=2, link="1mbit",
                            methods=["none", "powersgd:rank=2"], cache_dir=str(tmp_path), batch_size=8)
    first = plan.run_plan(opts)
    assert first["local_race"] and first["cache"]["misses"] == 4  # 2 local steps, 2 traffic measurements
    for row in first["rows"]:
        assert row["compute_s"] > 0 and row["local_collectives_s"] is not None and row["local_collectives_s"] >= 0
        assert row["communicate_s"] == max(row["priced_s"], row["local_collectives_s"])
    by = {r["label"]: r for r in first["rows"]}
    assert by["none"]["compress_s"] == 0.0 < by["powersgd:rank=2"]["compress_s"]  # the hook's own all-reduce
    assert "unshaped network" in plan.format_text(first)
    monkeypatch.setattr(plan_local, "measure_local", lambda *a: pytest.fail("raced again"))
    again = plan.run_plan(opts)
    assert again["cache"]["misses"] == 0 and again["rows"] == first["rows"]


def test_a_local_race_s_wait_overlaps_the_wire_time():
    """With a local race the communication is the longer of the priced collectives and the race's wait."""
    traffic = plan.Traffic(compress_s=0.5, ops_by_worker=[{"all_reduce": [1, 1000]}], bits_up=8e3, bits_down=8e3)
    local = {"step_s": 0.030, "compute_s": 0.010, "compress_s": 0.005}  # 15 ms in collectives
    slow, fast = NetworkModel(1e4, 0.0), NetworkModel(1e9, 0.0)  # 1 kB all-reduced by 2: 0.8 s and 8 us
    for network, communicate in ((slow, slow.step_seconds({"all_reduce": [1, 1000]}, 2)), (fast, 0.015)):
        row = plan.price("x", "x", traffic, network, 2, 0.010, local=local)
        assert row.compress_s == 0.005 and row.communicate_s == pytest.approx(communicate)
        assert row.step_s == pytest.approx(0.015 + communicate)
    plain = plan.price("x", "x", traffic, fast, 2, 0.010)
    assert plain.compress_s == 0.5 and plain.communicate_s == plain.priced_s


def test_the_link_burst_is_credited_once_per_step():
    """A token bucket's burst takes its bytes' bandwidth time off one step's collectives, never below the latency."""
    ops = {"all_gather": [2, 2 * 100_000]}  # two calls of 100 kB
    plain, burst = NetworkModel(1e8, 1e-4), NetworkModel(1e8, 1e-4, burst_bytes=256 * 1024)
    latency = 2 * 3 * 1e-4
    assert plain.step_seconds(ops, 4) == pytest.approx(latency + 2 * 3 * 8e5 / 1e8)
    assert burst.step_seconds(ops, 4) == pytest.approx(latency + 2 * 3 * 8e5 / 1e8 - 8 * 256 * 1024 / 1e8)
    assert burst.step_seconds({"all_gather": [1, 1000]}, 4) == pytest.approx(3 * 1e-4)  # all inside the burst
    assert burst.step_seconds(ops, 1) == 0.0
    with pytest.raises(gradcomp.ConfigError, match="--burst must look like"):
        plan.run_plan(plan.PlanOptions(pilots=False, model="mlp", dataset="synthetic", burst="lots", methods=["none"]))


@pytest.mark.parametrize("text, expected", [("256kb", 262144), ("256KiB", 262144), ("256k", 262144), ("1mb", 2**20),
                                            ("2 MiB", 2**21), ("262144", 262144), ("0", 0), ("100b", 100)])
def test_a_burst_is_read_as_tc_reads_it(text, expected):
    from gradcomp.netmodel import parse_bytes

    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["256i", "lots", "-1", "1gb"])
def test_a_bad_burst_is_refused_with_a_config_error(text):
    from gradcomp.netmodel import parse_bytes

    with pytest.raises(gradcomp.ConfigError):
        parse_bytes(text)


def test_torch_s_powersgd_hook_is_planned_from_its_own_all_reduces(tmp_path):
    """torch-powersgd: torch's hook runs (DDP, one bucket, a gloo group of one process) and every all-reduce it
    issues after its start_iter is recorded. For the mlp at rank 2 torch's rule (compress a matrix n x m when
    (n + m) * rank * min_compression_rate < n * m) compresses both weights: one all-reduce of the two biases
    (138 floats), one of the P factors (128*2 + 10*2) and one of the Q factors (64*2 + 128*2)."""
    method = plan.parse_method("torch-powersgd:rank=2")
    measured = plan.colocated(plan.measure_torch_powersgd, 1, method, TINY, 3, 0, 1, 2, spawn=True)[0]
    assert len(measured["workers"]) == 3
    for step in measured["workers"][0]:
        assert step["ops"] == {"all_reduce": [3, 4 * (138 + 276 + 384)]}
        assert step["bytes_up"] == step["bytes_down"] == 4 * (138 + 276 + 384) and step["compress_s"] >= 0
    opts = plan.PlanOptions(pilots=False, model="mlp", dataset="synthetic", workers=2, link="1mbit", batch_size=8,
                            methods=["torch-powersgd:rank=2", "torch-fp32"], cache_dir=str(tmp_path))
    rows = {r["label"]: r for r in plan.run_plan(opts)["rows"]}
    assert rows["torch-powersgd:rank=2"]["bits_up"] == 8 * 4 * (138 + 276 + 384)
    assert rows["torch-powersgd:rank=2"]["step_s"] < rows["torch-fp32"]["step_s"]  # 1 Mbit/s: bytes decide
    assert "powerSGD_hook itself" in rows["torch-powersgd:rank=2"]["note"]


def test_the_dataset_defaults_to_the_models_as_in_train():
    """plan --model transformer without --dataset plans it on its corpus (it failed, asking for --dataset pystdlib)."""
    import argparse

    for model, dataset in (("transformer", "pystdlib"), ("transformer_tiny", "pystdlib"), ("convnet", "mnist")):
        args = argparse.Namespace(shapes=None, model=model, dataset=None, data=None, batch_size=None, workers=4,
                                  link="100mbit", latency="0", burst="0", device="cpu", methods=None,
                                  compute_ms=None, colocated=1, no_cache=True, seed=0, no_pilot=False,
                                  pilot_steps=None, target=None, steps=None)
        assert plan.options_from_args(args).dataset == dataset
