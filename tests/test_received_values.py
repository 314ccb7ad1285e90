"""A message whose checksum is right but whose values no sender makes (a wrong or hostile sender: the checksum
cannot catch it) is refused with WireError by the receiver, on the host path and on the device path (where the
check joins the decoding step's one read), instead of decoding silently to something else: a level index above
the method's ``levels`` (decoded above the norm), TernGrad's unused code 3, and scale fields of the wrong sign
(every decoded sign flipped). Sound messages still decode, and a NaN scale (the device path's way of sending a
non-finite gradient) is left to the finiteness check."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp.compressors.base import Slot, bind_worker
from gradcomp.errors import WireError
from gradcomp.schemes.single_round import aggregate_buffers, encode_slots
from gradcomp.wire.refusals import StepAbandoned
from wire_paths import device_path

SLOT = Slot("w", 0, 203)


def _fields(name: str, **params):
    compressor = gradcomp.make(name, **params)
    bind_worker(compressor, 0)
    x = torch.randn(SLOT.numel, generator=torch.Generator().manual_seed(0))
    return compressor, compressor.compress(x, SLOT, 0)


def _receive(compressor, fields):
    buffer = encode_slots(compressor, [SLOT], [fields])  # the sender's own encoding: the checksum is right
    return aggregate_buffers(compressor, [SLOT], [buffer], 0, torch.device("cpu"), final=True)[0]


def _level_above(compressor, fields):
    norm, codes = fields
    codes = codes.clone()
    codes[5] = compressor.levels + 1  # fits the code's width unless levels = 2^b - 1
    return [norm, codes]


def _negated(index):
    def spoil(compressor, fields):
        fields = [f.clone() for f in fields]
        fields[index] = -fields[index]
        return fields

    return spoil


def _cnat_norm_negative(compressor, fields):
    norm, codes = fields
    return [norm | 256, codes]  # the 9-bit C_nat code's sign bit: -norm


def _terngrad_code_3(compressor, fields):
    scale, codes = fields
    codes = codes.clone()
    codes[7] = 3
    return [scale, codes]


CASES = [
    ("random_dithering", {"levels": 5}, _level_above, "a level index above levels = 5"),
    ("natural_dithering", {"levels": 5}, _level_above, "a level index above levels = 5"),
    ("qsgd", {"levels": 16}, _level_above, "a level index above levels = 16"),
    ("qsgd", {"levels": 5}, _negated(0), "a negative norm"),
    ("random_dithering", {"norm_codec": "cnat"}, _cnat_norm_negative, "a negative norm"),
    ("terngrad", {}, _terngrad_code_3, "code 3"),
    ("terngrad", {}, _negated(0), "a negative scale"),
    ("efsignsgd", {"error_feedback": False}, _negated(1), "a negative value for the \\+ sign"),
    ("onebit", {"error_feedback": False}, _negated(1), "a negative value for the \\+ sign"),
    ("stc", {"density": 0.1, "error_feedback": False}, _negated(2), "a negative mean"),
]


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("name,params,spoil,message", CASES)
def test_a_value_no_sender_makes_is_refused(name, params, spoil, message, path, monkeypatch):
    if path == "device":
        device_path(monkeypatch)
    compressor, fields = _fields(name, **params)
    sound = _receive(compressor, fields)
    assert torch.equal(sound, compressor.decompress(fields, SLOT, 0))
    with pytest.raises(WireError, match=message):
        _receive(compressor, spoil(compressor, fields))


def test_a_level_index_is_not_read_where_none_can_be_out_of_range(monkeypatch):
    """levels = 2^b - 1 (the default 7, QSGD's 127): every index the width holds is a level, so no pass is made."""
    from gradcomp.compressors import natural

    calls = []
    monkeypatch.setattr(natural, "check_received_range", lambda values, low, high, message: calls.append(message))
    compressor, fields = _fields("qsgd", levels=127)
    _receive(compressor, fields)
    assert [m for m in calls if "level index" in m] == [] and len(calls) == 1  # the norm's sign only


def test_a_nan_norm_is_left_to_the_finiteness_check(monkeypatch):
    """On the device path a non-finite gradient travels as a NaN norm: the receivers abandon the step, as before."""
    device_path(monkeypatch)
    compressor, fields = _fields("qsgd", levels=16)
    fields = [torch.full_like(fields[0], float("nan")), fields[1]]
    with pytest.raises(StepAbandoned):
        _receive(compressor, fields)
