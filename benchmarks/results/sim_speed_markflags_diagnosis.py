# benchmarks/sim_speed.py with gradcomp.train.exchange._mark_flags reading only the first two entries of each
# received row (a diagnosis, not a change to src/: the original concatenates every received buffer whole)
import runpy, sys, torch
import gradcomp.train.exchange as ex
orig = ex._mark_flags
def _mark_flags(received, chunks=1):
    parts = received if isinstance(received, list) else [received]
    if parts and parts[0].dtype not in (torch.int64,) and not parts[0].is_floating_point():
        rows = torch.cat([r.reshape(chunks, -1)[:, :2] for r in parts])
        return (rows[:, 0] == ex.NF_MARK[0]) & (rows[:, 1] == ex.NF_MARK[1])
    return orig(received, chunks)
ex._mark_flags = _mark_flags
sys.argv = ["benchmarks/sim_speed.py", *sys.argv[1:]]
runpy.run_path("benchmarks/sim_speed.py", run_name="__main__")
