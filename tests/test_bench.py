"""Fast checks of `gradcomp bench`: row contents, exact bits per element, the CLI path and the round-trip guard."""

from __future__ import annotations

import json
import math

import pytest
import torch

import gradcomp
from gradcomp import wire
from gradcomp.cli import main as cli_main
from gradcomp.compressors.base import Slot
from gradcomp.compressors.dense import NoCompression
from gradcomp.errors import ConfigError
from gradcomp.experiments.bench import bench, cases, targets, timing
from gradcomp.experiments.bench.report import format_table, versus_topk

N = 20_000


@pytest.fixture(scope="module")
def result():
    return bench.run_bench(size=N, repeats=1, compressors=["none", "topk", "threshold"], inputs=["synthetic"])


def _rows(result, compressor, **where):
    return [
        r
        for r in result["rows"]
        if r["compressor"] == compressor and all(r["params"].get(k) == v for k, v in where.items())
    ]


def test_memcpy_reference_comes_first(result):
    first = result["rows"][0]
    assert first["compressor"] == "memcpy"
    assert first["compress_encode_gbps"] > 0
    assert first["compress_encode_vs_memcpy"] == 1.0
    assert result["meta"]["memcpy_gbps"]["synthetic"] == first["compress_encode_gbps"]


def test_rows_have_positive_throughputs_and_consistent_fractions(result):
    memcpy = result["meta"]["memcpy_gbps"]["synthetic"]
    rows = [r for r in result["rows"] if r["compressor"] != "memcpy"]
    assert {r["compressor"] for r in rows} == {"none", "topk", "threshold"}
    for r in rows:
        assert r["numel"] == N
        assert r["verified"] is True
        for key in ("compress_encode", "decode_decompress"):
            assert r[f"{key}_s"] > 0
            assert r[f"{key}_gbps"] == pytest.approx(4 * N / r[f"{key}_s"] / 1e9)
            assert r[f"{key}_vs_memcpy"] == pytest.approx(r[f"{key}_gbps"] / memcpy)
        assert r["ratio_vs_fp32"] == pytest.approx(32 / r["bits_per_element"])


def test_none_costs_32_bits_plus_headers_exactly(result):
    (row,) = _rows(result, "none")
    expected_bytes = wire.HEADER_BYTES + wire.SECTION_HEADER_BYTES + 4 * N
    assert row["encoded_bytes"] == expected_bytes
    assert row["bits_per_element"] == 8 * row["encoded_bytes"] / row["numel"]
    assert row["bits_per_element"] == 8 * expected_bytes / N
    assert row["bits_per_element"] > 32


def test_topk_one_percent_is_far_below_32_bits(result):
    (row,) = _rows(result, "topk", density=0.01, positions="fixed")
    assert row["bits_per_element"] == 8 * row["encoded_bytes"] / row["numel"]
    assert row["bits_per_element"] < 1.0  # 1% of entries at 32 + 15 bits each, plus headers
    assert len(_rows(result, "topk", density=0.001, positions="fixed")) == 1


def test_threshold_tau_comes_from_the_tensor_quantile(result):
    (row,) = _rows(result, "threshold")
    x = cases.synthetic_gradient(N)
    kept = int((x.abs() > row["params"]["threshold"]).sum())
    assert kept == N - 19_800  # the 0.99-quantile keeps exactly 1% of a tie-free tensor
    assert "q0.99" in row["setting"]


def test_synthetic_input_is_seeded_and_heavy_tailed():
    a, b = cases.synthetic_gradient(50_000), cases.synthetic_gradient(50_000)
    assert torch.equal(a, b) and a.dtype == torch.float32
    kurtosis = float(((a - a.mean()) ** 4).mean() / a.var() ** 2)
    assert kurtosis > 6  # a Gaussian has 3


def test_bad_arguments_raise_config_error():
    with pytest.raises(ConfigError, match="unknown compressor"):
        bench.run_bench(size=100, repeats=1, compressors=["nope"], inputs=["synthetic"])
    with pytest.raises(ConfigError, match="unknown input"):
        bench.run_bench(size=100, repeats=1, compressors=["none"], inputs=["imagenet"])


class _BrokenRoundTrip(NoCompression):
    def specs(self, slot: Slot):
        return [wire.FieldSpec(wire.Codec.F16, count=slot.numel)]  # the wire silently drops precision


def test_broken_round_trip_aborts(monkeypatch):
    monkeypatch.setattr(bench, "make", lambda name, **params: _BrokenRoundTrip())
    with pytest.raises(timing.BenchError, match="round trip is broken"):
        bench.run_bench(size=1000, repeats=1, compressors=["none"], inputs=["synthetic"])


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--size", str(N), "--repeats", "1", "--no-model", "--compressors", "none,topk", "--json", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "memcpy" in printed and "bits/elem" in printed and "topk" in printed
    data = json.loads(out.read_text())
    assert data["meta"]["size"] == N
    assert data["meta"]["torch"] == torch.__version__
    assert data["meta"]["threads"] == torch.get_num_threads()
    assert data["meta"]["memcpy_gbps"]["synthetic"] > 0
    assert [r["compressor"] for r in data["rows"]] == ["memcpy", "none", "topk", "topk", "topk", "topk"]
    assert {r["input"] for r in data["rows"]} == {"synthetic"}


def test_cli_rejects_unknown_compressor(capsys):
    assert cli_main(["bench", "--size", "100", "--repeats", "1", "--no-model", "--compressors", "nope"]) == 2
    assert "unknown compressor" in capsys.readouterr().err


def test_model_input_is_the_smallcnn_gradient():
    res = bench.run_bench(size=100, repeats=1, compressors=["none"], inputs=["model"])
    rows = res["rows"]
    assert [r["compressor"] for r in rows] == ["memcpy", "none"]
    numel = res["meta"]["inputs"]["model"]["numel"]
    if "mnist batch 64" in res["meta"]["inputs"]["model"]["description"]:
        assert numel == 215_370  # SmallCNN's parameter count for 1x28x28 inputs
    assert rows[1]["numel"] == numel and rows[1]["compress_encode_gbps"] > 0


def test_model_input_falls_back_to_synthetic_without_mnist(monkeypatch):
    from gradcomp.experiments.run import data

    real = data.load_dataset

    def no_mnist(name="mnist", root=None):
        if name == "mnist":
            raise ConfigError("MNIST is not available (test)")
        return real(name, root)

    monkeypatch.setattr(data, "load_dataset", no_mnist)
    grad, desc = cases.model_gradient()
    assert "fell back to the synthetic dataset" in desc
    assert grad.dtype == torch.float32 and grad.dim() == 1 and bool(torch.isfinite(grad).all())


def test_receiver_is_a_separate_instance(monkeypatch):
    built = []
    real_make = bench.make

    def counting_make(name, **params):
        built.append(real_make(name, **params))
        return built[-1]

    monkeypatch.setattr(bench, "make", counting_make)
    bench.run_bench(size=1000, repeats=1, compressors=["randomk"], inputs=["synthetic"])
    settings = len(cases.SETTINGS["randomk"])
    assert len(built) == 2 * settings  # a sender and a receiver per setting: no shared position cache
    assert all(built[i] is not built[i + 1] for i in range(0, len(built), 2))


def test_position_bits_are_measured_beside_the_entropy_minimum():
    from gradcomp.experiments.bench.timing import position_bits

    d = 200_000
    positions = torch.sort(torch.randperm(d, generator=torch.Generator().manual_seed(0))[:2000]).values
    slot = gradcomp.Slot("x", 0, d)
    golomb = gradcomp.make("topk", density=0.01, positions="golomb")
    produced, minimum = position_bits(golomb, [positions, torch.zeros(2000)], slot)
    assert minimum == pytest.approx(8.07, abs=0.02)  # log2 C(d, k) / k at p = 0.01
    assert minimum < produced < 1.03 * minimum  # uniformly random positions: within 3 % of the minimum
    fixed = gradcomp.make("topk", density=0.01)
    assert position_bits(fixed, [positions, torch.zeros(2000)], slot)[0] == 18  # ceil(log2 200000)
    assert position_bits(gradcomp.make("none"), [torch.zeros(d)], slot) is None


def test_random_block_time_is_reported_against_top_k_at_the_same_density():
    res = bench.run_bench(
        size=20_000, repeats=1, compressors=["topk", "randomblock", "threshold"], inputs=["synthetic"]
    )
    compared = versus_topk(res)
    rows = {
        (r["compressor"], r["params"].get("density"), r["params"].get("positions", "fixed")): r for r in res["rows"]
    }
    assert {(c["compressor"], c["density"]) for c in compared} == {("randomblock", 0.01), ("randomblock", 0.001)}
    for c in compared:  # ratios of the measured medians, against fixed-position top-k
        block, topk = rows[("randomblock", c["density"], "fixed")], rows[("topk", c["density"], "fixed")]
        assert c["fraction"] == block["compress_encode_s"] / topk["compress_encode_s"]
        assert c["compress_fraction"] == block["compress_s"] / topk["compress_s"]
    report = bench.format_report(res)
    assert "fraction of top-k's at the same density" in report and "randomblock" in report


# ------------------------------------------------------------------------------- sketched SGD's round 1 halves


@pytest.fixture(scope="module")
def sketch_result():
    return bench.run_bench(size=N, repeats=1, compressors=["sketch", "topk"], inputs=["synthetic"])


def _half(result, part):
    (row,) = [r for r in result["rows"] if r["compressor"] == f"sketch ({part})"]
    return row


def test_sketch_is_benchmarked_in_two_halves_and_other_schemes_are_not():
    names = cases.check_names(None)
    assert "sketch" in names
    assert not {"powersgd", "local_topk", "true_topk"} & set(names)
    with pytest.raises(ConfigError, match="own"):
        bench.run_bench(size=100, repeats=1, compressors=["powersgd"], inputs=["synthetic"])


def test_sketch_rows_have_positive_rates_as_fractions_of_memcpy(sketch_result):
    memcpy = sketch_result["meta"]["memcpy_gbps"]["synthetic"]
    labels = [r["compressor"] for r in sketch_result["rows"]]
    assert labels[:3] == ["memcpy", "sketch (sketch)", "sketch (unsketch)"]  # in the order named, like the rest
    for part, side, other in (
        ("sketch", "compress_encode", "decode_decompress"),
        ("unsketch", "decode_decompress", "compress_encode"),
    ):
        row = _half(sketch_result, part)
        assert row["part"] == part and row["method"] == "sketch" and row["numel"] == N and row["verified"] is True
        seconds, gbps = row[f"{side}_s"], row[f"{side}_gbps"]
        assert seconds > 0 and math.isfinite(gbps) and gbps > 0
        assert gbps == pytest.approx(4 * N / seconds / 1e9)
        assert row[f"{side}_vs_memcpy"] == pytest.approx(gbps / memcpy)
        assert row[f"{other}_s"] is None and row[f"{other}_gbps"] is None  # the other half's cells are blank
        assert "prebuilt" in row["setting"] and "outside the timed region" in row["hash_tables"]
    report = bench.format_report(sketch_result)
    assert "sketch (sketch)" in report and "sketch (unsketch)" in report and "outside the timed region" in report
    assert not any(c["compressor"].startswith("sketch") for c in versus_topk(sketch_result))


def test_sketch_sizes_come_from_the_schemes_plan(sketch_result):
    scheme = gradcomp.make("sketch")
    plan = scheme.plan(Slot("bench", 0, N))
    sketch, unsketch = _half(sketch_result, "sketch"), _half(sketch_result, "unsketch")
    for row in (sketch, unsketch):
        assert row["plan"]["cols"] == plan.cols and row["plan"]["k"] == plan.k
        assert row["plan"]["rows"] == scheme.rows and row["plan"]["selected"] == plan.candidates
    table = scheme.rows * plan.cols
    assert sketch["encoded_bytes"] == 4 * table
    assert sketch["bits_per_element"] == 32 * table / N and sketch["ratio_vs_fp32"] == N / table
    assert unsketch["bits_per_element"] is None and unsketch["ratio_vs_fp32"] is None


def test_sketch_params_reach_the_plan_through_the_cli(tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "--size",
        str(N),
        "--repeats",
        "1",
        "--no-model",
        "--compressors",
        "sketch",
        "--quiet",
        "--param",
        "density=0.001",
        "--param",
        "rows=3",
        "--param",
        "rounds=1",
        "--json",
        str(out),
    ]
    assert cli_main(argv) == 0
    data = json.loads(out.read_text())
    assert [r["compressor"] for r in data["rows"]] == ["memcpy", "sketch (sketch)", "sketch (unsketch)"]
    plan = gradcomp.make("sketch", density=0.001, rows=3).plan(Slot("bench", 0, N))
    row = data["rows"][1]
    assert row["plan"]["rows"] == 3 and row["plan"]["cols"] == plan.cols and row["plan"]["k"] == plan.k == 20
    assert data["rows"][2]["plan"]["selected"] == plan.k  # rounds=1 selects k estimates, not P·k
    assert data["meta"]["sketch_params"] == {"density": 0.001, "rows": 3, "rounds": 1}


def test_bad_sketch_parameters_are_refused_before_timing(monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("timed before the sketch parameters were checked")

    monkeypatch.setattr(timing, "measure_memcpy", no_timing)
    with pytest.raises(ConfigError, match="rows"):
        bench.run_bench(
            size=N, repeats=1, compressors=["topk", "sketch"], inputs=["synthetic"], sketch_params={"rows": 0}
        )
    with pytest.raises(ConfigError, match="larger than"):  # a 5 x 10^6 sketch of 20,000 coordinates
        bench.run_bench(size=N, repeats=1, compressors=["sketch"], inputs=["synthetic"], sketch_params={"cols": 10**6})
    with pytest.raises(ConfigError, match="not among the compressors"):
        bench.run_bench(size=N, repeats=1, compressors=["topk"], inputs=["synthetic"], sketch_params={"rows": 3})


def test_sketch_below_min_size_is_skipped_with_a_note():
    res = bench.run_bench(size=500, repeats=1, compressors=["sketch"], inputs=["synthetic"])
    assert [r["compressor"] for r in res["rows"]] == ["memcpy"]
    assert any("min_size" in note for note in res["meta"]["skipped"])


def test_broken_unsketch_aborts(monkeypatch):
    from gradcomp.compressors.countsketch import CountSketch

    monkeypatch.setattr(CountSketch, "estimate", lambda self, table: torch.zeros(self.numel))
    with pytest.raises(timing.BenchError, match="median"):
        bench.run_bench(size=N, repeats=1, compressors=["sketch"], inputs=["synthetic"])


def _targeted(device: str) -> dict:
    """A bench result at the targets' size, by hand: fp16 slower than its target (1.6 x a cast plus its checksum,
    although 1.0 x a bare cast alone), randomk above its target against the copy beside it (1.5 vs 2 x GRACE's
    0.65) but below it against the batched memcpy row."""
    rows = [
        {
            "input": "synthetic",
            "numel": targets.TARGET_SIZE,
            "compressor": name,
            "params": params,
            "setting": "s",
            "compress_encode_vs_memcpy": batched,
            "compress_encode_vs_memcpy_beside": beside,
            "compress_encode_vs_cast": cast,
            "compress_encode_vs_cast_checksum": reference,
        }
        for name, params, batched, beside, cast, reference in (
            ("fp16", {}, 0.2, 0.3, 1.0, 1.6), ("randomk", {"density": 0.01}, 1.2, 1.5, None, None),
            ("none", {}, 0.9, 1.0, None, None),
        )
    ]
    meta = {"device": device, "inputs": {"synthetic": {"numel": targets.TARGET_SIZE}}, "skipped": []}
    return targets.apply_targets({"meta": meta, "rows": rows})


def test_targets_are_marked_met_or_missed_per_row_on_the_cpu():
    result = _targeted("cpu")
    fp16, randomk, none = result["rows"]
    assert (fp16["target"], fp16["target_kind"], fp16["target_met"]) == (1.25, "cast", False)
    assert (randomk["target"], randomk["target_kind"], randomk["target_met"]) == (pytest.approx(1.3), "memcpy", True)
    assert none["target"] is None and none["target_met"] is None
    assert len(result["meta"]["targets"]["met"]) == 1 and result["meta"]["targets"]["missed"][0].startswith("fp16")


def test_rows_are_judged_against_the_references_timed_beside_them():
    result = _targeted("cpu")
    fp16, randomk, _ = result["rows"]
    assert randomk["target_value"] == 1.5 and randomk["target_met"] is True
    assert randomk["target_met_batched"] is False  # the batched memcpy row (1.2) is reported, not judged on
    assert result["meta"]["targets"]["missed_batched"] == ["randomk [s] 1.2 vs 1.3"]
    assert fp16["target_value"] == 1.6 and fp16["target_met"] is False  # the bare cast's 1.0 is not judged
    fp16["compress_encode_vs_cast"] = 2.0  # over 1.25 bare casts, within 1.25 casts + checksums: met
    fp16["compress_encode_vs_cast_checksum"] = 1.2
    targets.apply_targets(result)
    assert fp16["target_value"] == 1.2 and fp16["target_met"] is True and fp16["target_met_batched"] is None
    result["meta"].update(
        torch="t",
        threads=1,
        repeats=1,
        cpus=2,
        seconds=0.0,
        memcpy_gbps={"synthetic": 10.0},
        inputs={"synthetic": {"numel": targets.TARGET_SIZE, "description": "d"}},
    )
    for row in result["rows"]:
        row.update(
            setting="s",
            bits_per_element=32.0,
            ratio_vs_fp32=1.0,
            compress_encode_gbps=1.0,
            decode_decompress_gbps=1.0,
            decode_decompress_vs_memcpy=0.5,
            verified=True,
        )
    report = bench.format_report(result)
    assert "2 of 2 rows met" in report
    assert ("  met     fp16 [s] 1.2 x (cast + checksum) vs 1.25 (<= 1.25 x (a cast to float16 + the wire's "
            "checksum of its bytes))") in report.splitlines()
    line = ("against the batched memcpy row instead (xmemcpy, the earlier reference): 0 of 1 memcpy-fraction "
            "targets met; missed by 1: randomk [s] 1.2 vs 1.3")
    assert line in report.splitlines()
    table = format_table(result)
    assert "<=1.25xcast+sum" in table and ">=1.3xbeside" in table
    fp16["compress_encode_vs_cast_checksum"] = 1.26  # just over: MISSED in the table and the report
    targets.apply_targets(result)
    assert fp16["target_met"] is False and "MISSED" in format_table(result).splitlines()[2]
    assert ("  MISSED  fp16 [s] 1.26 x (cast + checksum) vs 1.25 (<= 1.25 x (a cast to float16 + the wire's "
            "checksum of its bytes))") in bench.format_report(result).splitlines()


def test_targets_come_from_the_data_file():
    with open(targets.TARGETS_FILE) as f:
        data = json.load(f)
    assert targets.TARGETS == data
    assert targets.CAST_TIMES == data["casts"]["times"] == 1.25
    assert set(targets.CAST_DTYPES) == {"fp16", "bf16"}
    for name, grace in data["grace_fractions"].items():
        row = {"input": "synthetic", "numel": data["size"], "compressor": name, "params": grace["params"] or {}}
        target, basis = targets.row_target(row)
        if name in targets.CAST_DTYPES:
            assert target == data["casts"]["times"] and "cast" in basis
        else:
            assert target >= data["grace_factor"] * grace["fraction"] and "GRACE" in basis


def test_cast_rows_time_a_cast_and_its_checksum_beside_each_repeat(monkeypatch):
    # eight readings a round for fp16 (compress, encode, decode, decompress, the copy, the cast, its checksum):
    # each part lasts one second
    monkeypatch.setattr(timing, "Timer", _CountingClock)
    summed = []
    monkeypatch.setattr(timing, "checksum64", lambda buf: summed.append(buf.clone()))
    res = bench.run_bench(size=bench.BESIDE_MIN_NUMEL, repeats=3, compressors=["fp16"], inputs=["synthetic"])
    row = res["rows"][1]
    assert (row["compress_encode_s"], row["memcpy_beside_s"], row["cast_beside_s"]) == (2.0, 1.0, 1.0)
    assert (row["checksum_beside_s"], row["cast_checksum_beside_s"], row["encode_decode_s"]) == (1.0, 2.0, 2.0)
    assert row["compress_encode_vs_cast"] == 2.0
    assert row["compress_encode_vs_cast_checksum"] == row["encode_decode_vs_cast_checksum"] == 1.0
    # the reference's checksum is the wire's, of the cast's own bytes, once per round (warm-up included)
    cast = cases.synthetic_gradient(bench.BESIDE_MIN_NUMEL).to(torch.float16).view(torch.uint8)
    assert len(summed) == 3 + row["warmup_rounds"] and all(torch.equal(b, cast) for b in summed)
    report = bench.format_report(res)
    assert "xcast+sum" in report
    assert "synthetic fp16: cast 1e+03 ms + checksum 1e+03 ms beside the row (median of the sums 2e+03 ms)" in report


def _scripted_faults(monkeypatch, per_round):
    """Make timing.minor_faults report ``per_round[i]`` faults in round i (0 after the script ends)."""
    calls = {"n": 0, "total": 0}

    def fake() -> int:
        n = calls["n"]
        calls["n"] += 1
        if n % 2 == 1:  # the call after a round's timed parts
            calls["total"] += per_round[n // 2] if n // 2 < len(per_round) else 0
        return calls["total"]

    monkeypatch.setattr(timing, "minor_faults", fake)


def _one_row(compressor="fp16", repeats=3):
    res = bench.run_bench(size=N, repeats=repeats, compressors=[compressor], inputs=["synthetic"])
    return res, res["rows"][1]


def test_warm_up_runs_until_a_round_takes_no_page_fault(monkeypatch):
    _scripted_faults(monkeypatch, [7, 5, 2, 0, 4, 0])
    _, row = _one_row(repeats=3)
    # rounds 1-3 warm up (the first always; then while faulting); round 4 is the first repeat, and a repeat
    # that faults (round 5) is kept: the warm-up is over
    assert row["warmup_rounds"] == row["first_timed_step"] == 3
    assert row["minor_faults_per_repeat"] == 0  # median of 0, 4, 0


def test_warm_up_gives_up_after_its_limit_and_the_report_names_the_row(monkeypatch):
    _scripted_faults(monkeypatch, [9] * 100)
    res, row = _one_row(repeats=3)
    assert row["warmup_rounds"] == timing.MAX_WARMUP_ROUNDS
    assert row["minor_faults_per_repeat"] == 9
    expected = "still taking page faults after the warm-up (median per repeat): fp16 [defaults] 9"
    assert expected in bench.format_report(res)


def test_one_warm_up_round_when_nothing_faults(monkeypatch):
    _scripted_faults(monkeypatch, [])
    _, row = _one_row(repeats=2)
    assert row["warmup_rounds"] == 1 and row["minor_faults_per_repeat"] == 0


class _CountingClock:
    """A bench timer whose every reading is one second after the previous one."""

    def __init__(self, device):
        self.t = 0.0

    def now(self) -> float:
        self.t += 1.0
        return self.t


def test_each_row_has_a_copy_timed_beside_it(monkeypatch):
    # six readings a round (compress, encode, decode, decompress, then the copy): each part lasts one second
    monkeypatch.setattr(timing, "Timer", _CountingClock)
    res = bench.run_bench(size=bench.BESIDE_MIN_NUMEL, repeats=3, compressors=["topk"], inputs=["synthetic"])
    row = res["rows"][1]
    assert (row["compress_encode_s"], row["memcpy_beside_s"]) == (2.0, 1.0)
    assert row["compress_encode_vs_memcpy_beside"] == 0.5
    report = bench.format_report(res)
    header = report.splitlines()[report.splitlines().index("") + 1]
    assert header.split()[5:9] == ["c+e", "GB/s", "xmemcpy", "xbeside"]
    assert "input synthetic: copies timed beside the rows 1e+03 to 1e+03 ms (median 1e+03)" in report


def test_no_beside_fraction_for_a_copy_too_short_to_time():
    res, row = _one_row("topk", repeats=2)  # N entries, below BESIDE_MIN_NUMEL
    assert row["memcpy_beside_s"] > 0 and row["compress_encode_vs_memcpy_beside"] is None
