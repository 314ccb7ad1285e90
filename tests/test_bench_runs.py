"""benchmarks/bench_runs.py: the summary of several bench runs, and its refusals."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_runs.py"
spec = importlib.util.spec_from_file_location("bench_runs", SCRIPT)
bench_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_runs)


def _run(batched: float, rows: list[tuple[str, float | None, float, float]], model: bool = False) -> dict:
    """A bench result by hand: a memcpy row taking ``batched`` s, then (name, target, xmemcpy, xbeside) rows."""
    out = [
        {
            "input": "synthetic",
            "numel": 10_000_000,
            "compressor": "memcpy",
            "setting": "y.copy_(x)",
            "compress_encode_s": batched,
        }
    ]
    for name, target, frac, beside in rows:
        out.append(
            {
                "input": "synthetic",
                "numel": 10_000_000,
                "compressor": name,
                "setting": "s",
                "target": target,
                "compress_encode_vs_memcpy": frac,
                "compress_encode_vs_memcpy_beside": beside,
                "memcpy_beside_s": 0.003,
            }
        )
    if model:  # another input's rows are left out of the summary
        out.append(
            {
                "input": "model",
                "numel": 215_370,
                "compressor": "memcpy",
                "setting": "y.copy_(x)",
                "compress_encode_s": 1e-5,
                "memcpy_beside_s": 1e-5,
            }
        )
    return {"rows": out}


def test_medians_ranges_and_counts_over_the_runs():
    runs = [
        _run(0.002, [("fp16", 2.62, 0.3, 0.45), ("cnat", 0.25, 0.21, 0.30), ("none", None, 0.3, 0.4)], model=True),
        _run(0.003, [("fp16", 2.62, 0.4, 0.44), ("cnat", 0.25, 0.26, 0.27), ("none", None, 0.3, 0.4)]),
        _run(0.002, [("fp16", 2.62, 0.35, 0.46), ("cnat", 0.25, 0.24, 0.31), ("none", None, 0.3, 0.4)]),
    ]
    text = bench_runs.summarise(runs)
    assert "| 1 | 2.00 | 3.00 |" in text and "| 2 | 3.00 | 3.00 |" in text
    assert "| cnat [s] | 0.25 | 0.24 (0.21-0.26) | **missed** | 0.3 (0.27-0.31) | met |" in text
    assert "none [s]" not in text  # no target
    assert text.endswith(
        "At the median of the runs: 0 of 2 met against the batched copy, 1 of 2 against the copy beside each row."
    )


def test_runs_with_other_rows_are_refused():
    one = _run(0.002, [("fp16", 2.62, 0.3, 0.45), ("cnat", 0.25, 0.2, 0.3)])
    with pytest.raises(SystemExit, match="run 2 does not have the rows of run 1"):
        bench_runs.summarise([one, _run(0.002, [("fp16", 2.62, 0.3, 0.45)])])
    with pytest.raises(SystemExit, match="run 2 does not have the rows of run 1"):
        bench_runs.summarise([one, _run(0.002, [("cnat", 0.25, 0.2, 0.3), ("fp16", 2.62, 0.3, 0.45)])])


def test_a_run_without_the_copies_beside_or_the_synthetic_input_is_refused():
    old = _run(0.002, [("fp16", 2.62, 0.3, 0.45)])
    del old["rows"][1]["memcpy_beside_s"]
    with pytest.raises(SystemExit, match="no copies timed beside"):
        bench_runs.summarise([old])
    with pytest.raises(SystemExit, match="no synthetic input"):
        bench_runs.summarise([{"rows": []}])


def test_no_targets_says_so():
    text = bench_runs.summarise([_run(0.002, [("none", None, 0.3, 0.4)])])
    assert text.endswith("No row has a target (they apply to the synthetic input at the default --size, on the CPU).")


def test_cast_rows_are_judged_against_a_cast_and_its_checksum_over_the_runs():
    runs = []
    for judged, bare in ((1.3, 1.0), (1.2, 1.0), (1.4, 1.0)):  # at most 1.25 x (cast + checksum); 1.0 bare casts
        run = _run(0.002, [("fp16", 1.25, 0.3, 0.4)])
        run["rows"][1].update(target_kind="cast", compress_encode_vs_cast=bare,
                              compress_encode_vs_cast_checksum=judged, encode_decode_vs_cast_checksum=judged - 0.5,
                              decode_decompress_vs_cast_checksum=0.9, cast_beside_s=0.002, checksum_beside_s=0.001)
        runs.append(run)
    text = bench_runs.summarise(runs)
    assert "| fp16 [s] | 1.25 | 1.3 (1.2-1.4) | **missed** | 1.3 (1.2-1.4) | **missed** |" in text
    assert "| fp16 [s] | 1.3 (1.2-1.4) | 0.8 (0.7-0.9) | 0.9 (0.9-0.9) | 2 (2-2) | 1 (1-1) |" in text
