# run benchmarks/sim_speed.py with freed memory kept for reuse, as the gradcomp command's own process does
import runpy, sys
import gradcomp
print("keep_freed_memory:", gradcomp.keep_freed_memory(), file=sys.stderr)
sys.argv = ["benchmarks/sim_speed.py", *sys.argv[1:]]
runpy.run_path("benchmarks/sim_speed.py", run_name="__main__")
