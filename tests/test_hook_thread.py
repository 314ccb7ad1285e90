"""The DDP hook's communication thread never leaves a future pending and never waits without a bound.

Unit tests drive ``_CommThread`` with a stand-in exchange (no process group); the gloo test makes a bucket's
work raise at each stage of a real DDP step (compress, collective, decode, completing the future, the thread
itself dying) and checks that backward raises on every rank with the cause, quickly, and the group stays usable.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.errors import CommunicationError
from gradcomp.train import comm_thread
from gradcomp.train.comm_thread import _CommThread, _Job

pytestmark = pytest.mark.timeout(120)


class _Die(BaseException):
    """Not an Exception: escapes a job's own handling and ends the thread."""


class _Exchange:
    """A stand-in for GradientExchange: doubles the tensors; the first job waits for ``release``."""

    def __init__(self, fail_with: BaseException | None = None):
        self.release = threading.Event()
        self.started = threading.Event()
        self.fail_with = fail_with
        self.scheme = SimpleNamespace(retain=lambda slots: None)

    def snapshot(self):
        return {}

    def restore(self, snapshot):
        pass

    def exchange(self, slots, tensors, step, validate=False, finite=None, handed_on=False, verdicts=None, refusals=None):
        self.started.set()
        assert self.release.wait(30)
        if self.fail_with is not None:
            raise self.fail_with
        return [t * 2 for t in tensors]


def _job(step: int) -> _Job:
    t = torch.ones(3)
    return _Job(slots=[], tensors=[t], buffer=t, step=step, future=torch.futures.Future(), retain=None)


def _outcomes(jobs: list[_Job]) -> list[str]:
    out = []
    for job in jobs:
        assert job.future.done()
        try:
            job.future.wait()
            out.append("ok")
        except Exception as exc:  # noqa: BLE001 - the outcome is what is checked
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_a_thread_that_dies_fails_every_queued_future_with_the_cause():
    exchange = _Exchange(fail_with=_Die("the thread broke (test)"))
    worker = _CommThread(exchange, timeout=20)
    jobs = [_job(i) for i in range(4)]
    for job in jobs:
        worker.submit(job)
    assert exchange.started.wait(10)
    exchange.release.set()
    worker.wait_idle()  # returns: nothing pending
    outcomes = _outcomes(jobs)
    assert all("the thread broke (test)" in o for o in outcomes), outcomes
    assert not worker.alive and isinstance(worker.failure, _Die)
    late = _job(9)
    worker.submit(late)  # refused at once, with the cause
    assert "the thread broke (test)" in _outcomes([late])[0]


def test_completing_a_future_that_raises_fails_it_and_every_later_one(monkeypatch):
    def broken(future, value):
        raise RuntimeError("set_result broke (test)")

    monkeypatch.setattr(comm_thread, "_set_result", broken)
    exchange = _Exchange()
    worker = _CommThread(exchange, timeout=20)
    jobs = [_job(i) for i in range(3)]
    for job in jobs:
        worker.submit(job)
    exchange.release.set()
    worker.wait_idle()
    outcomes = _outcomes(jobs)
    assert "set_result broke (test)" in outcomes[0], outcomes
    assert all(o.startswith("CommunicationError") and "set_result broke (test)" in o for o in outcomes[1:]), outcomes
    assert worker.alive  # an Exception is a job's failure, not the thread's: it goes on refusing


def test_wait_idle_and_stop_are_bounded():
    exchange = _Exchange()  # never released: a job stuck as in a collective whose peer never comes
    worker = _CommThread(exchange, timeout=1.0)
    jobs = [_job(i) for i in range(3)]
    for job in jobs:
        worker.submit(job)
    assert exchange.started.wait(10)
    started = time.monotonic()
    with pytest.raises(CommunicationError, match="still had 3 bucket"):
        worker.wait_idle()
    assert not worker.stop(timeout=0.5)  # gave up on the stuck job
    assert time.monotonic() - started < 10
    outcomes = _outcomes(jobs[1:])  # the jobs never started fail; the stuck one ends with its "collective"
    assert all("closed before this bucket" in o for o in outcomes), outcomes
    exchange.release.set()


def test_the_direct_paths_failure_is_recorded_once_under_the_lock():
    worker = _CommThread(_Exchange(), timeout=5)
    first, second = RuntimeError("first"), RuntimeError("second")
    barrier = threading.Barrier(8)

    def record(exc):
        barrier.wait()
        worker.fail(exc)

    threads = [threading.Thread(target=record, args=(first if i == 0 else second,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert worker.failure in (first, second)
    assert worker.fail(RuntimeError("third")) is worker.failure


# -- a real DDP step on gloo, broken at each stage ----------------------------------------------------------------

STAGES = ("compress", "collective", "decode", "set_result", "thread")


def _break(stage: str, state, monkeypatch_undo: list) -> str:
    """Make ``stage`` of every bucket's work raise; returns the text the error must carry."""

    def patch(obj, name, value):
        monkeypatch_undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def raiser(text, kind=RuntimeError):
        def f(*args, **kwargs):
            raise kind(text)

        return f

    text = f"{stage} broke (test)"
    if stage == "compress":
        patch(state.exchange.scheme.compressor, "compress", raiser(text, ValueError))
    elif stage == "collective":
        patch(state.transport, "_all_gather", raiser(text))
    elif stage == "decode":
        import gradcomp.schemes.single_round as single_round

        patch(single_round, "aggregate_buffers", raiser(text, gradcomp.WireError))
    elif stage == "set_result":
        patch(comm_thread, "_set_result", raiser(text))
    else:
        patch(_CommThread, "_run", raiser(text, _Die))
    return text


def _each_stage(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    out = {}
    for stage in STAGES:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        ddp = DDP(model, bucket_cap_mb=0.0005)  # several buckets after the rebuild
        state = gradcomp.register_ddp_hook(ddp, gradcomp.make("topk", density=0.25, error_feedback=True))
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        F.cross_entropy(ddp(x), y).backward()  # a healthy pass (and DDP's rebuild)
        undo: list = []
        text = _break(stage, state, undo)
        started = time.monotonic()
        try:
            F.cross_entropy(ddp(x), y).backward()
        except RuntimeError as exc:
            error = str(exc)
        else:
            error = "no error"
        seconds = time.monotonic() - started
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)
        state.wait(timeout=30)  # nothing pending
        closed = state.close(timeout=30)
        t = torch.ones(2)
        dist.all_reduce(t)  # the default group is usable at once
        out[stage] = {"error": error, "text": text, "seconds": seconds, "failure": repr(state.failure),
                      "closed": closed, "sum": t.tolist(), "bound": state._worker.timeout}
    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=7))
    out["timeouts"] = (comm_thread.group_timeout(None), comm_thread.group_timeout(short))
    return out


@pytest.mark.slow
def test_a_bucket_broken_at_each_stage_raises_from_backward_on_every_rank():
    for per_rank in run_workers(_each_stage, 2, timeout=110):
        # the thread's waits are bounded by the group's time-out (60 s in these workers) and a margin
        assert per_rank.pop("timeouts") == (60.0, 7.0)
        for stage, r in per_rank.items():
            assert r["bound"] == comm_thread.wait_bound(60.0) == 70.0, (stage, r)
            assert r["text"] in r["error"], (stage, r)
            assert r["text"] in r["failure"], (stage, r)
            assert r["seconds"] < 30 and r["closed"], (stage, r)
            assert r["sum"] == [2.0, 2.0], (stage, r)
