# sample every thread's stack every 2 ms while benchmarks/sim_speed.py runs; tally the running worker's frames
import collections, runpy, sys, threading, time, traceback
counts = collections.Counter(); inner = collections.Counter(); n = [0]
stop = False
def sampler():
    me = threading.get_ident()
    while not stop:
        for tid, frame in sys._current_frames().items():
            if tid == me: continue
            stack = traceback.extract_stack(frame)
            names = [f"{f.filename.split('/src/')[-1]}:{f.name}" for f in stack]
            top = names[-1]
            if "_wait" in top or "wait" == stack[-1].name or "acquire" in top or stack[-1].name in ("wait", "_wait_for_tstate_lock", "worker", "_worker"):
                continue
            if any("threading.py" in x and ("wait" in x) for x in names[-3:]):
                continue
            n[0] += 1
            seen = set()
            for x in names:
                if "gradcomp" in x and x not in seen:
                    seen.add(x); counts[x] += 1
            inner[" <- ".join(reversed(names[-4:]))] += 1
        time.sleep(0.002)
t = threading.Thread(target=sampler, daemon=True); t.start()
sys.argv = ["benchmarks/sim_speed.py", *sys.argv[1:]]
try:
    runpy.run_path("benchmarks/sim_speed.py", run_name="__main__")
finally:
    stop = True
    print("samples", n[0])
    for k, v in counts.most_common(45): print(f"{v:6d} {k}")
    print("--- innermost")
    for k, v in inner.most_common(25): print(f"{v:6d} {k}")
