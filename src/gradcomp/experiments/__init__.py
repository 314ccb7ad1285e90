"""Experiments: datasets, models, the training runner and its launcher, benchmarks."""
