"""A latency-bandwidth (alpha-beta) model: what a run's measured collectives would cost on a chosen network.

The transports record, per collective, how many calls were made and how many bytes each worker handed to
them. A network with per-message latency α (seconds) and per-worker link bandwidth B (bits per second)
prices one call on a tensor of n bytes, for W workers, with the textbook algorithms:

    all_reduce   ring (reduce-scatter + all-gather)   2(W−1)·α + 2(W−1)/W · 8n/B
    all_gather   ring                                  (W−1)·α + (W−1) · 8n/B
    all_to_all   pairwise exchange of n/W-byte chunks  (W−1)·α + (W−1)/W · 8n/B
    gather       to one root over its single link      α + (W−1) · 8n/B
    broadcast    binomial tree                         ⌈log2 W⌉ · (α + 8n/B)

The model is applied to the bytes the run really handed to each collective (padding and size exchanges
included), so compressors are compared on what they actually send. With W = 1 every cost is 0.

A link shaped by a token bucket (``tc tbf``, as ``gradcomp race`` emulates one) passes the first ``burst_bytes``
after an idle pause at line rate. ``step_seconds`` prices one training step's collectives with that credit: the
bucket refills while the workers compute, so the first ``burst_bytes`` of each step's traffic on a link cost no
bandwidth time (the bandwidth terms shrink by ``8 · burst_bytes / B``, at most to 0; refills during a step's own
pauses are not counted). ``burst_bytes = 0`` (the default) is the plain latency-bandwidth model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gradcomp.errors import ConfigError

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _quantity(text: str | float, pattern: str, units: dict[str, float], default_unit: str, what: str) -> float:
    """A plain number, or ``<number><unit>`` matching ``pattern`` (groups: number, unit), scaled to base units."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    match = re.fullmatch(pattern, str(text))
    try:
        number = float(match.group(1)) if match else None
    except ValueError:
        number = None
    if number is None:
        raise ConfigError(f"{what}, got {text!r}")
    return number * units[(match.group(2) or default_unit).lower()]


def parse_bandwidth(text: str | float, option: str = "bandwidth") -> float:
    """``"10Gbit"``, ``"1 Gbit/s"``, ``"100Mbps"``, ``1e9`` → bits per second; ``option``: the name the errors
    give it (``--link``, ``--bandwidth``)."""
    value = _quantity(text, r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]?)\s*(?:bit/s|bits/s|bit|bps|b/s|b)?\s*", _UNITS, "",
                      f"{option} must look like 10Gbit, 1Gbit/s or 100Mbps")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{option} must be a finite rate above 0, got {text!r}")
    return value


def parse_latency(text: str | float, option: str = "latency") -> float:
    """``"50us"``, ``"1ms"``, ``0.0001`` → seconds."""
    return _non_negative(_quantity(text, r"\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)?\s*", _TIME_UNITS, "s",
                                   f"{option} must look like 50us, 1ms or 0.0001"), text, option)


_BYTE_UNITS = {"": 1.0, "b": 1.0, **{k: 1024.0 for k in ("k", "ki", "kb", "kib")},
               **{m: 1024.0**2 for m in ("m", "mi", "mb", "mib")}}  # tc's k, kb and m, mb are binary too


def parse_bytes(text: str | float, option: str = "a size") -> float:
    """``"256kb"`` (tc's kb: KiB), ``"256KiB"``, ``"1mb"``, ``262144`` → bytes."""
    return _non_negative(_quantity(text, r"\s*([0-9.eE+-]+)\s*((?:[kKmM][iI]?)?[bB]?)\s*", _BYTE_UNITS, "",
                                   f"{option} must look like 256kb, 256KiB or 262144"), text, option)


def _non_negative(value: float, text: str | float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what} must be a finite number >= 0, got {text!r}")
    return value


@dataclass(frozen=True)
class NetworkModel:
    bandwidth_bps: float
    latency_s: float = 0.0
    burst_bytes: float = 0.0

    def call_seconds(self, op: str, nbytes: float, world: int) -> float:
        latency, transfer = self.call_parts(op, nbytes, world)
        return latency + transfer

    def call_parts(self, op: str, nbytes: float, world: int) -> tuple[float, float]:
        """One call's (latency term, bandwidth term) in seconds."""
        if world <= 1:
            return 0.0, 0.0
        a, bits = self.latency_s, 8.0 * nbytes / self.bandwidth_bps
        if op == "all_reduce":
            return 2 * (world - 1) * a, 2 * (world - 1) / world * bits
        if op == "all_gather":
            return (world - 1) * a, (world - 1) * bits
        if op == "all_to_all":
            return (world - 1) * a, (world - 1) / world * bits
        if op == "gather":
            return a, (world - 1) * bits
        if op == "broadcast":
            rounds = math.ceil(math.log2(world))
            return rounds * a, rounds * bits
        raise ConfigError(f"no cost model for collective {op!r}")

    def step_seconds(self, ops: dict[str, list[float]], world: int) -> float:
        """One step's recorded calls (``ops`` as in :meth:`seconds`), with the token bucket's burst credited once."""
        latency, transfer = self._priced(ops, world)
        if world > 1:
            transfer = max(0.0, transfer - 8.0 * self.burst_bytes / self.bandwidth_bps)
        return latency + transfer

    def seconds(self, ops: dict[str, list[int]], world: int) -> float:
        """Modelled time of all recorded calls: ops maps a collective to [calls, total bytes]."""
        return sum(self._priced(ops, world))

    def _priced(self, ops: dict[str, list[float]], world: int) -> tuple[float, float]:
        """(latency terms, bandwidth terms) of all the calls in ``ops``."""
        latency = transfer = 0.0
        for op, (calls, nbytes) in ops.items():
            if calls:
                # linear in bytes: calls × cost of the mean size is exact for the bandwidth term
                a, b = self.call_parts(op, nbytes / calls, world)
                latency, transfer = latency + calls * a, transfer + calls * b
        return latency, transfer
