"""Decoding where the message is: the device path's checks, read back together, and the backward pass that holds them.

On a GPU every read back is a host synchronisation, so a device buffer whose layout is fixed (by its specs, or by a
size exchange's values) is decoded where it lies and every check is computed there (``_decode_on_device``): the
checksum, the header and section bytes its layout implies, padding bits, positions' order and range, a Golomb stream's
code structure. What the host must compare comes back in one small transfer, with the checks of other messages
(:class:`DeviceChecks`) and, in a DDP backward pass, with every bucket's (:func:`hold_for_the_pass`). A message whose
layout depends on its data comes to the host once for its headers (:func:`fetch_together` brings several in one
transfer). A failed check is named by the host path (``container.decode``), which says what is wrong.

The sender's checks of device-path encodes (BITS ranges, POSITIONS order) are kept here too, read with the next
device read (:func:`check_pending`).

The state is the thread's ``gradcomp.step_state.StepState``, shared with the refusal protocol.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from gradcomp.errors import ConfigError, WireError
from gradcomp.step_state import setting, step_state
from gradcomp.wire.bits import _as_uint8_buffer, _unpack, decoded_dtype, host_path, ints_on
from gradcomp.wire.checksum import checksum64_tensor, to_host
from gradcomp.wire.format import (
    _HEADER,
    _SECTION,
    FLOAT_DTYPES,
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    SECTION_HEADER_BYTES,
    Codec,
    FieldSpec,
    _check_specs,
    _fixed_layout,
    _received_positions,
)
from gradcomp.wire.golomb import golomb_decode
from gradcomp.wire.refusals import (
    StepAbandoned,
    _read_bytes,
    _refuse,
    collecting_received,
    take_verdict,
    verdict_pending,
)

__all__ = [
    "DeviceChecks",
    "check_pending",
    "fetch_together",
    "holding_for_the_pass",
    "held_for_the_pass",
    "hold_for_the_pass",
]

_PENDING_LIMIT = 256


def _defer(flags: list) -> None:
    checks = step_state().sender_checks
    checks.extend(flags)
    if len(checks) >= _PENDING_LIMIT:
        check_pending()


def _take_pending() -> list:
    state = step_state()
    checks, state.sender_checks = state.sender_checks, []
    return checks


def _raise_failed(checks: list, values) -> None:
    for (_, message), ok in zip(checks, values):
        if not ok:
            raise ConfigError(f"a message encoded on the device: {message}")


def check_pending() -> None:
    """Reads this thread's outstanding device-path encode checks (one transfer) and raises ConfigError if one failed."""
    checks = _take_pending()
    if checks:
        flags = torch.stack([f.reshape(()).to(torch.bool) for f, _ in checks]).to(torch.uint8)
        _raise_failed(checks, _read_bytes(flags))


@contextlib.contextmanager
def fetch_together(messages: Sequence[tuple[torch.Tensor, Sequence[FieldSpec]]]):
    """While inside, :func:`decode` of any of the ``messages``' buffers (device buffers, each with its specs) on this
    thread takes the host copy made here: every buffer whose layout depends on the data comes to the host in ONE
    transfer, with its checksum computed on the device (and the step's deferred verdict, if one is pending:
    StepAbandoned here if it is bad), instead of one transfer per buffer. A buffer whose layout the specs fix
    needs none and is left on the device. Nothing happens on the host path. The buffers must stay alive and
    unchanged inside (they are known by their memory and length)."""
    wanted = []
    for buf, specs in messages:
        total = buf.numel()
        if host_path(buf) or total < HEADER_BYTES:
            continue
        specs = list(specs)
        fixed = _fixed_layout(specs, _check_specs(specs), total)
        if fixed is None or fixed[1] != total:
            wanted.append(_as_uint8_buffer(buf))
    hosts = dict(step_state().fetched or {})
    if len(wanted) > 1:  # (one buffer: decode makes the same single transfer itself)
        for b, (mem, computed) in zip(wanted, _fetch(wanted)):  # copies: the staging buffer is reused
            hosts[(b.data_ptr(), b.numel())] = (mem.copy(), computed)
    with setting("fetched", hosts):
        yield


def _fetched_copy(buf: torch.Tensor) -> tuple[np.ndarray, int] | None:
    """The host copy and device checksum :func:`fetch_together` made of ``buf`` on this thread, or None."""
    return (step_state().fetched or {}).get((buf.data_ptr(), buf.numel()))


def _fetch(bufs: list[torch.Tensor]) -> list[tuple[np.ndarray, int]]:
    """Device buffers to the host in ONE transfer, each with its body's checksum computed on the device, and the
    step's deferred verdict if one is pending (StepAbandoned if it is bad): per buffer (its bytes, a view of this
    thread's staging buffer valid until its next transfer; the checksum)."""
    sums = [checksum64_tensor(b[HEADER_BYTES:]).reshape(1).view(torch.uint8) for b in bufs]
    flag = take_verdict()
    verdict = [] if flag is None else [flag.reshape(1).to(torch.uint8)]
    staged = to_host(torch.cat([*bufs, *sums, *verdict])).numpy()
    if verdict and staged[-1]:
        raise StepAbandoned
    out, at, end = [], 0, sum(b.numel() for b in bufs)
    for i, b in enumerate(bufs):
        computed = int.from_bytes(staged[end + 8 * i : end + 8 * i + 8].tobytes(), "little")
        out.append((staged[at : at + b.numel()], computed))
        at += b.numel()
    return out


def _data_fault(checks: bytes) -> str | None:
    """What the data checks' bytes ``checks`` (one per check, 1: passed) say is wrong, or None."""
    return None if all(checks) else "a data check failed (padding bits, positions or a Golomb stream)"


def _decode_on_device(
    buf: torch.Tensor, specs: list, layout: list, later: DeviceChecks | None = None, diagnose=None
) -> list[torch.Tensor] | None:
    """decode's device path for a message whose layout the specs and its length fix (every count exact, at most
    one GOLOMB field, whose stream is what the length leaves over), or that a size exchange's values fix
    (:func:`layout_values`).

    Every field is decoded where the buffer is and every check is computed there: the checksum
    (checksum64_tensor), the padding bits, the positions' order and range, a Golomb stream's code structure. What
    the host must compare comes back in ONE small transfer: the 20-byte header, the computed checksum, the section
    headers and the check results (with this thread's pending sender checks of device-path encodes). Returns the
    fields when every byte is the one the specs imply and every check passed, else None: the caller then runs the
    host path, which says what is wrong.
    With ``later``, nothing is read: the summary joins ``later``, whose :meth:`DeviceChecks.read` checks it and names
    a fault with ``diagnose`` (see :meth:`DeviceChecks.add`).
    """
    flags: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    heads = []
    for spec, (off, codec, param, count, nbytes) in zip(specs, layout):
        data = buf[off : off + nbytes]
        heads.append(buf[off - SECTION_HEADER_BYTES : off])
        if codec in FLOAT_DTYPES:
            out.append(data.clone().view(FLOAT_DTYPES[codec]))
        elif codec == Codec.BITS:
            out.append(_unpack(data, param, count, decoded_dtype(param), flags))
        elif codec == Codec.GOLOMB:
            try:
                out.append(golomb_decode(data, param, count, spec.universe, flags))
            except WireError:  # a stream length the count rules out: the host path names it
                return None
        else:
            out.append(_received_positions(_unpack(data, param, count, torch.int64, flags), spec.universe, flags))
    pending = _take_pending()
    flags.extend(f for f, _ in pending)
    pieces = [buf[:HEADER_BYTES], checksum64_tensor(buf[HEADER_BYTES:]).reshape(1).view(torch.uint8), *heads]
    if flags:
        pieces.append(torch.stack([f.reshape(()).to(torch.bool) for f in flags]).to(torch.uint8))
    summary = torch.cat(pieces)
    body = layout[-1][0] + layout[-1][4] - HEADER_BYTES if layout else 0
    # the bytes a sound message's summary holds: its header's first 12, then (after the header's stored checksum
    # and the computed one) its section headers; DeviceChecks.fault_flag compares them on the device
    head_bytes = b"".join(_SECTION.pack(int(codec), param, count, nbytes) for _, codec, param, count, nbytes in layout)
    want = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(specs), 0, body, 0)[:12] + head_bytes

    def fault(got: bytes) -> str | None:
        """What is wrong with the message whose summary's bytes are ``got``, in the host path's order, or None for
        a sound one (ConfigError for a failed sender check)."""
        checks = got[HEADER_BYTES + 8 + len(head_bytes) :]
        if pending:
            _raise_failed(pending, checks[len(checks) - len(pending) :])
        if got[:12] != want[:12]:
            return "its header is not the one its layout implies (magic, version, flags, sections or length)"
        if got[12:HEADER_BYTES] != got[HEADER_BYTES : HEADER_BYTES + 8]:
            return "checksum mismatch: the message body is corrupted"
        if got[HEADER_BYTES + 8 : HEADER_BYTES + 8 + len(head_bytes)] != head_bytes:
            return "a section header is not the one its layout implies"
        return _data_fault(checks)

    if later is not None:
        later.add(summary, fault, diagnose, want)
        return out
    return out if fault(_read_bytes(summary)) is None else None  # the one read back (tens of bytes, ten per section)


class DeviceChecks:
    """The checks of several device-path decodes, read back together: one host synchronisation for all of them.

    ``decode(buf, specs, later=checks)`` of a fixed layout returns its fields at once and leaves its summary here;
    :meth:`read` then reads every summary (and any bool tensors the caller adds) in one transfer and raises the
    WireError the host path gives for the first message that failed. Until :meth:`read` has returned, the decoded
    values must not leave the caller (the aggregation sums them into temporaries and reads before returning), except
    to the DDP hook's backward pass (:func:`hold_for_the_pass`), which reads them before anything of it is applied.
    """

    def __init__(self) -> None:
        self._items: list = []
        self._received: list = []  # (bool tensor, message): checks of decoded fields made by their receivers
        self._abandon: list[torch.Tensor] = []  # held for a pass: flags that abandon the step on every worker

    def collecting(self):
        """While inside, :func:`check_received` on this thread hands its checks to this object (read with it)."""
        return collecting_received(self)

    @property
    def pending(self) -> bool:
        """Whether checks (or flags held for a pass) wait here to be read."""
        return bool(self._items or self._received or self._abandon)

    def add(self, summary: torch.Tensor, fault, diagnose, want: bytes | None) -> None:
        """Keeps a decoded message's check ``summary`` (a uint8 tensor, not read) to be read with the others:
        ``fault(bytes read)`` says what is wrong or None; ``diagnose(what)`` returns the WireError that names it (the
        host path's, where the buffer is kept), None once the buffer is let go; ``want``: the header and section
        bytes a sound message's summary holds (None for a host-read layout, whose summary is its check bytes)."""
        self._items.append((summary, fault, diagnose, want))

    def add_received(self, ok: torch.Tensor, message: str) -> None:
        """Keeps a receiver's check of a decoded field (``refusals.check_received``) to be read with the others."""
        self._received.append((ok, message))

    def abandon(self, flag: torch.Tensor) -> None:
        """Holds ``flag`` (a one-element bool tensor, True: abandon the step) to be read with the checks, as
        :func:`hold_for_the_pass` does with an aggregate's."""
        self._abandon.append(flag)

    def abandon_flag(self, device: torch.device) -> torch.Tensor:
        """Whether any flag held here says abandon, as a one-element bool tensor on ``device`` (nothing read): for
        the workers to agree on it where only this worker holds it (``train.agreement.settle``; an FSDP owner's
        aggregate of its own shard)."""
        if not self._abandon:
            return torch.zeros((), dtype=torch.bool, device=device)
        return torch.stack([f.reshape(()).to(device=device, dtype=torch.bool) for f in self._abandon]).any()

    def copy_from(self, other: DeviceChecks) -> None:
        """Adds ``other``'s pending checks and held flags to these, leaving ``other`` as it is (a simulated cluster's
        aggregate, computed once: every worker holds the checks it would have made itself)."""
        self._items += other._items
        self._received += other._received
        self._abandon += other._abandon

    def take(self, other: DeviceChecks) -> None:
        """Moves ``other``'s pending checks here, to be read with these. The messages' buffers are let go: a failed
        one is then named from its checks alone, not decoded again on the host (keeping every received buffer of a
        backward pass until its end would cost W times the pass's messages)."""
        self._items += [(summary, fault, None, want) for summary, fault, _, want in other._items]
        self._received += other._received
        other._items, other._received = [], []

    def read_after(self, verdicts: Sequence[torch.Tensor], extra: Sequence[torch.Tensor] = ()) -> tuple[bool, list]:
        """Reads the step's ``verdicts`` (one-element bool tensors, True: every worker abandons the step), the flags
        held here by :func:`hold_for_the_pass`, every pending check and ``extra`` (as :meth:`read`), in one
        transfer. ``(True, [])`` when some flag says abandon: the checks are then not looked at (an abandoned step's
        messages may carry its mark, and nothing of the step is applied). Else WireError for a failed check, or
        ``(False, the values of extra)``."""
        flags, self._abandon = [*verdicts, *self._abandon], []
        if not flags:
            return False, self.read(extra)
        verdict = torch.stack([f.reshape(()).to(flags[0].device) for f in flags]).any()
        if not self.pending and not extra:
            return bool(verdict), []
        try:
            with verdict_pending(verdict):
                return False, self.read(extra)
        except StepAbandoned:
            return True, []

    def fault_flag(self, device: torch.device) -> torch.Tensor:
        """Whether any pending check failed, as a one-element bool tensor computed where the checks are (nothing
        read): what :meth:`read` would refuse, for the workers to agree on before any of them reads
        (``train.agreement.settle``). The expected header and section bytes of every message come to the device in
        one transfer that does not make the host wait."""
        wants = [want for _, _, _, want in self._items if want is not None]
        expected = ints_on(device, list(b"".join(wants))).to(torch.uint8) if wants else None
        bad, at = [], 0
        for summary, _, _, want in self._items:
            if want is None:  # a host-read layout's data checks: one byte each, 1 passed
                bad.append((summary == 0).any())
                continue
            heads = len(want) - 12  # summary: header (20), computed checksum (8), section heads, check bytes
            got = torch.cat([summary[:12], summary[HEADER_BYTES + 8 : HEADER_BYTES + 8 + heads]])
            bad.append((got != expected[at : at + len(want)]).any()
                       | (summary[12:HEADER_BYTES] != summary[HEADER_BYTES : HEADER_BYTES + 8]).any()
                       | (summary[HEADER_BYTES + 8 + heads :] == 0).any())
            at += len(want)
        bad += [~ok.reshape(()).to(torch.bool) for ok, _ in self._received]
        if not bad:
            return torch.zeros((), dtype=torch.bool, device=device)
        return torch.stack([b.to(device) for b in bad]).any()

    def read(self, extra: Sequence[torch.Tensor] = ()) -> list[bool]:
        """Reads every pending summary, every check handed over by :func:`check_received` and ``extra`` (bool
        tensors of one element), raises WireError for the first failed message or check (inside
        :func:`refusing_later`: notes it there instead), returns the values of ``extra``."""
        items, self._items = self._items, []
        received, self._received = self._received, []
        pieces = [summary for summary, _, _, _ in items]
        flags = [ok for ok, _ in received] + list(extra)
        if flags:
            pieces.append(torch.stack([e.reshape(()).to(torch.bool) for e in flags]).to(torch.uint8))
        if not pieces:
            return []
        got = _read_bytes(torch.cat(pieces))  # (with the step's deferred verdict, if one is pending)
        at, failed = 0, None
        for summary, fault, diagnose, _ in items:
            n = summary.numel()
            wrong = fault(got[at : at + n]) if failed is None else None  # (the first failure is the one named)
            if wrong is not None:
                failed = diagnose(wrong) if diagnose is not None else WireError(
                    f"a received message failed the device's checks: {wrong}"
                )
            at += n
        for (_, message), ok in zip(received, got[at:]):
            if not ok and failed is None:
                failed = WireError(message)
        if failed is not None:
            _refuse(failed)
        return [bool(b) for b in got[at + len(received) :]]


def holding_for_the_pass(checks: DeviceChecks | None):
    """While inside, :func:`hold_for_the_pass` on this thread moves an exchange's checks to ``checks`` (the DDP
    hook's communication thread, one backward pass, the device path; None: nothing is held)."""
    return setting("pass_checks", checks)


def held_for_the_pass() -> DeviceChecks | None:
    """The DeviceChecks that holds this thread's pass (inside :func:`holding_for_the_pass`), or None."""
    return step_state().pass_checks


def hold_for_the_pass(checks: DeviceChecks, abandon: torch.Tensor | None = None) -> bool:
    """Whether an exchange's pending ``checks`` were held for the backward pass instead of read now.

    Inside :func:`holding_for_the_pass`, ``checks`` move to the pass's and ``abandon`` (a one-element bool tensor,
    True where every worker must abandon the step, such as an aggregate that is not finite: the same on every
    worker) is kept with them; :meth:`DeviceChecks.read_after` reads them once, at the pass's last bucket, with its
    verdicts. The decoded values leave before that read, which refuses a bad message before anything of the pass is
    applied. Nothing is read here. False outside such a pass: the caller reads as before.
    """
    held = step_state().pass_checks
    if held is None:
        return False
    held.take(checks)
    if abandon is not None:
        held.abandon(abandon)
    return True
