"""Emulated hosts on one machine: a network namespace per host, a shaped link per host, a switch between them.

Layout of one run, tag ``gc<pid % 10000><n>`` (``n`` counts the networks this process made; a tag whose
namespaces already exist is skipped, so two runs never share names)::

    namespace <tag>h0            namespace <tag>sw                      namespace <tag>h1
    ┌──────────────────┐         ┌─────────────────────────────┐        ┌──────────────────┐
    │ lo, <tag>h0      │─ veth ──│ <tag>p0 ── bridge <tag>br ──│─ veth ─│ <tag>h1, lo      │  ...
    │ 10.231.0.1/16    │         │            <tag>p1          │        │ 10.231.0.2/16    │
    └──────────────────┘         └─────────────────────────────┘        └──────────────────┘

Each host's veth pair is created directly between the host's namespace and the switch's, so nothing is added
to the machine's own namespace. With a rate, both ends of every host's veth get a token-bucket filter
(``tc qdisc add dev X root tbf rate R burst 256kb latency 50ms``): the host end shapes what the host sends,
the switch end what it receives, so every host has R up and R down, as behind a switch port. A smaller burst
stalls TCP at these rates (the bucket must hold at least a few segments at the timer granularity).

``NamespaceNetwork.down()`` kills whatever still runs inside the namespaces (only processes of this run can be in
them) and deletes the namespaces; deleting a namespace deletes the veth ends and the bridge inside it. SIGINT,
SIGTERM and SIGHUP are held off while it runs (``signals_held``) and delivered when it is done, so a second
Ctrl-C or SIGTERM cannot stop a teardown half-way; a namespace is forgotten only once it is gone.
``cleanup(tag)`` does the same for the leftovers of a run that could not tear down (killed with SIGKILL),
``cleanup("all")`` for every namespace named like one of these runs.

Without root, without ``ip`` (iproute2) or, with a rate, without ``tc``, ``require_emulation`` raises
``EmulationError`` before anything is created. ``LocalHosts`` is the fallback for an unshaped run: W plain
processes on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass

from gradcomp.errors import ConfigError, GradcompError

TBF_BURST = "256kb"
TBF_BURST_BYTES = 256 * 1024  # tc's "kb" is KiB
TBF_LATENCY = "50ms"
SUBNET = "10.231"  # /16 inside the run's namespaces only: never routed, never visible outside them
MAX_HOSTS = 250
MIN_RATE_BPS = 1e3
# tbf with a 256kb burst and 50 ms latency holds up to here; at 1tbit tc shortens the latency, at 10tbit the
# burst becomes 0, and beyond 2^64 bit/s the rate wraps to 0
MAX_RATE_BPS = 100e9
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TAG_RE = re.compile(r"^gc\d+$")
_NAME_RE = re.compile(r"^(gc\d+)(?:sw|h\d+)$")
_counter = itertools.count()


class EmulationError(GradcompError):
    """The emulated network cannot be built here (no root, no iproute2) or an ``ip``/``tc`` command failed."""


def missing_tools(shaped: bool) -> str | None:
    """Why namespaces (and, if ``shaped``, tbf) cannot be used here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (run as root, or use --link none, which then runs plain local processes)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) was not found on PATH"
    if shaped and shutil.which("tc") is None:
        return "the `tc` command (iproute2) was not found on PATH"
    return None


def require_emulation(shaped: bool) -> None:
    reason = missing_tools(shaped)
    if reason is not None:
        what = "a shaped link" if shaped else "network namespaces"
        raise EmulationError(f"cannot emulate {what}: {reason}; nothing was started")


@contextlib.contextmanager
def signals_held():
    """Hold off SIGINT, SIGTERM and SIGHUP for the block; deliver those that came once it is done.

    The signals are blocked (``pthread_sigmask``) and their handlers replaced by one that only notes them (a
    signal can still reach another thread of the process, which runs no Python handler but wakes this one's);
    afterwards the handlers are restored and each noted signal raised once, so its own handler (an exception,
    or the default action) runs after the block. Outside the main thread it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in HELD_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # what came meanwhile is noted now
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in dict.fromkeys(received):
            signal.raise_signal(sig)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise EmulationError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces() -> list[str]:
    done = _run(["ip", "netns", "list"], check=False)
    if done.returncode != 0:
        return []
    # lines look like "name" or "name (id: 3)"
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    done = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(x) for x in done.stdout.split() if x.isdigit()]


def run_tags() -> list[str]:
    """Tags of the runs whose namespaces exist now."""
    return sorted({m.group(1) for name in list_namespaces() if (m := _NAME_RE.match(name))})


def _kill_and_delete(namespaces: list[str]) -> list[str]:
    """SIGKILL what runs inside ``namespaces``, delete them; returns those that could not be deleted."""
    for ns in namespaces:
        for pid in namespace_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    failed = []
    for ns in namespaces:
        if _run(["ip", "netns", "del", ns], check=False).returncode != 0 and ns in list_namespaces():
            failed.append(ns)
    return failed


def cleanup(tag: str) -> list[str]:
    """Remove the namespaces (hence links and bridge) left by run ``tag``, or by every run for ``"all"``.

    Processes still inside them are killed first. Returns the names removed.
    """
    require_emulation(shaped=False)
    if tag != "all" and not _TAG_RE.match(tag):
        raise EmulationError(f"a run tag looks like gc12340 (printed when the run starts), got {tag!r}")
    names = [
        name for name in list_namespaces()
        if (m := _NAME_RE.match(name)) and (tag == "all" or m.group(1) == tag)
    ]
    failed = _kill_and_delete(names)
    if failed:
        raise EmulationError(f"could not delete namespaces {', '.join(failed)}")
    return names


@dataclass(frozen=True)
class Host:
    index: int
    address: str
    ifname: str  # the interface gloo must use (GLOO_SOCKET_IFNAME)
    namespace: str | None = None  # None: a plain process in the machine's own namespace

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host."""
        if self.namespace is None:
            return list(argv)
        return ["ip", "netns", "exec", self.namespace, *argv]


def read_wire_counters(ifname: str) -> tuple[int, int] | None:
    """(tx_bytes, rx_bytes) of ``ifname`` as this process's namespace sees it, or None."""
    base = f"/sys/class/net/{ifname}/statistics"
    try:
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())
    except (OSError, ValueError):
        return None


class _Hosts:
    """Used as a context manager: ``up()`` on entry, ``down()`` on exit."""

    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()


class LocalHosts(_Hosts):
    """W plain processes on 127.0.0.1 (no isolation, no shaping): the fallback without root."""

    shaped = False
    tag = None
    kind = "local processes on 127.0.0.1 (no namespaces)"

    def __init__(self, hosts: int):
        self.hosts = [Host(i, "127.0.0.1", "lo") for i in range(hosts)]

    def up(self) -> None:
        pass

    def down(self) -> None:
        pass



def new_tag() -> str:
    taken = set(run_tags())
    while True:
        tag = f"gc{os.getpid() % 10000}{next(_counter)}"
        if tag not in taken:
            return tag


class NamespaceNetwork(_Hosts):
    """W hosts in their own network namespaces behind one bridge; each host's link shaped to ``rate_bps``.

    ``rate_bps=None`` builds the same network without shaping. Use as a context manager, or call ``up()`` and
    ``down()`` in try/finally; ``up()`` that fails half-way removes what it made before raising.
    """

    shaped: bool
    kind = "network namespaces + veth + bridge"

    def __init__(self, hosts: int, rate_bps: float | None = None, tag: str | None = None):
        if not 1 <= hosts <= MAX_HOSTS:
            raise EmulationError(f"between 1 and {MAX_HOSTS} hosts, got {hosts}")
        if rate_bps is not None and not MIN_RATE_BPS <= rate_bps <= MAX_RATE_BPS:
            raise EmulationError(f"a link rate must lie between 1kbit and 100gbit (tbf's range), got {rate_bps} bit/s")
        require_emulation(shaped=rate_bps is not None)
        self.tag = tag or new_tag()
        if len(self.tag) + 4 > 15:  # "<tag>h123": interface names are limited to 15 characters
            raise EmulationError(f"run tag {self.tag!r} too long for interface names")
        self.rate_bps = rate_bps
        self.shaped = rate_bps is not None
        self.switch = f"{self.tag}sw"
        self.bridge = f"{self.tag}br"
        self.hosts = [
            Host(i, f"{SUBNET}.{(i + 1) // 256}.{(i + 1) % 256}", f"{self.tag}h{i}", f"{self.tag}h{i}")
            for i in range(hosts)
        ]
        self._made: list[str] = []  # namespaces created so far, in order

    @property
    def namespaces(self) -> list[str]:
        return [self.switch] + [h.namespace for h in self.hosts]  # type: ignore[misc]

    def port(self, host: Host) -> str:
        return f"{self.tag}p{host.index}"

    def tbf(self) -> list[str]:
        return ["tbf", "rate", f"{int(self.rate_bps)}bit", "burst", TBF_BURST, "latency", TBF_LATENCY]

    def up(self) -> None:
        try:
            self._up()
        except BaseException:
            self.down()
            raise

    def _add_namespace(self, name: str) -> None:
        if name in list_namespaces():
            raise EmulationError(f"namespace {name} exists already (another run?); choose another tag")
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _up(self) -> None:
        self._add_namespace(self.switch)
        sw = ["ip", "-n", self.switch]
        _run([*sw, "link", "add", self.bridge, "type", "bridge"])
        _run([*sw, "link", "set", self.bridge, "up"])
        for host in self.hosts:
            ns, port = host.namespace, self.port(host)
            self._add_namespace(ns)
            _run(["ip", "link", "add", host.ifname, "netns", ns, "type", "veth", "peer", "name", port,
                  "netns", self.switch])
            _run([*sw, "link", "set", port, "master", self.bridge])
            _run([*sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{host.address}/16", "dev", host.ifname])
            _run(["ip", "-n", ns, "link", "set", host.ifname, "up"])
            if self.shaped:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", host.ifname, "root", *self.tbf()])
                _run(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", *self.tbf()])

    def down(self) -> None:
        """Kill what runs in the namespaces and delete them; raises EmulationError if any is left.

        SIGINT, SIGTERM and SIGHUP wait until it is done (``signals_held``). A namespace is forgotten only once
        it no longer exists, so a ``down()`` that did not finish can be called again.
        """
        with signals_held():
            if not self._made:
                return
            _kill_and_delete(list(reversed(self._made)))
            present = set(list_namespaces())
            self._made = [ns for ns in self._made if ns in present]
            failed = list(self._made)
        if failed:
            raise EmulationError(
                f"could not delete namespaces {', '.join(failed)}; "
                f"remove them with `gradcomp race --cleanup {self.tag}`"
            )

    def exists(self) -> bool:
        present = set(list_namespaces())
        return any(ns in present for ns in self.namespaces)


def link_rate(link: str) -> float | None:
    """``"100mbit"`` → 1e8 bit/s; ``"none"`` → None (unshaped); ConfigError outside tbf's 1kbit to 100gbit."""
    if link.strip().lower() in ("none", "off", "unshaped"):
        return None
    from gradcomp.netmodel import parse_bandwidth

    rate = parse_bandwidth(link, "--link")
    if not MIN_RATE_BPS <= rate <= MAX_RATE_BPS:
        raise ConfigError(f"--link must lie between 1kbit and 100gbit (what tbf shapes with a 256kb burst), "
                          f"got {link!r} = {rate:.4g} bit/s")
    return rate
