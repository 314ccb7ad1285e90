"""`gradcomp bench`: compression throughput against a memory copy timed beside each row.

bench (the command), cases, timing, sketch_halves, targets (figures in bench_targets.json), report."""
