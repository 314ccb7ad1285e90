"""Counting the operations that would make a GPU wait, on the CPU (tests/test_sync_count.py, scripts/gpu_check.sh).

On a GPU the host waits for the device whenever it reads a value the device computed: ``.item()`` (and ``int()``,
``float()``, ``bool()`` of a tensor), ``.tolist()``, ``.numpy()``, ``.cpu()`` / ``.to("cpu")``, and the operations
whose output size depends on the data (``nonzero``, ``masked_select``, ``unique``, indexing with a boolean mask).
On the CPU none of them waits, so they are counted instead: every tensor is treated as if it lived on a device.

Two mechanisms, because not everything goes through torch's dispatcher:
- a ``TorchDispatchMode`` sees the aten operations (``_local_scalar_dense`` is what ``.item()`` / ``int()`` /
  ``bool()`` dispatch; ``nonzero``, ``masked_select``, the ``unique`` family; ``index.Tensor`` and ``index_put_``
  with a boolean index; ``index_put_`` of a Python number, ``t[positions] = 0.0``, whose value torch makes a host
  tensor that a GPU copies over and waits for, as an H200 showed: ``index_fill_`` takes the number itself). A
  dispatch mode is thread-local: :func:`counting` enters it on the calling thread and,
  through :func:`count_on_this_thread`, on any other thread that the code under test runs (the DDP hook's
  communication thread);
- ``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu`` and ``Tensor.to("cpu")`` do not dispatch (or are no-ops on
  CPU tensors) and are wrapped while counting. ``.to(device)`` with a ``torch.device`` is not counted: the library
  passes the device of its own data, which is no transfer on a GPU either. ``Tensor.item`` and the conversions
  ``float()``, ``int()``, ``bool()`` are wrapped too, so that they count on every thread, including threads the
  test cannot enter the mode on (a collective's completion callback, which gloo runs on its own thread unless
  the collective had completed already); a wrapped call is counted once, not again by the mode.

The wire code's device path is forced on CPU tensors (tests/wire_paths.py) and the compiled CPU kernels
are switched off (``GRADCOMP_KERNELS=0``), so that what runs is what runs on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SIZE_FROM_DATA = {
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.unique_dim_consecutive.default: "unique",
}


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Mode(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record
        self.lifted = None  # the last Python number made a tensor (``t[i] = 0.0`` makes one, on the host)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is aten.lift_fresh:
            self.lifted = func(*args, **kwargs)
            return self.lifted
        if packet is aten._local_scalar_dense:
            self.record("item")
        elif func in _SIZE_FROM_DATA:
            self.record(_SIZE_FROM_DATA[func])
        elif packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_) and _bool_index(
            args[1] if len(args) > 1 else kwargs.get("indices")
        ):
            self.record("bool-index")
        elif packet is aten.index_put_ and self.lifted is not None and len(args) > 2 and args[2] is self.lifted:
            self.record("host-scalar-put")  # t[positions] = 0.0: on a GPU the 0 is copied there and the host waits
        return func(*args, **kwargs)


class SyncCounter:
    """What was counted, by kind, and where (the first few call sites of each kind, for the failure message)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.sites: dict[str, list[str]] = {}
        self.threads: Counter = Counter()  # reads by the thread that made them (threading.get_ident())
        self._lock = threading.Lock()
        self._busy = threading.local()  # inside a wrapper: what it calls is not counted again

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, kind: str) -> None:
        if getattr(self._busy, "on", False):
            return
        import traceback

        frames = [f for f in traceback.extract_stack()[:-2] if "sync_counting" not in f.filename]
        ours = [f for f in reversed(frames) if "/gradcomp/" in f.filename]
        site = f"{ours[0].filename.split('/src/')[-1]}:{ours[0].lineno} {ours[0].name}" if ours else "?"
        with self._lock:
            self.counts[kind] += 1
            self.sites.setdefault(kind, []).append(site)
            self.threads[threading.get_ident()] += 1

    def __str__(self) -> str:
        parts = []
        for kind, n in sorted(self.counts.items()):
            sites = Counter(self.sites.get(kind, []))
            parts.append(f"{kind} x{n} ({'; '.join(f'{s} x{c}' for s, c in sites.most_common(6))})")
        return ", ".join(parts) or "none"


_active: list[SyncCounter] = []  # the counter being filled (at most one)


def count_on_this_thread(fn):
    """Wraps ``fn`` so that, while :func:`counting` is active, it runs under the counting dispatch mode."""

    def wrapped(*args, **kwargs):
        if not _active:
            return fn(*args, **kwargs)
        with _Mode(_active[0].record):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def counting():
    """Counts would-be synchronisations on this thread (and threads run through count_on_this_thread)."""
    counter = SyncCounter()
    scalars = ("item", "__float__", "__int__", "__bool__")
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "to", *scalars)}
    own = {name for name in originals if name in vars(torch.Tensor)}  # the others are inherited: deleted after

    def plain(name, kind):
        original = originals[name]

        def wrapper(self, *args, **kwargs):
            counter.record(kind)
            counter._busy.on = True
            try:
                return original(self, *args, **kwargs)
            finally:
                counter._busy.on = False

        return wrapper

    def to(self, *args, **kwargs):
        # Only an explicit "cpu" counts: library code moves tensors to a torch.device taken from its data (the
        # tensor's own device on a GPU too, a no-op there), which on the CPU would look like a copy to the host.
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str) and torch.device(target).type == "cpu":
            counter.record("cpu")
        return originals["to"](self, *args, **kwargs)

    for name in scalars:
        setattr(torch.Tensor, name, plain(name, "item"))
    torch.Tensor.tolist = plain("tolist", "tolist")
    torch.Tensor.numpy = plain("numpy", "numpy")
    torch.Tensor.cpu = plain("cpu", "cpu")
    torch.Tensor.to = to
    _active.append(counter)
    try:
        with _Mode(counter.record):
            yield counter
    finally:
        _active.clear()
        for name, fn in originals.items():
            if name in own:
                setattr(torch.Tensor, name, fn)
            else:
                delattr(torch.Tensor, name)
