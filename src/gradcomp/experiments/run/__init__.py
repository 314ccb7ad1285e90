"""One training run: its configuration and checks (config), the loop (runner), its workers (launch: spawn, torchrun,
the simulated cluster), the shared training options (options), data, models, resumable checkpoints (checkpoint), the
FSDP2 loop (fsdp_run), the result dict (summary), its text and the shared helpers (report)."""
