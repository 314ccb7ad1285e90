"""Ctrl-C while the simulated cluster trains: the workers stop at their next rendezvous, not at the end."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import gradcomp


def test_an_interrupt_in_the_calling_thread_stops_every_worker_at_its_next_rendezvous():
    steps_done = [0, 0]
    running = [threading.Event(), threading.Event()]

    def worker(t):
        deadline = time.perf_counter() + 30  # far longer than the test waits
        while time.perf_counter() < deadline:
            t.all_reduce_sum(torch.ones(4))
            steps_done[t.rank] += 1
            running[t.rank].set()
            time.sleep(0.001)
        return "finished"

    def ctrl_c():  # once both workers are in their loop (not at a fixed delay: a busy machine starts them late)
        for event in running:
            event.wait(20)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=ctrl_c, daemon=True)
    started = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        with gradcomp.SimulatedCluster(2, timeout=60) as cluster:
            cluster.run(worker)
    elapsed = time.perf_counter() - started
    assert elapsed < 10, f"the cluster took {elapsed:.1f} s to stop (the workers run for 30 s)"
    assert min(steps_done) > 0
    assert not [t for t in threading.enumerate() if t.name.startswith("gradcomp-sim")]
