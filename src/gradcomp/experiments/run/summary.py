"""One result dict for a training run from every worker's local statistics (``summarize``): what ``gradcomp
train`` prints and writes with ``--json``."""

from __future__ import annotations

import math
from typing import Any

import torch

from gradcomp.experiments.run.config import ADAM_FAMILY, EXCHANGING_OPTIMIZERS, TrainConfig
from gradcomp.transport.base import ByteCounter


ECHOED = ("compressor", "feedback", "feedback_momentum", "granularity", "topology", "server_compressor",
          "local_steps", "batch_size", "lr", "momentum", "optimizer", "weight_decay", "lr_schedule", "warmup_steps",
          "dataset", "model", "seed", "simulate", "ddp", "fsdp")


def config_record(cfg: TrainConfig) -> dict[str, Any]:
    """The configuration part of a run's result, as given (``gradcomp plan --recorded`` matches runs by it)."""
    return {
        **{key: getattr(cfg, key) for key in ECHOED}, "params": dict(cfg.params),
        "server_params": dict(cfg.server_params), "error_feedback": cfg.uses_error_feedback(),
        **({"betas": list(cfg.betas), "eps": cfg.eps} if cfg.optimizer in ADAM_FAMILY else {}),
        **({"freeze_step": cfg.resolved_freeze_step()} if cfg.optimizer in EXCHANGING_OPTIMIZERS else {}),
        **({"warmup_compressor": cfg.warmup_compressor} if cfg.optimizer in EXCHANGING_OPTIMIZERS else {}),
        **({key: getattr(cfg, key) for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper")}
           if cfg.optimizer == "zero_one_adam" else {}),
        **({"outer_optimizer": cfg.outer_optimizer, "outer_lr": cfg.outer_lr, "outer_momentum": cfg.outer_momentum}
           if cfg.local_steps is not None else {}),
        "dense_steps": cfg.dense_steps,
        **({"schedule_steps": cfg.schedule_steps} if cfg.schedule_steps is not None else {}),
        **({"lr_step_size": cfg.lr_step_size, "lr_gamma": cfg.lr_gamma} if cfg.lr_schedule == "step" else {}),
    }


def summarize(cfg: TrainConfig, stats: list[dict[str, Any]], wall_time_s: float, backend: str) -> dict[str, Any]:
    """One result dict from every worker's local statistics (bits are per-worker means of measured counts)."""
    workers = len(stats)
    lead = stats[0]
    counters = [ByteCounter(**s["counter"]) for s in stats]
    num_parameters = lead["num_parameters"]
    steps = lead["steps"]
    # gradient (or update) bits: what the transport counted, less the buffers' broadcast (reported apart)
    buffer_up = [8 * s.get("buffer_bytes_up", 0) for s in stats]
    buffer_down = [8 * s.get("buffer_bytes_down", 0) for s in stats]
    bits_up = [8 * c.bytes_up - b for c, b in zip(counters, buffer_up)]
    bits_down = [8 * c.bytes_down - b for c, b in zip(counters, buffer_down)]
    # fp32 all-reduce hands the transport 4 bytes per parameter; under FSDP the reference is its fp32
    # reduce-scatter, counted as gradcomp's all-to-all is (the chunks that leave the rank): (W - 1) / W of that
    dense_bits = 32 * num_parameters * steps * ((workers - 1) / workers if cfg.fsdp else 1)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    up, down = mean(bits_up), mean(bits_down)
    return {
        **config_record(cfg),
        "workers": workers, "steps": steps, "syncs": lead["syncs"], "epochs": lead["epochs"],
        "num_parameters": num_parameters, "backend": backend,
        "test_accuracy": lead["test_accuracy"],
        "val_bits_per_byte": lead.get("val_bits_per_byte"),
        "val_perplexity": None if lead.get("val_bits_per_byte") is None else 2 ** lead["val_bits_per_byte"],
        "corpus": lead.get("corpus"),
        "buffer_bits_up_per_worker": mean(buffer_up),
        "buffer_bits_down_per_worker": mean(buffer_down),
        "num_buffer_elements": lead.get("num_buffer_elements", 0),
        "final_loss": lead["final_loss"],
        "bits_up_per_worker": up,
        "bits_down_per_worker": down,
        "bits_up_by_worker": bits_up,
        "bits_down_by_worker": bits_down,
        "dense_bits_per_worker": dense_bits,
        "compression_ratio_up": dense_bits / up if up else math.inf,
        "compression_ratio_down": dense_bits / down if down else math.inf,
        "paper_compression": lead.get("paper_compression"),
        "method_report": lead.get("method_report"),
        "padding_bits": mean([8 * c.padding_bytes for c in counters]),
        "control_bits": mean([8 * (c.up_control + c.down_control) for c in counters]),
        "control_bits_up": mean([8 * c.up_control for c in counters]),
        "control_bits_down": mean([8 * c.down_control for c in counters]),
        "setup_bits": mean([8 * c.setup_bytes for c in counters]),  # once per run: the slot check, not a step's
        "server_bits_in": sum(8 * c.server_in for c in counters),
        "server_bits_out": sum(8 * c.server_out for c in counters),
        "wall_time_s": wall_time_s,
        "compute_s": mean([s["compute_s"] for s in stats]),
        "compress_s": mean([s["compress_s"] for s in stats]),
        "communicate_s": mean([s["communicate_s"] for s in stats]),
        # --ddp: compress and communicate are the hook's thread's, overlapping the loop's own time (compute_s, which
        # holds backward's wait for the hook); elsewhere the three follow one another
        "time_overlapped": bool(lead.get("time_overlapped", False)),
        **_modelled_network(cfg, counters, workers),
        # FSDP keeps one sharded copy: its ranks' digests are of the same gathered parameters, equal by
        # construction, so nothing is claimed (None) rather than a check that cannot fail
        "replicas_identical": None if cfg.fsdp else len({(s["digest"], s.get("buffer_digest")) for s in stats}) == 1,
        "parameter_digest": lead["digest"],
        "resumed_from_step": lead.get("resumed_from_step"),
        "loss_curve": lead["loss_curve"],
        "accuracy_curve": lead["accuracy_curve"],
        "val_loss_curve": lead.get("val_loss_curve", []),
        "torch_version": torch.__version__,
    }


def _modelled_network(cfg: TrainConfig, counters: list[ByteCounter], workers: int) -> dict[str, Any]:
    """What the run's collectives would cost on ``cfg``'s network (alpha-beta model), per worker on average."""
    network = cfg.network()
    if network is None:
        return {}
    seconds = [network.seconds(c.ops, workers) for c in counters]
    return {
        "network": {"bandwidth_bps": network.bandwidth_bps, "latency_s": network.latency_s},
        "modelled_communicate_s": sum(seconds) / len(seconds),
    }
