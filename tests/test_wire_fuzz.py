"""scripts/fuzz_wire.py at CI size: every registered compressor's receiving path, a few hundred mutated buffers each.

The full run (100,000 buffers per decoder) is documented in docs/wire.md. Two controls show that this small
run would have caught the problems it guards against: the sections of a threshold message that disagree
(its spec without the count link) and a checksum that misses 2-bit errors (the version-1 weighted sum).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gradcomp.registry as registry
from gradcomp.schemes.base import Scheme

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_wire.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("fuzz_wire", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fuzz_wire = _load_script()


def test_every_decoder_sees_only_wire_errors_and_no_silent_bit_flips():
    result = fuzz_wire.run(per_decoder=300, seed=1, per_scheme=0)
    report = fuzz_wire.format_report(result)
    assert result.total(outcome="crash") == 0, report
    assert result.total(fuzz_wire.MUST_NOT_BE_SILENT, "silent") == 0, report
    assert not result.failed and report.endswith("OK")
    # every registered compressor that sends a framed message was fuzzed, with every position codec
    fuzzed = {label.split(" ")[0] for label in result.counts}
    for name in registry.available():
        framed = not issubclass(registry.compressor_class(name), Scheme)
        assert (name in fuzzed) == framed, name
        assert (name in result.skipped) == (not framed), name
    for codec in ("fixed", "golomb"):
        for name in ("topk", "threshold", "sbc", "stc", "dgc"):
            assert f"{name} positions={codec}" in result.counts
    # every mutation kind was tried, and the CRC rejected every flip of up to two bits and every burst
    for kind in fuzz_wire.KINDS:
        assert result.total([kind]) > 0, kind
    for kind in ("flip1", "flip2", "flip2-word", "burst<=32"):
        tried = result.total([kind]) - result.total([kind], "unchanged")
        assert result.total([kind], "rejected") == tried, kind


def test_every_schemes_messages_are_summed_or_containers_that_reject_every_mutation():
    """Each method that owns its rounds (and the sharded topology) runs on 2 simulated workers; every message a
    worker receives that is not an allreduce is a container, and a mutated copy replayed into the worker's step
    raises WireError: no other exception, no silent change of the step's outputs by up to two flipped bits."""
    result = fuzz_wire.Result()
    fuzz_wire.run_schemes(48, 1, result)
    report = fuzz_wire.format_report(result)
    assert result.unframed == {}, report  # every message sent is summed (an allreduce) or a container
    assert result.total(outcome="crash") == 0, report
    assert result.total(fuzz_wire.MUST_NOT_BE_SILENT, "silent") == 0, report
    assert not result.failed and report.endswith("OK")
    assert sorted(result.summed_only) == ["powersgd", "sketch topology=allreduce", "true_topk"]
    fuzzed = {label.split(" ")[0] for label in result.counts}
    assert fuzzed == {"sketch", "local_topk", "lgc", "terngrad_shared", "topk", "threshold"}
    # gradcomp's own schemes (a plugin's are its package's to fuzz)
    schemes = {n for n in registry.BUILTIN if issubclass(registry.compressor_class(n), Scheme)}
    assert schemes <= fuzzed | {label.split(" ")[0] for label in result.summed_only}
    for label in ("sketch topology=ps", "sketch rounds=1 topology=ps", "lgc variant=ring", "lgc variant=ps"):
        assert label in result.counts
    # everything but a recomputed checksum over changed data, and bytes appended past a known length, is rejected
    for kind in fuzz_wire.KINDS:
        if kind not in ("payload+crc", "extend"):
            tried = result.total([kind]) - result.total([kind], "unchanged")
            assert tried > 0 and result.total([kind], "rejected") == tried, kind


def test_a_receiver_on_the_device_path_sees_only_wire_errors():
    """The same mutated buffers received as on a GPU (``--path device``): every field decoded and summed before
    the message's checks are read, then refused by that read. A position that indexed past its slot first would
    be a crash (on a GPU a device-side assert, which ends the process)."""
    result = fuzz_wire.run(per_decoder=60, seed=2, per_scheme=24, device=True)
    report = fuzz_wire.format_report(result)
    assert result.total(outcome="crash") == 0, report
    assert result.total(fuzz_wire.MUST_NOT_BE_SILENT, "silent") == 0, report
    assert not result.failed and report.endswith("OK")
    assert result.total(outcome="rejected") > 0.8 * result.total()


def test_control_positions_used_before_their_check_are_found(monkeypatch):
    """Without the clamp of received positions (checked, but not yet read when they index), the device-path fuzz
    finds the crash."""
    import gradcomp.wire.container as container
    import gradcomp.wire.device as device
    import gradcomp.wire.format as wire_format

    def unclamped(pos, universe, checks):
        checks.append(wire_format._positions_ok(pos, universe))
        return pos

    for module in (container, device):  # every decoder that clamps received positions
        monkeypatch.setattr(module, "_received_positions", unclamped)
    result = fuzz_wire.run(per_decoder=96, seed=2, only=["topk", "sbc"], per_scheme=0, device=True)
    assert result.total(outcome="crash") > 0 and result.failed
    assert any("index out of range" in c for c in result.crashes)


def test_control_scheme_indices_unchecked_are_found(monkeypatch):
    """Without the range check of the coordinates it received, local top-k crashes on a valid container whose
    coordinates were changed (and its checksum recomputed): the check is what turns that into a WireError."""
    import gradcomp.schemes.topk_baselines as topk_baselines

    def unchecked(field, counts, bounds, what):
        starts = topk_baselines.offsets_of(counts)
        return [field[starts[n] : starts[n + 1]] for n in range(len(counts))]

    monkeypatch.setattr(topk_baselines, "split_indices", unchecked)
    result = fuzz_wire.Result()
    fuzz_wire.run_schemes(240, 2, result, only=["local_topk"])
    assert result.total(outcome="crash") > 0 and result.failed


def test_main_prints_the_table_and_exit_status(capsys):
    assert fuzz_wire.main(["--per-decoder", "24", "--per-scheme", "0", "--only", "threshold", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "threshold positions=golomb" in out and "flip2-word" in out and "\nOK\n" in out


def test_control_sections_that_disagree_are_found(monkeypatch):
    """Without the link between threshold's positions and values the fuzz finds the issue's crashes."""
    from gradcomp.compressors.sparse import Threshold, position_spec
    from gradcomp.wire import Codec, FieldSpec

    def unlinked(self, slot):
        return [position_spec(self.positions, slot.numel), FieldSpec(Codec.F32, max_count=slot.numel)]

    monkeypatch.setattr(Threshold, "specs", unlinked)
    result = fuzz_wire.run(per_decoder=600, seed=2, only=["threshold"])
    assert result.total(outcome="crash") > 0 and result.failed
    assert any("RuntimeError" in c for c in result.crashes)


def _weighted_sum_checksum(buf: torch.Tensor) -> int:
    """The version-1 checksum's sum (without its final bijective mix, which changes no collision)."""
    raw = buf.reshape(-1).numpy()
    raw = np.concatenate([raw, np.zeros(-raw.size % 8, dtype=np.uint8)])
    words = raw.view("<u8")
    with np.errstate(over="ignore"):
        weights = (np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        total = int((words * weights).sum(dtype=np.uint64))
    return (total + (raw.size + 1) * 0xD6E8FEB86659FD93) % 2**64


def test_control_a_weak_checksum_is_found(monkeypatch):
    import gradcomp.wire.container as container

    monkeypatch.setattr(container, "checksum64", _weighted_sum_checksum)
    monkeypatch.setattr(fuzz_wire, "checksum64", _weighted_sum_checksum)
    result = fuzz_wire.run(per_decoder=2400, seed=3, only=["none"])
    assert result.total(["flip2-word"], "silent") > 0 and result.failed


@pytest.mark.parametrize("kind", ["header+crc", "resize+crc", "payload+crc"])
def test_recomputed_checksums_are_valid(kind):
    """The semantic mutations really carry a valid checksum: only the section checks can object."""
    decoder = fuzz_wire.build_decoder("topk", "topk", {"density": 0.1, "positions": "golomb"})
    rng = fuzz_wire.random.Random(0)
    msg = decoder.messages[0]
    for _ in range(50):
        raw = fuzz_wire.mutate(kind, msg, rng)
        body = torch.frombuffer(bytearray(raw[fuzz_wire.HEADER_BYTES :]) or bytearray(1), dtype=torch.uint8)
        body = body[: len(raw) - fuzz_wire.HEADER_BYTES]
        assert int.from_bytes(raw[12:20], "little") == fuzz_wire.checksum64(body)
