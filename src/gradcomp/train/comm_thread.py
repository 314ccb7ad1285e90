"""The DDP hook's communication thread: one thread per hook state, draining a FIFO of bucket jobs in order.

``CompressionHookState`` (``train.ddp_hook``) puts one ``_Job`` per bucket on ``_CommThread``'s FIFO from the
autograd thread and returns the job's future at once. The thread takes the jobs one by one and issues every
collective of every job itself, so all the hook's collectives form one sequence, bucket order then round order,
the same on every rank when the jobs are submitted in DDP's bucket order (why a thread and not chained futures:
``train.ddp_hook``'s docstring).

Contract:

- Every submitted job's future is completed once: with the job's buffer, holding the average in place (its dtype
  kept), or with an error. Nothing is left pending: if the thread dies (an error outside a job's own handling),
  every queued future fails with the cause, and later jobs are refused at once.
- A job's exchange agrees the ranks' finiteness on its first message (``GradientExchange.exchange``); a job with
  ``finish`` (``none``'s direct path) runs that instead. A pass (the jobs from one with ``first`` to the one with
  ``retain``) found bad on some rank puts the method's state back as it was at the pass's first bucket (one
  ``snapshot`` per pass) and fills the pass's buckets with NaN on every rank, from the bad one on (all of them
  when the pass's verdicts are read at its last bucket); with ``nonfinite="raise"`` the pass's agreed
  NonFiniteGradientError is held for ``take_pass_error`` (raised from backward by the hook), never set on a
  future. On the device path the pass's deferred verdicts and decoded messages' checks are read once, at its last
  bucket, with the ranks' agreement on refused messages (``settle``); handed on (a scaler,
  ``nonfinite="propagate"``), an all-reduce-only pass's verdict is applied on the device unread where the state
  allows it.
- The first error (of a job, or one given to ``fail``) is ``failure``; every later job is refused with a
  CommunicationError naming it, with nothing sent, since the ranks' collective sequences may no longer agree.
- ``wait_idle`` and ``stop`` wait at most ``timeout`` seconds (``wait_bound`` of ``group_timeout``: the process
  group's time-out and a margin) and notice a dead thread.
"""

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp.compressors.base import Slot
from gradcomp.errors import CommunicationError, NonFiniteGradientError
from gradcomp.finite import finite_flag, finite_flags, loss_scale
from gradcomp.train.agreement import agreed_non_finite, any_abandons, locally_bad, settle
from gradcomp.train.exchange import GradientExchange
from gradcomp.wire.bits import host_path
from gradcomp.wire.device import DeviceChecks, holding_for_the_pass
from gradcomp.wire.refusals import Refusals

DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group time-out, when the group's own cannot be read


# what a NonFiniteGradientError of the hook says to do instead
HOOK_REMEDY = (
    "to skip such steps and train on as torch's DDP does, leave nonfinite= at its default (\"propagate\": the NaN "
    "reaches every rank's gradients, the method's state untouched) and let your GradScaler or check skip the step, "
    "or pass scaler=your_grad_scaler to register_ddp_hook"
)

CLOSED = (
    "this DDP hook state was closed; torch allows one communication hook per DistributedDataParallel model, so wrap "
    "the module in a new DistributedDataParallel, register a hook on it and load this state's state_dict() into it"
)


def group_timeout(group: dist.ProcessGroup | None, device: torch.device | None = None) -> float | None:
    """The process group's time-out in seconds, or None when torch does not expose it."""
    with contextlib.suppress(Exception):  # not a public API: the group's backend options
        group = group if group is not None else dist.group.WORLD
        backend = group._get_backend(device or torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    return None


def wait_bound(timeout_s: float | None) -> float:
    """How long the hook state's ``wait`` / ``close`` wait for the thread: the group's time-out (a job in a
    collective ends by then, with its result or with the time-out's error) and a margin for the jobs' own work."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    return timeout_s + max(10.0, 0.1 * timeout_s)


@dataclass
class _Job:
    slots: list[Slot]
    tensors: list[Tensor]  # what the scheme reads: per-parameter views of ``buffer``, or ``buffer`` itself
    buffer: Tensor  # the bucket's flat buffer, overwritten with the average
    step: int
    future: torch.futures.Future
    retain: list[Slot] | None  # at the last bucket of a pass: every slot of the pass
    stream: Any = None  # the autograd thread's CUDA stream, or None on the CPU
    first: bool = False  # the first bucket of a backward pass
    names: list[str] | None = None  # the bucket's parameters (to name a non-finite one)
    grads: list[Tensor] | None = None  # granularity "bucket": the parameters' gradients (to name a non-finite one)
    finish: Any = None  # ``none``'s direct path: the read of its allreduce's verdict, run here instead of an exchange


class _CommThread:
    """One thread draining one FIFO: every job's rounds run to the end, in submission order.

    Shared state (the queue, the count of jobs not yet completed, ``failure``) is guarded by one lock (the
    condition's): ``failure`` is written by this thread and, for ``none``'s direct path, by gloo's callback
    thread. If the thread dies (an error outside a job's own handling, e.g. completing a future raised), every
    job still queued has its future failed with the cause, and later jobs are refused at once, so no future is
    left pending. ``wait_idle`` and ``stop`` wait at most ``timeout`` seconds (the process group's time-out and
    a margin: a job in a collective ends by then, with a result or the collective's time-out error).
    """

    def __init__(self, exchange: GradientExchange, timeout: float = DEFAULT_TIMEOUT_S, scaler: Any = None,
                 propagate: bool = False):
        self.exchange = exchange
        self.timeout = timeout
        self.scaler = scaler
        # a bad pass's NaN is handed on, on every rank, instead of raised: to the scaler, or to the user's own check
        self.propagate = scaler is not None or propagate
        self._snapshot: dict | None = None  # the method's state at the start of the pass (taken on this thread)
        self._skipping = False  # the pass overflowed on some rank (propagated): its later buckets are skipped
        # the pass's deferred verdicts (device flags, True: abandon) that no read has taken, read once at its last
        # bucket; and, per bucket of the pass, its buffer, this rank's own flag and its parameters' names
        self._pass_flags: list[Tensor] = []
        self._pass_buckets: list[tuple[Tensor, Tensor | bool, list[str]]] = []
        # the checks of the messages the pass's buckets decoded (device path), read with its verdicts at its end
        self._pass_checks = DeviceChecks()
        self._pass_refusals = Refusals()
        self._failure: BaseException | None = None
        # nonfinite="raise": the agreed NonFiniteGradientError of the pass, raised from backward once DDP has
        # finished the pass (``ddp_hook.CompressionHookState._raise_at_the_end``), not through a future
        self._pass_error: NonFiniteGradientError | None = None
        self._jobs: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._stopped = False
        self._dead: BaseException | None = None  # why the thread ended abnormally
        self._thread: threading.Thread | None = None

    @property
    def failure(self) -> BaseException | None:
        with self._cond:
            return self._failure

    def refuse_pass(self, error: NonFiniteGradientError) -> None:
        """Note the pass's agreed non-finite verdict (the first of the pass) for backward to raise at its end."""
        with self._cond:
            if self._pass_error is None:
                self._pass_error = error

    def take_pass_error(self) -> NonFiniteGradientError | None:
        with self._cond:
            error, self._pass_error = self._pass_error, None
            return error

    def fail(self, exc: BaseException) -> BaseException:
        """Record ``exc`` as the first failure unless one is recorded already; returns the first failure."""
        with self._cond:
            if self._failure is None:
                self._failure = exc
            return self._failure

    def submit(self, job: _Job) -> None:
        with self._cond:
            if self._stopped:
                raise CommunicationError(CLOSED)
            if self._dead is not None:
                _fail_future(job.future, _refusal(self._dead, "the DDP hook's communication thread died"))
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gradcomp-ddp-comm", daemon=True)
                self._thread.start()
            self._jobs.append(job)
            self._pending += 1
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> None:
        """Return once every submitted job has completed its future.

        CommunicationError if that takes longer than ``timeout`` seconds (default: the process group's
        time-out and a margin), naming the failure if there is one. A dead thread's jobs were failed already.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while self._pending:
                if self._thread is not None and not self._thread.is_alive():
                    self._drain(self._dead or RuntimeError("the communication thread ended"))
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    cause = f"; first failure: {type(self._failure).__name__}: {self._failure}" if self._failure else ""
                    raise CommunicationError(
                        f"the DDP hook's communication thread still had {self._pending} bucket(s) after "
                        f"{self.timeout if timeout is None else timeout:.0f} s (the process group's time-out and a "
                        f"margin){cause}"
                    )
                self._cond.wait(min(left, 1.0))  # and look at the thread's liveness every second

    def stop(self, timeout: float | None = None) -> bool:
        """Let the thread finish the queued jobs, then end it; waits at most ``timeout`` seconds (default: the
        process group's time-out and a margin). Returns whether the thread ended in time; if not, the jobs it
        had not started have their futures failed, and the thread (a daemon) is left to end with its collective.
        """
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(self.timeout if timeout is None else timeout)
        if thread.is_alive():
            with self._cond:
                self._drain(CommunicationError("the DDP hook state was closed before this bucket was exchanged"))
            return False
        return True

    @property
    def closed(self) -> bool:
        return self._stopped

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _drain(self, cause: BaseException) -> None:
        """Fail the future of every job not started (the lock held)."""
        while self._jobs:
            _fail_future(self._jobs.popleft().future, _refusal(cause, "the DDP hook's communication thread died"))
            self._pending -= 1
        self._cond.notify_all()

    def _loop(self) -> None:
        job: _Job | None = None
        try:
            while True:
                with self._cond:
                    while not self._jobs and not self._stopped:
                        self._cond.wait()
                    if not self._jobs:
                        return
                    job = self._jobs.popleft()
                try:
                    self._run(job)
                finally:
                    with self._cond:
                        self._pending -= 1
                        self._cond.notify_all()
                job = None
        except BaseException as exc:  # the thread dies: nothing may stay pending
            with self._cond:
                if self._failure is None:
                    self._failure = exc
                self._dead = exc
                if job is not None:
                    _fail_future(job.future, exc)
                self._drain(exc)

    def _run(self, job: _Job) -> None:
        stream = torch.cuda.stream(job.stream) if job.stream is not None else contextlib.nullcontext()
        with stream:
            try:
                failure = self.failure
                if failure is not None:
                    raise _refusal(failure, "an earlier exchange of this DDP hook failed")
                with torch.no_grad():
                    if job.finish is not None:
                        job.finish()
                    else:
                        self._exchange(job)
                _set_result(job.future, job.buffer)
            except Exception as exc:
                self.fail(exc)
                _fail_future(job.future, exc)

    def _exchange(self, job: _Job) -> None:
        """The bucket's exchange, agreed finite on every rank (``train.ddp_hook``'s docstring, "Non-finite")."""
        if job.first:
            self._snapshot, self._skipping = self.exchange.snapshot(), False
            self._pass_flags, self._pass_buckets, self._pass_checks = [], [], DeviceChecks()
            self._pass_refusals = Refusals()
        if self._skipping:  # an earlier bucket of this pass overflowed on some rank: every rank skips the rest
            job.buffer.fill_(float("nan"))
            return
        # on this thread: the autograd thread never waits for it. On the device path the verdict stays a device
        # flag, read once with the bucket's other checks (GradientExchange.exchange); names only on a failure.
        device_path = bool(job.tensors) and not host_path(job.tensors[0])
        here = [] if device_path else self._not_finite(job)
        scale = loss_scale(self.scaler)
        if scale is not None and not here:
            job.buffer.div_(scale)  # error feedback and momentum see unscaled gradients (a power of 2: exact)
        finite = finite_flag([job.buffer]) if device_path else not here  # the views' buffer: one pass, few launches
        self._pass_buckets.append((job.buffer, finite, list(job.names or [])))
        with holding_for_the_pass(self._pass_checks if device_path else None):
            averages = self.exchange.exchange(
                job.slots, job.tensors, job.step, validate=False, finite=finite, handed_on=self.propagate,
                verdicts=self._pass_flags if device_path else None, refusals=self._pass_refusals,
            )
        if averages is None:  # some rank's gradients were not finite: every rank is here, at this bucket
            if device_path:  # (a division by the scale changes no entry's finiteness)
                here = self._not_finite(job)
            self.exchange.restore(self._snapshot)
            if not self.propagate:
                self.refuse_pass(agreed_non_finite(job.step, here + self.exchange.refusal(), remedy=HOOK_REMEDY))
            self._skipping = True
            job.buffer.fill_(float("nan"))  # on every rank: the scaler's found_inf (or the user's check) skips
            return
        for target, average in zip(job.tensors, averages):
            if average.data_ptr() != target.data_ptr():  # an in-place exchange left it there already
                target.copy_(average.view_as(target))
        if scale is not None:
            job.buffer.mul_(scale)  # back in the scaler's units, for scaler.unscale_
        if (job.retain is not None and (self._pass_flags or self._pass_checks.pending or self._pass_refusals.used)
                and not self._pass_handed_on() and self._pass_abandoned(job)):
            self.exchange.restore(self._snapshot)
            if not self.propagate:
                self.refuse_pass(agreed_non_finite(job.step, self._locally_bad(), remedy=HOOK_REMEDY))
            for buffer, _, _ in self._pass_buckets:
                buffer.fill_(float("nan"))  # the pass's buckets (the last reaches .grad): the scaler (or user) skips
            return
        if job.retain is not None:
            self.exchange.scheme.retain(job.retain)

    def _pass_handed_on(self) -> bool:
        """Under a scaler or ``nonfinite="propagate"``: the pass's deferred verdicts applied on the device, unread
        (True), or False where they must be read (``_pass_abandoned``). The agreed flag "some rank's gradients were
        not finite in some bucket" fills the pass's buckets with NaN (the last one's future is still open, so its
        NaN reaches ``.grad`` on every rank; the earlier ones' only as bucket views) and puts the method's state back
        where it was at the start of the pass (``GradientExchange.restore_where``), by ``torch.where`` on the flag:
        a good pass changes nothing, a bad one ends as the read would have left it, and the host waits for nothing.
        False when the state's layout moved during the pass (a slot's first step), which only the read can undo."""
        if not self.propagate or self._pass_checks.pending or self._pass_refusals.used:  # only a read refuses one
            return False
        bad = any_abandons(self._pass_flags)
        if not self.exchange.restore_where(self._snapshot, bad):
            return False
        self._pass_flags = []
        for buffer, _, _ in self._pass_buckets:
            buffer.masked_fill_(bad, float("nan"))  # the pass's buckets, on every rank, where bad
        return True

    def _pass_abandoned(self, job: _Job) -> bool:
        """The pass's one read (on the device path) of its deferred verdicts, with every check of the messages its
        buckets decoded (``wire.device.hold_for_the_pass``) and the ranks' agreement on the messages they refused
        (``settle``: WireError on every rank, the state put back as at the start of the pass): whether some rank's
        gradients, or some aggregate, were not finite in some bucket. The same answer on every rank, at the same
        bucket."""
        flags, self._pass_flags = self._pass_flags, []
        checks, self._pass_checks = self._pass_checks, DeviceChecks()
        refusals, self._pass_refusals = self._pass_refusals, Refusals()
        try:
            return settle(self.exchange.transport, refusals, job.buffer.device, checks, flags, job.step)
        except Exception:
            self.exchange.restore(self._snapshot)
            raise

    def _locally_bad(self) -> list[str]:
        """This rank's buckets of the pass whose gradients were not finite (read on a failure only), named by their
        parameters: their gradients are averages by now, so no closer than the bucket."""
        return locally_bad([(names, flag) for _, flag, names in self._pass_buckets])

    @staticmethod
    def _not_finite(job: _Job) -> list[str]:
        """The names of the job's tensors (of the parameters, at granularity "bucket") that hold a NaN or Inf."""
        flags = finite_flags(job.tensors)
        if job.grads is not None and not all(flags):
            flags = finite_flags(job.grads)
        return [name for name, ok in zip(job.names or [], flags) if not ok]


def _set_result(future: torch.futures.Future, value: Tensor) -> None:
    """Complete ``future`` with ``value`` (one place, so that a test can make it fail)."""
    future.set_result(value)


def _fail_future(future: torch.futures.Future, exc: BaseException) -> None:
    """Complete ``future`` with ``exc`` unless it is completed already (then there is nothing to do)."""
    if future.done():
        return
    with contextlib.suppress(RuntimeError):  # completed meanwhile
        future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))


def _refusal(cause: BaseException, what: str) -> CommunicationError:
    error = CommunicationError(f"{what} ({type(cause).__name__}: {cause}); nothing more is sent")
    error.__cause__ = cause
    return error
