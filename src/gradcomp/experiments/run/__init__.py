"""One training run: the loop (runner), its workers (launch: spawn, torchrun, the simulated cluster), data, models,
resumable checkpoints (checkpoint), the FSDP2 loop (fsdp_run), the result summary and shared helpers (report)."""
