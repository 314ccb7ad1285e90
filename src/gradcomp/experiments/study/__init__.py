"""Studies over many runs: `gradcomp sweep` (resumable grids), `gradcomp curves` (accuracy and loss curves, steps
to a target) and `gradcomp plan` (predicted step times on a network)."""
