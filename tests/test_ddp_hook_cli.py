"""``gradcomp train --ddp``: a gradcomp error raised in the hook is one ``gradcomp: error:`` line, as without --ddp.

DDP re-raises an exception from a communication hook's future as a bare RuntimeError ("Got the following error
when running the callback: WorkerLostError: ...", then the original traceback); the CLI unwraps it.
"""

from __future__ import annotations

import pytest
import torch

from gradcomp import cli
from gradcomp.errors import WorkerLostError
from gradcomp.train.ddp_hook import _unwrap

LOST = "rank 0: all_gather over gloo failed; a worker disappeared or did not answer within the time-out (test)"


def _as_ddp_raises_it(error: BaseException) -> RuntimeError:
    """The RuntimeError that DDP's backward raises when the hook's future holds ``error`` (the same chain)."""
    future = torch.futures.Future()
    chained = future.then(_unwrap)
    future.set_exception(error)
    try:
        chained.wait()
    except RuntimeError as exc:
        return exc
    raise AssertionError("the chained future did not fail")


def _train_raising(error: BaseException):
    def train(args):
        raise error

    return train


def test_a_lost_worker_in_the_hook_is_one_error_line(monkeypatch, capsys):
    wrapped = _as_ddp_raises_it(WorkerLostError(LOST))
    assert "Got the following error when running the callback" in str(wrapped) and "\nAt:\n" in str(wrapped)
    monkeypatch.setattr(cli, "_train", _train_raising(wrapped))
    assert cli.main(["train", "--ddp"]) == 2
    assert capsys.readouterr().err == f"gradcomp: error: {LOST}\n"


def test_a_chained_gradcomp_error_is_one_error_line(monkeypatch, capsys):
    try:
        try:
            raise WorkerLostError(LOST)
        except WorkerLostError as exc:
            raise RuntimeError("a wrapper") from exc
    except RuntimeError as exc:
        wrapped = exc
    monkeypatch.setattr(cli, "_train", _train_raising(wrapped))
    assert cli.main(["train"]) == 2
    assert capsys.readouterr().err == f"gradcomp: error: {LOST}\n"


@pytest.mark.parametrize("error", [RuntimeError("something else"), None])
def test_other_runtime_errors_still_raise(monkeypatch, error):
    # torch's own wrapping of an error that is not gradcomp's is not unwrapped either
    error = error or _as_ddp_raises_it(ValueError("not gradcomp's"))
    monkeypatch.setattr(cli, "_train", _train_raising(error))
    with pytest.raises(RuntimeError):
        cli.main(["train"])


def test_the_time_split_under_ddp_says_it_overlaps(capsys):
    """Under --ddp the hook's compress and communicate times are its thread's, overlapping the loop's own time,
    which holds backward's wait for them: summed, they were counted twice (an audit: 1.27 s of loop and 1.23 s of
    communication for 1.2 s of injected collective delay). The summary says so and keeps them apart."""
    from gradcomp.cli import main

    assert main(["train", "--ddp", "--workers", "2", "--steps", "2", "--model", "mlp", "--dataset", "synthetic",
                 "--no-progress", "--compressor", "topk", "--param", "density=0.1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "training loop" in out and "overlapping backward (not to be added)" in out, out
