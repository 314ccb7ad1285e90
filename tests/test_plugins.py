"""A method from another package: examples/plugin (``gradcomp-blocksign``) is found through the entry-point group
``gradcomp.methods``, listed by ``gradcomp list``, built by ``make`` and trained by ``gradcomp train``.

The test set-up installs it (README's test command, ``.ci/run``: ``pip install --no-deps -e examples/plugin``);
gradcomp itself does not know its name anywhere.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, distribution

import pytest
import torch

import gradcomp
from gradcomp import ErrorFeedback, Slot
from gradcomp.cli import main
from gradcomp.registry import BUILTIN, ENTRY_POINT_GROUP, compressor_class, origin
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES, decode, encode


@pytest.fixture(scope="module", autouse=True)
def installed():
    try:
        dist = distribution("gradcomp-blocksign")
    except PackageNotFoundError:
        pytest.fail("the example plugin is not installed: pip install --no-deps -e examples/plugin (README)")
    names = {ep.name for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP}
    assert names == {"blocksign"}


def test_the_plugin_is_found_and_is_no_builtin():
    assert "blocksign" in gradcomp.available() and "blocksign" not in BUILTIN
    assert origin("blocksign") == f"plugin gradcomp-blocksign {distribution('gradcomp-blocksign').version}"
    cls = compressor_class("blocksign")
    assert cls.__module__ == "gradcomp_blocksign" and issubclass(cls, gradcomp.Compressor)


def test_gradcomp_list_shows_the_plugin(capsys):
    assert main(["list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "plugin gradcomp-blocksign" in lines["blocksign"]
    assert "gathered" in lines["blocksign"] and "error feedback on" in lines["blocksign"]
    assert "block=None" in lines["blocksign"]
    assert "plugin" not in lines["topk"]


def test_make_builds_it_like_a_builtin():
    c = gradcomp.make("blocksign")
    assert isinstance(c, ErrorFeedback) and c.inner.name == "blocksign"  # the paper's error feedback, by default
    bare = gradcomp.make("blocksign", error_feedback=False, block=4)
    assert type(bare).__name__ == "BlockSign" and bare.params() == {"block": 4}
    with pytest.raises(gradcomp.ConfigError, match="block"):
        gradcomp.make("blocksign", block=0)
    with pytest.raises(gradcomp.ConfigError, match="no parameter 'density'"):
        gradcomp.make("blocksign", density=0.1)


def test_blockwise_scaled_sign_on_the_wire():
    c = gradcomp.make("blocksign", error_feedback=False, block=3)
    slot = Slot("w", 0, 7)
    x = torch.tensor([1.0, -2.0, 3.0, 0.0, -4.0, 5.0, -6.0])
    specs = c.specs(slot)
    fields = decode(encode(c.compress(x, slot, 0), specs), specs)
    # blocks [1, -2, 3], [0, -4, 5], [-6]: scales are the mean magnitudes, signs as sent (zero goes as +)
    assert torch.equal(fields[0], torch.tensor([2.0, 3.0, 6.0]))
    assert torch.equal(c.decompress(fields, slot, 0), torch.tensor([2.0, -2.0, 2.0, 3.0, -3.0, 3.0, -6.0]))
    whole = gradcomp.make("blocksign", error_feedback=False)  # the paper's block: the whole slot (a layer)
    assert torch.equal(whole.compress(x, slot, 0)[0], torch.tensor([3.0]))
    empty = Slot("e", 1, 0)
    assert whole.decompress(decode(encode(whole.compress(torch.zeros(0), empty, 0), whole.specs(empty)),
                                   whole.specs(empty)), empty, 0).numel() == 0


def _message_bits(numels: list[int]) -> int:
    """One step's encoded message of every slot, block=None: one float32 scale and d sign bits per slot."""
    sections = sum(2 * SECTION_HEADER_BYTES + 4 + -(-d // 8) for d in numels)
    return 8 * (HEADER_BYTES + sections)


@pytest.mark.slow
def test_gradcomp_train_trains_with_the_plugin(tmp_path):
    """Two spawned gloo workers, each of which finds the plugin itself; the bytes are the plugin's specs'."""
    out = tmp_path / "run.json"
    steps = 12
    args = ["train", "--dataset", "synthetic", "--model", "mlp", "--steps", str(steps), "--no-progress",
            "--workers", "2", "--compressor", "blocksign", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["compressor"] == "blocksign" and result["error_feedback"] and result["backend"] == "gloo"
    assert result["replicas_identical"]
    mlp_slots = [64 * 128, 128, 128 * 10, 10]
    assert result["bits_up_per_worker"] == steps * (_message_bits(mlp_slots) + 32)  # + the 4-byte agreement flag
    assert result["control_bits_up"] == steps * 32
    losses = [loss for _, loss in result["loss_curve"]]
    assert sum(losses[-3:]) / 3 < losses[0]  # it learns
    assert result["test_accuracy"] > 0.3  # ten classes: chance is 0.1
