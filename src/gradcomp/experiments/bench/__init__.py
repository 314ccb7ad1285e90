"""`gradcomp bench`: compression throughput against a memory copy timed beside each row; the targets and anchor figures live in bench_targets.json."""
