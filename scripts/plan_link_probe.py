"""Time gloo collectives alone on `gradcomp race`'s emulated link: is the link what the plan prices?

    sudo python scripts/plan_link_probe.py --link 100mbit --bytes 1200000 --pause-ms 35

Two hosts in network namespaces with tbf-shaped links (the race's ``NamespaceNetwork``); each collective runs
after a barrier and a pause as long as a step's compute (so tbf's bucket refills as in training), 12 times; the
medians of the last 10 are printed, in ms: an all-gather of BYTES per host (uint8 and float32 lists, and into one
tensor) and an all-reduce that moves the same bytes (fp16, BYTES / 2 entries: a 2-host ring sends each its size);
then each tbf's counters (bytes sent, packets dropped: the queue holds about 50 ms of the rate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PORT = 29555


def worker(rank: int, nbytes: int, pause: float, out: str) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["PROBE_ADDR"], PORT, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    g, gf = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes // 4)
    outs, outf = [torch.empty_like(g) for _ in range(2)], [torch.empty_like(gf) for _ in range(2)]
    into, r = torch.empty(2 * nbytes, dtype=torch.uint8), torch.zeros(nbytes // 2, dtype=torch.float16)
    cases = {"all_gather uint8": lambda: dist.all_gather(outs, g),
             "all_gather float32": lambda: dist.all_gather(outf, gf),
             "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(into, g),
             "all_reduce fp16, same bytes": lambda: dist.all_reduce(r)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(12):
        for name, run in cases.items():
            dist.barrier()
            time.sleep(pause)
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: 1e3 * statistics.median(v[2:]) for k, v in times.items()}, f)
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="100mbit")
    p.add_argument("--bytes", type=int, default=1_200_000)
    p.add_argument("--pause-ms", type=float, default=35.0)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.bytes, args.pause_ms / 1e3, args.out)
        return 0
    from gradcomp.experiments.race.netns import NamespaceNetwork
    from gradcomp.netmodel import parse_bandwidth

    with tempfile.TemporaryDirectory() as tmp, NamespaceNetwork(2, parse_bandwidth(args.link)) as net:
        out = os.path.join(tmp, "probe.json")
        procs = [subprocess.Popen(h.command([sys.executable, __file__, "--worker", str(h.index), "--bytes",
                                             str(args.bytes), "--pause-ms", str(args.pause_ms), "--out", out]),
                                  env=dict(os.environ, PROBE_ADDR=net.hosts[0].address, GLOO_SOCKET_IFNAME=h.ifname))
                 for h in net.hosts]
        codes = [proc.wait() for proc in procs]
        if any(codes):
            return max(codes)
        with open(out) as f:
            for name, ms in json.load(f).items():
                print(f"{name:30s} {ms:8.1f} ms")
        for h in net.hosts:  # tbf's own count of packets it dropped (its queue holds about 50 ms of the rate)
            for ns, dev in ((h.namespace, h.ifname), (net.switch, net.port(h))):
                stats = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                                       text=True).stdout
                sent = next((line.strip() for line in stats.splitlines() if "dropped" in line), "?")
                print(f"tbf on {dev}: {sent}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
