"""A DistributedDataParallel communication hook that overlaps gradcomp's exchanges with backward.

    state = gradcomp.register_ddp_hook(ddp_model, gradcomp.make("topk", density=0.01, error_feedback=True))

Design: one communication thread per hook state, fed by a FIFO (the thread: ``train.comm_thread``).

- The hook runs on the autograd thread. It puts ``(slots, tensors, step, future)`` on the FIFO and returns the
  future at once, so backward goes on computing the next bucket while this one is exchanged; it reads nothing
  of the gradients, so it never waits for the device.
- The thread takes the jobs one by one, checks the bucket for NaN / Inf, runs the scheme's rounds with the
  ranks' finiteness agreed on the first message (``drive_agreeing``, see "Non-finite" below), then writes the
  averages into the bucket's buffer in place (its dtype kept) and completes the future with that buffer
  (``set_result``), or with the error (``set_exception``).

Why a thread and not torch's chained futures (``all_reduce(async_op=True).get_future().then(...)``): with
gloo every rank must issue the collectives of a process group in the same order. DDP calls the hook for
buckets in bucket-index order on every rank, so collectives issued *from the hook* are ordered; a second
round issued from a ``.then`` callback is not (callbacks run whenever a collective completes), which is why
torch's PowerSGD hook fails on gloo with more than one bucket. Here every collective of every round is
issued by the one thread, in FIFO order, i.e. in bucket order then round order: the same sequence on every
rank by construction, for any scheme (single-round compressors, parameter server, PowerSGD's several rounds).
Compression math runs on the thread too, off the autograd thread (torch ops release the GIL).

Slots (``granularity``):

- ``"layer"`` (default): every parameter in a bucket is its own slot, named and indexed exactly as
  ``GradientAggregator`` does (``named_parameters()`` order, parameters that require grad; ``shape`` the
  parameter's). Shared randomness, residuals and results therefore match GradientAggregator's, and DDP's
  bucket rebuild after the first iteration changes nothing: a residual belongs to a parameter, not a bucket.
- ``"bucket"``: the whole bucket buffer is one slot (the old behaviour), named ``bucket<i>:<digest of the
  bucket's parameter list>``, so a rebuilt bucket holding other parameters never inherits another bucket's
  residual (one holding the same parameters in the same order keeps its own).

At the last bucket of a backward pass the scheme is told which slots exist (``scheme.retain``): residuals of
slots that were not seen in the pass (a bucket that DDP rebuilt away) are dropped, not kept in memory or in
checkpoints. The step counter, which seeds shared randomness, advances after the last bucket.

``min_compression_rate`` (default 2, like torch's PowerSGD hook): with a single-message compressor that is
gathered (top-k, sign, ...), a slot whose message would not be at least that many times smaller than its
fp32 values (a tiny tensor, a density that keeps most entries) travels uncompressed, in one allreduce before
the gathered round. Summed compressors (random-k, fp16) ignore it, and methods that own their rounds have
their own (``make("powersgd", min_compression_rate=...)``). ``None`` turns it off.

``none`` (uncompressed fp32 by allreduce) sends nothing from the thread: its only collective is one allreduce
per bucket, so the hook issues it itself, asynchronously, in DDP's bucket order, as torch's own allreduce does
(the order is the same on every rank). The bucket buffer *is* its parameters' gradients back to back, i.e. the
scheme's message: it is divided by W and all-reduced in place, with no copy; the bytes and the average are the
scheme's. Issued directly it runs as fast as torch's own Python allreduce hook, where the thread's wake-ups cost
a few percent (docs/ddp.md has the timings). On the device path the thread still reads the allreduce's
finiteness verdict (``CompressionHookState._direct`` says why not in a callback); with a scaler, or with
``nonfinite="propagate"``, nothing reads it.

Non-finite. Every rank's verdict on a bucket rides on the bucket's first message (``drive_agreeing``): if any
rank's bucket held a NaN / Inf, every rank learns it at that message and stops there. (On the device path a scheme
whose messages the wire does not decode — all-reduces only: none, fp16, bf16, random-k, random block, PowerSGD,
sketched SGD, true top-k — leaves each bucket's agreed verdict on the device, and the thread reads the whole pass's
in one transfer at its last bucket, before that bucket's future, which DDP waits for at the end of backward, is
completed: one read per backward pass instead of one per bucket, so the thread never waits for the device before
the last bucket. A bad pass then fails or is skipped at its last bucket, with the earlier buckets' results already
in their buffers: backward raises, or the scaler skips, before anything is applied.) The method's state is then
put back to what it was at the start of the pass (a ``snapshot`` taken at the first bucket of every pass: one
copy of the state per step). By default (``nonfinite="propagate"``, torch's hooks' behaviour) and with ``scaler=``
(a ``torch.amp.GradScaler``) the pass is skipped: the bad bucket and every later one are filled with NaN on every
rank, so an unchanged ``scaler.step`` skips and ``scaler.update`` lowers the scale everywhere (or the user's own
check decides); with a scaler, gradients are divided by the scale before compression (residuals and momentum in
unscaled units) and the average multiplied back. With ``nonfinite="raise"`` the pass is skipped the same way, and
then every rank raises the same NonFiniteGradientError from ``backward`` itself, the typed error, once DDP has
ended the pass cleanly (``CompressionHookState._raise_at_the_end``): the next backward works. On the device path,
when nothing raises, nothing reads the verdict of a scheme that only all-reduces, so that a step on a GPU waits
for nothing: a stateless one's sum carries a bad rank's NaN to every rank by itself, and the others' pass-end
flags are applied on the device (``_CommThread._pass_handed_on``: NaN into the pass's buckets and the state put back, by
``torch.where`` on the agreed flag; what reaches ``.grad`` is the last bucket, and every bucket with
``gradient_as_bucket_view=True``: DDP has copied the others by then).
(After any other error inside backward DDP itself refuses the next iteration: "Expected to have finished
reduction in the prior iteration"; rebuild the DDP model to go on.) An error on the thread (a collective that
failed or timed out, a bad message) completes that bucket's future with the exception; DDP raises it from
``backward`` as a RuntimeError whose message names the original exception and its traceback (the original object
is ``state.failure``). (A message that fails its checks is not such an error at
once: it is noted, the pass goes on, and at its last bucket the ranks agree on it, ``settle``, so that every rank
raises WireError at the same pass, the state put back.) The thread then refuses every later bucket at once
(CommunicationError naming the first error; nothing more is sent), since the ranks' collective sequences may
no longer agree. Every future is completed, with a result or an error, but only once its collectives return:
a rank that waits for a peer that never comes waits until the process group's time-out. If the thread itself
dies (an error outside a job's handling), every queued future fails with the cause and later buckets are
refused at once; ``wait`` and ``close`` wait at most the group's time-out and a margin, and notice a dead thread.

Process group. ``register_ddp_hook`` runs the hook's collectives on a process group of its own, made with
``torch.distributed.new_group`` over the DDP group's ranks (same order, same backend, same time-out), never on
DDP's group: DDP issues collectives of its own there during backward (with ``find_unused_parameters=True``,
the allreduce of its used-parameter map once the last bucket is ready, from the autograd thread) while the
thread may still be exchanging earlier buckets, and two threads issuing on one group interleave differently
on different ranks (a hang until the time-out). ``new_group`` must be entered by every process of the job,
so ``register_ddp_hook`` must be called on every rank, in the same order relative to other ``new_group``
calls (for a DDP group over only some of the processes, by every rank of that group). With NCCL the group is
one more NCCL communicator over the same devices (this path is not covered by the tests, which run on gloo).
Pass ``process_group=`` to choose the group yourself (DDP's own is refused with ``find_unused_parameters``).

CUDA / NCCL. The hook records the autograd thread's current CUDA stream with the job; the thread runs the
job's kernels on that same stream (``torch.cuda.stream``), so they are ordered after the kernels that
produced the gradients, and NCCL's own stream waits on it as usual. The future is created with the bucket's
device (``Future(devices=[...])``): ``set_result`` records an event on that stream and DDP's wait makes its
stream wait on it. The host-side overlap is the same as on gloo; ``DistTransport`` times NCCL collectives with
CUDA events and never synchronises the device.

The thread is a daemon and is stopped when the state is garbage-collected or ``state.close()`` is called.

(No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at registration and
wants the real ``dist.GradBucket`` / ``torch.futures.Future`` objects, not strings.)
"""

import contextlib
import hashlib
import math
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradcomp.compressors.base import Compressor, Slot
from gradcomp.compressors.dense import BFloat16, Float16, NoCompression
from gradcomp.compressors.state import plain_name
from gradcomp.errors import CommunicationError, ConfigError, WorkerLostError
from gradcomp.finite import check_nonfinite, check_scaler, loss_scale
from gradcomp.schemes.base import Scheme
from gradcomp.schemes.single_round import SingleRound
from gradcomp.train.aggregator import GradientAggregator
from gradcomp.train.agreement import agreed_non_finite
from gradcomp.train.comm_thread import CLOSED, HOOK_REMEDY, _CommThread, _Job, _refusal, group_timeout, wait_bound
from gradcomp.train.exchange import GradientExchange, warn_float64
from gradcomp.transport.base import PAYLOAD
from gradcomp.transport.dist import DistTransport
from gradcomp.wire.bits import host_path

GRANULARITIES = ("layer", "bucket")
DEFAULT_MIN_COMPRESSION_RATE = 2.0


def sends_directly(scheme: Scheme) -> bool:
    """Whether the hook all-reduces a bucket itself, without the thread's exchange (fp32, fp16 or bf16 by
    allreduce, no error feedback: ``CompressionHookState._direct``); ``gradcomp plan`` times that path for such a
    scheme."""
    return (isinstance(scheme, SingleRound) and type(scheme.compressor) in (NoCompression, Float16, BFloat16)
            and scheme.topology == "allreduce")


def direct_message(flat: Tensor, compressor: Compressor, world: int, mark: bool = True) -> tuple[Tensor, Tensor | None]:
    """The direct path's message (``CompressionHookState._direct``) of a bucket's fp32 values ``flat``: ``flat``
    itself (``none``, divided in place) or its saturating cast (``fp16``, ``bf16``), divided by ``world``, with this
    rank's finiteness folded into its first entry (``total - total`` added: +0, or NaN when an entry is not finite
    or their sum overflows); and ``total``, the sum it came from (None for an empty bucket). ``gradcomp plan``
    times the same operations. ``mark=False`` (``none`` whose verdict is handed on, not read): no mark and no sum,
    since an fp32 message carries its NaN and Inf entries into every rank's sum by itself (a cast would saturate an
    Inf: fp16 and bf16 are always marked)."""
    if not mark and compressor.dtype == torch.float32:
        return flat.div_(world), None
    total = None
    if compressor.dtype != torch.float32:  # the message is the cast: its mark comes from the fp32 values
        total = flat.sum() if flat.numel() else None
        flat = flat.to(compressor.dtype).clamp_(-compressor.limit, compressor.limit)
    flat.div_(world)
    if flat.numel():
        total = flat.sum() if total is None else total
        flat[:1].add_((total - total).to(flat.dtype))
    return flat, total


def _unwrap(future: torch.futures.Future) -> Tensor:
    return future.value()


def _direct_not_finite(
    flat: Tensor, total: Tensor | None, index: int, read_here: bool, pass_reads: list[tuple[Tensor, Tensor, int]]
) -> list[str] | None:
    """The direct path's verdict on a reduced bucket, read in its ``done``: None when every rank's buckets were
    finite, else this rank's buckets that were not (named ``bucket <index>``). ``read_here`` (the host path, read
    on): this bucket's reduced first entry; ``pass_reads`` (the device path's last bucket of a pass): every bucket's
    reduced first entry of the pass, in one transfer, and the sums their marks came from only when one is not."""
    if read_here and not math.isfinite(float(flat[0])):
        return [f"bucket {index}"] if not math.isfinite(float(total)) else []
    if pass_reads:  # the pass's one read: every bucket's reduced first entry
        firsts = torch.cat([reduced[:1] for reduced, _, _ in pass_reads])
        if not bool(torch.isfinite(firsts).all()):
            sums = torch.isfinite(torch.stack([t for _, t, _ in pass_reads])).tolist()
            return [f"bucket {i}" for (_, _, i), ok in zip(pass_reads, sums) if not ok]
    return None


class CompressionHookState:
    def __init__(
        self,
        method: Compressor | Scheme,
        process_group: dist.ProcessGroup | None = None,
        *,
        topology: str = "auto",
        server_compressor: Compressor | None = None,
        named_parameters: Sequence[tuple[str, nn.Parameter]] | None = None,
        granularity: str = "layer",
        min_compression_rate: float | None = DEFAULT_MIN_COMPRESSION_RATE,
        scaler: torch.amp.GradScaler | None = None,
        nonfinite: str = "propagate",
        dense_steps: int = 0,
    ):
        if granularity not in GRANULARITIES:
            raise ConfigError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        check_nonfinite(nonfinite, "register_ddp_hook")
        check_scaler(scaler, "register_ddp_hook")
        if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 0:
            raise ConfigError(f"dense_steps must be a whole number >= 0, got {dense_steps!r}")
        self.exchange = GradientExchange(
            method,
            DistTransport(process_group),
            topology=topology,
            server_compressor=server_compressor,
            min_compression_rate=min_compression_rate,
        )
        self.granularity = granularity
        # (a compiled module's names without torch.compile's "_orig_mod.": the slots of the module itself)
        named_parameters = [(plain_name(name), p) for name, p in (named_parameters or [])]
        named = [(name, p) for name, p in named_parameters if p.requires_grad]
        # the slots GradientAggregator gives these parameters, by parameter identity
        self.param_slots: dict[int, Slot] = {
            id(p): slot for (_, p), slot in zip(named, GradientAggregator.slots_for(named, "layer"))
        }
        # Parameters frozen when the hook is registered but maybe not when DDP wrapped the model (a backbone frozen
        # after wrapping: DDP's buckets still hold it): slots of their own, numbered after the others, so that the
        # others' slots (and with them shared randomness and saved states) are those GradientAggregator gives.
        frozen = [(name, p) for name, p in named_parameters if not p.requires_grad]
        for i, (name, p) in enumerate(frozen, start=len(named)):
            self.param_slots[id(p)] = Slot(name, i, p.numel(), tuple(p.shape))
        self.step = 0
        self.bucket_sizes: dict[int, int] = {}  # bucket index → elements, as of the latest complete pass
        # the first dense_steps backward passes go through an uncompressed fp32 all-reduce (as GradientAggregator's
        # dense_steps, torch PowerSGD's start_iter); the method's exchange, and its state, start at the pass after
        self.dense_steps = dense_steps
        self._dense = GradientExchange(NoCompression(), self.exchange.transport) if dense_steps else None
        self._active = self._dense or self.exchange  # this pass's exchange (set at each pass's first bucket)
        # uncompressed fp32 by allreduce: one collective per bucket, issued from the hook (see ``_direct``)
        self.direct = sends_directly(self._active.scheme)
        self._counter_lock = threading.Lock()  # the direct path books bytes here and seconds on gloo's thread
        timeout = wait_bound(group_timeout(process_group, self.exchange.transport.device))
        self._worker = _CommThread(self._active, timeout, scaler, propagate=nonfinite == "propagate")
        self._finalizer = weakref.finalize(self, self._worker.stop)
        self._finalizer.atexit = False  # never join at exit: a daemon thread may sit in a dead collective
        self._layouts: dict[tuple, tuple[list[Slot], list[str]]] = {}
        self._pass_slots: list[Slot] = []
        self._pass_sizes: dict[int, int] = {}
        self._direct_pass: list[tuple[Tensor, Tensor, int]] = []  # ``none`` on the device path: read at the last bucket

    @property
    def transport(self) -> DistTransport:
        return self.exchange.transport  # type: ignore[return-value]

    @property
    def scheme(self) -> Scheme:
        return self.exchange.scheme

    @property
    def failure(self) -> BaseException | None:
        """The first error raised on the communication thread (the original exception), or None."""
        return self._worker.failure

    # -- the hook's side (autograd thread) ------------------------------------------------------------------

    def _layout(self, bucket: dist.GradBucket, params: list[Tensor], buffer: Tensor) -> tuple[list[Slot], list[str]]:
        """This bucket's slots and its parameters' names (cached per bucket index and parameter list)."""
        key = (bucket.index(), tuple(id(p) for p in params))
        if key not in self._layouts:
            per_param = [
                self.param_slots.get(id(p), Slot(f"bucket{bucket.index()}[{i}]", -1 - i, p.numel(), tuple(p.shape)))
                for i, p in enumerate(params)
            ]
            names = [s.name for s in per_param]
            if self.granularity == "layer":
                unknown = [s.name for s in per_param if s.index < 0]
                if unknown:
                    raise ConfigError(
                        f"DDP bucket {bucket.index()} holds parameters that are not the wrapped module's "
                        f"({', '.join(unknown)}): register the hook with register_ddp_hook(ddp_model, ...) on the "
                        "DistributedDataParallel that owns them"
                    )
                slots = per_param
            else:
                digest = hashlib.blake2b(",".join(f"{s.name}:{s.numel}" for s in per_param).encode(), digest_size=4)
                slots = [Slot(f"bucket{bucket.index()}:{digest.hexdigest()}", bucket.index(), buffer.numel())]
            self.scheme.check_slots(slots)
            self._layouts[key] = (slots, names)
        return self._layouts[key]

    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self._worker.closed:
            raise CommunicationError(CLOSED)
        if bucket.index() == 0:  # DDP hands buckets over in index order: a new backward pass
            self._pass_slots, self._pass_sizes, self._direct_pass = [], {}, []
            self._worker.take_pass_error()  # (one a pass that ended in another error left unraised)
            if self._dense is not None:
                self._begin_pass()
        if bucket.is_last() and not self._worker.propagate:
            self._raise_at_the_end()
        buffer = bucket.buffer()
        if self.direct:  # finiteness rides on the allreduce itself (see ``_direct``)
            slots, names = [], []
        else:  # checked on the thread: nothing here waits for the device
            try:
                slots, names = self._layout(bucket, bucket.parameters(), buffer)
            except BaseException:
                self._pass_slots, self._pass_sizes = [], {}
                self._worker.wait_idle()  # nothing of this hook is in flight when backward raises
                raise
        self._pass_sizes[bucket.index()] = buffer.numel()
        if self.direct:  # keeps no per-slot state: nothing to retain
            step = self.step
            if bucket.is_last():
                self.step += 1
                self.bucket_sizes = self._pass_sizes
                self._pass_sizes = {}
            return self._direct(buffer, step, bucket.index(), bucket.is_last())
        self._pass_slots.extend(slots)
        device = buffer.device
        on_cuda = device.type == "cuda"
        future: torch.futures.Future = torch.futures.Future(devices=[device]) if on_cuda else torch.futures.Future()
        # DDP reads the future's value in C++: an exception stored by set_exception would reach the user as
        # "Unable to cast ... to Tensor". Chained, the error is a real one that names the original exception.
        chained = future.then(_unwrap)
        job = _Job(
            slots=slots,
            tensors=bucket.gradients() if self.granularity == "layer" else [buffer],
            buffer=buffer,
            step=self.step,
            future=future,
            retain=list(self._pass_slots) if bucket.is_last() else None,
            stream=torch.cuda.current_stream(device) if on_cuda else None,
            first=bucket.index() == 0,
            names=names,
            grads=bucket.gradients() if self.granularity == "bucket" else None,
        )
        if bucket.is_last():
            self.step += 1
            self.bucket_sizes = self._pass_sizes
            self._pass_slots, self._pass_sizes = [], {}
        # last: once the thread is woken it competes for the GIL, and any call here that released the GIL
        # (torch ops, Future.then) would hand it over and wait to get it back
        self._worker.submit(job)
        return chained

    def _begin_pass(self) -> None:
        """With dense steps: this pass's exchange, dense fp32 before step ``dense_steps``, the method's from then on.
        Safe to switch here: DDP handed over this pass's first bucket, so it has waited for every future of the
        last pass, and the thread has finished that pass's jobs."""
        self._active = self._dense if self.step < self.dense_steps else self.exchange
        self._worker.exchange = self._active
        self.direct = sends_directly(self._active.scheme)

    def _raise_at_the_end(self) -> None:
        """``nonfinite="raise"``: the pass's agreed NonFiniteGradientError is raised from ``backward`` itself, the
        typed error on every rank, once DDP has finished the pass (every bucket's future completed, with NaN where
        the pass was found bad, so that DDP's reducer ends the pass cleanly and the next backward works). A future
        completed with the error instead would reach the user as DDP's RuntimeError naming it, and leave DDP's
        reducer mid-pass. DDP queues its own end of the pass with the autograd engine after this last bucket's hook
        returns; a callback queued here runs before it, so it queues the check, which the engine then runs after
        DDP's (callbacks queued while the engine runs its callbacks run after those already queued)."""
        engine = torch.autograd.Variable._execution_engine
        worker = self._worker  # (not self: the engine holds the callbacks only until the pass ends)

        def check() -> None:
            error = worker.take_pass_error()
            if error is not None:
                raise error

        engine.queue_callback(lambda: engine.queue_callback(check))

    def _direct(self, buffer: Tensor, step: int, index: int, last: bool = True) -> torch.futures.Future:
        """``none``, ``fp16``, ``bf16``: the bucket buffer *is* its parameters' gradients back to back, so the
        scheme's message is the buffer itself (``none``) or its cast (the cast of the concatenation is the
        concatenation of the slots' casts: an elementwise, stateless compressor).

        ``none``: divided by W in place and all-reduced in place, asynchronously, straight from the hook, as torch's
        own allreduce does: the same bytes and the same average as the scheme, without a copy or a hop
        through the communication thread for the collective (the thread never issues one for this state, so the
        order of collectives is still DDP's bucket order on every rank). A buffer that is not fp32 is sent as fp32,
        like the scheme. ``fp16`` / ``bf16``, as torch's fp16 hook: the buffer (divided by the scaler's scale first,
        as the thread does) cast with the compressor's saturation, divided by W, all-reduced, and written back
        (times the scale): the scheme's bytes and average, in a handful of operations on the autograd thread
        instead of the thread's exchange.

        Finiteness rides on the allreduce without a byte more and without a host read here: the first entry gets
        ``total - total`` added (total: the buffer's sum), which is 0 when every entry is finite and NaN when one
        is not (or their sum overflows), so every rank's reduced first entry is NaN when any rank's bucket held a
        NaN / Inf. With a scaler (or ``nonfinite="propagate"``) nothing reads it: the NaN left in every rank's
        gradients is the verdict (``scaler.step``, or the user's check, skips the step on every rank, from its own
        read); ``none``'s fp32 message is then not even marked, its NaN / Inf entries reaching every rank's sum by
        themselves. Without one the reduced first entry is
        read and a NaN raises NonFiniteGradientError on every rank. Where that read happens matters on a GPU:
        NCCL completes a collective's future as soon as it has enqueued it, so a callback chained to it runs at
        once on the calling thread, here the autograd thread, and a read there would make backward wait for the
        device at every bucket. On the device path the read is therefore the communication thread's, once per
        backward pass: the last bucket's all-reduce is handed to the thread (a job that waits for it and reads every
        bucket's reduced first entry in one transfer) before its future, which DDP waits for at the end of backward,
        is completed; the other buckets' callbacks read nothing. On the host path (gloo) the read stays in each
        collective's callback, which gloo runs on its own thread once the allreduce is done.
        """
        transport = self.transport
        failure = self._worker.failure
        # (a bucket of this pass found not finite is no failure: the pass's other buckets are still all-reduced, so
        # that the ranks' collectives stay matched, and every rank raises at the pass's end.) A failure: the
        # sequences may no longer agree, nothing more is sent.
        if failure is not None:
            raise _refusal(failure, "an earlier exchange of this DDP hook failed")
        flat, total, scale = self._direct_message(buffer)
        work, started = self._all_reduce_direct(flat)
        read = not self._worker.propagate and flat.numel() > 0
        device_path = not host_path(flat)
        if read and device_path:
            self._direct_pass.append((flat, total, index))
        pass_reads = self._direct_pass if last else []

        def done(future: torch.futures.Future) -> Tensor:
            try:
                future.value()
            except RuntimeError as exc:
                lost = WorkerLostError(
                    f"rank {transport.rank}: all_reduce over {transport.backend} failed; a worker disappeared "
                    f"or did not answer within the process group's time-out ({exc})"
                )
                self._worker.fail(lost)
                raise lost from exc
            with self._counter_lock:
                transport.counter.seconds += time.perf_counter() - started
            here = _direct_not_finite(flat, total, index, read and not device_path, pass_reads)
            if here is not None:  # every rank's verdict: NaN in its gradients, raised at the pass's end
                self._worker.refuse_pass(agreed_non_finite(step, here, remedy=HOOK_REMEDY))
                buffer.fill_(float("nan"))
                return buffer
            if flat is not buffer:
                buffer.copy_(flat)
            if scale is not None:
                buffer.mul_(scale)  # back in the scaler's units
            return buffer

        if not pass_reads:  # no read in ``done``: a callback, wherever it runs, waits for nothing
            return work.get_future().then(done)
        return self._read_on_the_thread(work, done, buffer, step)

    def _direct_message(self, buffer: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The direct path's message of a bucket's ``buffer`` (``direct_message``, from its values in fp32, divided
        by the scaler's scale for fp16 / bf16, as the thread's exchange divides them), the sum its mark came from,
        and the scale to multiply the average back by (None: none)."""
        compressor = self._active.scheme.compressor
        flat = buffer if buffer.dtype == torch.float32 else buffer.to(torch.float32)
        scale = None if compressor.dtype == torch.float32 else loss_scale(self._worker.scaler)
        if scale is not None:
            flat.div_(scale)  # unscaled gradients, as the thread's exchange sees them (a power of 2: exact)
        flat, total = direct_message(flat, compressor, self.transport.world_size, mark=not self._worker.propagate)
        return flat, total, scale

    def _all_reduce_direct(self, flat: Tensor) -> tuple[Any, float]:
        """The direct path's collective: ``flat`` all-reduced (summed) in place on the hook's group, asynchronously,
        its bytes booked as the scheme books them (under the counter's lock: gloo's thread adds the seconds).
        Returns the collective's work and the clock it started at."""
        transport = self.transport
        started = time.perf_counter()
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=transport.group, async_op=True)
        with self._counter_lock:
            transport.counter.book(PAYLOAD, up=flat.nbytes, down=flat.nbytes)
            transport.counter.record("all_reduce", flat.nbytes)
            transport.counter.collectives += 1
        return work, started

    def _read_on_the_thread(self, work: Any, done: Any, buffer: Tensor, step: int) -> torch.futures.Future:
        """The device path's last bucket of a pass: its all-reduce handed to the communication thread, as a job that
        waits for it and runs ``done`` (the pass's one read), so that the autograd thread never waits for the
        device; DDP gets the job's future, completed with ``buffer`` or with the job's error."""
        device = buffer.device
        on_cuda = device.type == "cuda"
        future: torch.futures.Future = torch.futures.Future(devices=[device]) if on_cuda else torch.futures.Future()

        def finish() -> None:
            work.wait()  # on NCCL: the job's stream (the autograd thread's) waits for the allreduce; no host wait
            done(work.get_future())

        stream = torch.cuda.current_stream(device) if on_cuda else None
        self._worker.submit(_Job([], [], buffer, step, future, None, stream=stream, finish=finish))
        return future.then(_unwrap)

    # -- checkpoints and shutdown ---------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Block until every bucket handed to the thread has been exchanged; CommunicationError after ``timeout``
        seconds (default: the process group's time-out and a margin)."""
        self._worker.wait_idle(timeout)

    def state_dict(self) -> dict:
        self.wait()
        return {"step": self.step, "exchange": self.exchange.state_dict(), **self.exchange.identity(self._slots())}

    def load_state_dict(self, state: dict) -> None:
        """ConfigError, and nothing loaded, for a state saved by another method or for other parameters."""
        self.wait()
        self.exchange.check_saved(state, ("step", "exchange"), self._slots(), "CompressionHookState")
        self.exchange.load_state_dict(state["exchange"])
        self.step = int(state["step"])

    def _slots(self) -> list[Slot]:
        """Every parameter's slot, in the model's order (a state's identity; buckets do not change it)."""
        return list(self.param_slots.values())

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued buckets and stop the communication thread (the hook then refuses new ones).

        Waits at most ``timeout`` seconds (default: the process group's time-out and a margin); returns whether
        the thread ended in time. If not, the buckets it had not started fail, and the thread (a daemon, in a
        collective) is left to end by itself.
        """
        self._finalizer.detach()
        return self._worker.stop(timeout)


def compression_hook(state: "CompressionHookState", bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    return state.submit(bucket)


def _own_group(model: nn.parallel.DistributedDataParallel) -> dist.ProcessGroup:
    """A new process group over the DDP group's ranks (in its order), with its backend and time-out.

    Every rank of the DDP group must call this, in the same order as its other ``new_group`` calls: when the
    DDP group spans the whole job, that is every process (torch's rule for ``new_group``); for a DDP group
    over some of the processes only its members take part (``use_local_synchronization``).
    """
    group = model.process_group
    ranks = dist.get_process_group_ranks(group)
    timeout = None  # torch's default for the backend, when the DDP group's own cannot be read
    with contextlib.suppress(Exception):  # not a public API: the group's backend options on the model's device
        device = next(model.module.parameters()).device
        timeout = group._get_backend(device).options._timeout
    kwargs: dict[str, Any] = {"timeout": timeout, "backend": dist.get_backend(group)}
    if ranks != sorted(ranks):
        kwargs["sort_ranks"] = False  # keep every rank's index: the hook's rank r is DDP's rank r
    if len(ranks) < dist.get_world_size():
        kwargs["use_local_synchronization"] = True
    return dist.new_group(ranks, **kwargs)


def _ddp_model(model: Any) -> nn.parallel.DistributedDataParallel:
    """The DDP model to register the hook on: ``model`` itself, or the DDP model inside ``torch.compile(DDP(model))``;
    ConfigError for anything else."""
    compiled = getattr(model, "_orig_mod", None)  # torch.compile(DDP(model)): the hook goes on the DDP model inside
    if isinstance(compiled, nn.parallel.DistributedDataParallel):
        model = compiled
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise ConfigError(
            f"register_ddp_hook takes a torch.nn.parallel.DistributedDataParallel model, got {type(model).__name__}; "
            "wrap it first (DistributedDataParallel(model)), or call gradcomp.GradientAggregator(model, ...).step() "
            "after backward instead"
        )
    return model


def _check_hookable(model: nn.parallel.DistributedDataParallel, process_group: dist.ProcessGroup | None) -> None:
    """ConfigError, before anything is registered, for a DDP model the hook cannot serve: one with a communication
    hook already, one running torch's per-parameter Python reducer, ``process_group`` that is DDP's own group under
    ``find_unused_parameters``, or parameters with sparse gradients."""
    if getattr(model, "_comm_hooks", None):
        raise ConfigError(
            "register_ddp_hook: this DDP model has a communication hook already (torch allows one per model; "
            "DDP(mixed_precision=...) registers one of its own, so leave that option out and let the method send "
            "what it sends); wrap the module in a new DistributedDataParallel to register another. Nothing was "
            "registered"
        )
    if getattr(model, "_use_python_reducer", False):
        raise ConfigError(
            "register_ddp_hook: this DDP model runs torch's Python reducer (torch._dynamo.config.optimize_ddp = "
            "'python_reducer', for compiled autograd), which calls a communication hook per parameter, not per "
            "bucket; gradcomp's hook compresses buckets: use optimize_ddp's default ('ddp_optimizer'), or "
            "gradcomp.GradientAggregator. Nothing was registered"
        )
    if process_group is not None and process_group is model.process_group and model.find_unused_parameters:
        raise ConfigError(
            "register_ddp_hook: process_group is the DDP model's own group, on which DDP(find_unused_parameters="
            "True) issues collectives of its own during backward, in an order that differs from the hook's "
            "between ranks (the job hangs); leave process_group out (the hook then makes a group of its own)"
        )
    ignored = getattr(model, "parameters_to_ignore", set())
    sparse = [
        f"{prefix}.weight" if prefix else "weight"
        for prefix, module in model.module.named_modules()
        if getattr(module, "sparse", False) is True and isinstance(getattr(module, "weight", None), nn.Parameter)
        and (f"{prefix}.weight" if prefix else "weight") not in ignored
    ]
    if sparse:  # (DDP all-reduces them as sparse tensors; a bucket of them has no dense buffer to compress)
        raise ConfigError(
            f"register_ddp_hook: {', '.join(sparse)} get sparse gradients (sparse=True), which gradcomp does not "
            "compress: build the module with sparse=False, or keep it out of DDP "
            "(DistributedDataParallel._set_params_and_buffers_to_ignore_for_model) and average its gradient yourself"
        )


def register_ddp_hook(
    model: nn.parallel.DistributedDataParallel,
    method: Compressor | Scheme,
    *,
    topology: str = "auto",
    server_compressor: Compressor | None = None,
    granularity: str = "layer",
    min_compression_rate: float | None = DEFAULT_MIN_COMPRESSION_RATE,
    process_group: dist.ProcessGroup | None = None,
    scaler: torch.amp.GradScaler | None = None,
    nonfinite: str = "propagate",
    dense_steps: int = 0,
) -> CompressionHookState:
    """Register gradcomp's hook on a DDP model; returns the state (checkpoint it with ``state_dict()``).

    The hook's collectives run on a process group of their own, not on DDP's (``process_group``, by default a
    new group over the DDP group's ranks, made here with ``torch.distributed.new_group``): DDP issues
    collectives of its own on its group during backward (with ``find_unused_parameters=True``, an allreduce
    of the used-parameter map after the last bucket) from the autograd thread, while the hook's thread may
    still be exchanging earlier buckets; on one group the two sequences would interleave differently on
    different ranks and the job would hang. Hence, like ``new_group``, this must be called on every rank of
    the job (every rank of the DDP group when that group is a subgroup), in the same order.

    ``nonfinite``: what a NaN / Inf gradient on some rank does (the module docstring, "Non-finite").
    ``"propagate"`` (default, torch's hooks' behaviour): nothing raises; the step's gradients hold NaN on every
    rank, identically (as with torch's own DDP, and as with ``scaler=``, which implies it), the method's state is
    put back as it was before the pass, and a check of your own decides: an unchanged GradScaler loop skips the
    step (``scaler.step`` sees the NaN) and lowers its scale, ``clip_grad_norm_(..., error_if_nonfinite=True)``
    raises, a finite-loss test skips. For the methods that only all-reduce (none, fp16, bf16, random-k, random
    block, PowerSGD, sketched SGD, true top-k) the hook then reads nothing from the GPU in a step; the others
    still read their verdict with their message checks. ``scaler=`` adds unscaling before compression (error
    feedback and momentum in unscaled units). ``"raise"``: every rank raises the same
    ``gradcomp.NonFiniteGradientError`` from ``backward`` (catch it there: ``except
    gradcomp.NonFiniteGradientError``), after DDP has finished the pass, with the method's state as before it and
    NaN in the gradients; the next backward works as usual. On a GPU that costs one read of the agreed verdict
    per backward pass.

    ``dense_steps``: the first N backward passes all-reduce the gradients in fp32, uncompressed and counted like
    the rest (torch PowerSGD's ``start_iter``, DGC's warm-up); the method starts at pass N with its state empty,
    its step numbers the run's. The state's ``state_dict`` is the method's throughout.
    """
    model = _ddp_model(model)
    _check_hookable(model, process_group)
    warn_float64(list(model.module.named_parameters()), "register_ddp_hook")
    state = CompressionHookState(
        method,
        process_group if process_group is not None else _own_group(model),
        topology=topology,
        server_compressor=server_compressor,
        named_parameters=list(model.module.named_parameters()),
        granularity=granularity,
        min_compression_rate=min_compression_rate,
        scaler=scaler,
        nonfinite=nonfinite,
        dense_steps=dense_steps,
    )
    model.register_comm_hook(state, compression_hook)
    return state
