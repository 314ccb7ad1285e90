"""torch's own DDP communication, as baselines for ``gradcomp race``.

- ``torch-fp32``: plain ``DistributedDataParallel``, no hook: torch's built-in (C++) fp32 allreduce per bucket.
- ``torch-fp16``: ``default_hooks.fp16_compress_hook`` (buckets cast to fp16, allreduced, cast back).
- ``torch-powersgd``: ``powerSGD_hook`` with a ``PowerSGDState``. Its second allreduce is issued from a future's
  callback, so on gloo it needs a single bucket (the race sizes ``bucket_cap_mb`` to hold the whole model; the
  hook refuses any other bucket with a ConfigError rather than let the ranks' collectives interleave).

``torch_hook_registrar(name, params)`` returns the function ``run_worker`` calls instead of gradcomp's
``register_ddp_hook`` (``run_worker(..., register_hook=...)``): it registers torch's hook on the DDP model and
returns a small state with what the training loop reads of a hook state (``exchange`` with its timers,
``transport`` with its rank and byte counter, ``close``, ``state_dict``). torch's hooks do not go through a
gradcomp transport, so their byte counters stay at zero; ``gradcomp race`` measures every method's traffic on
the emulated wire instead.

(No ``from __future__ import annotations``: DDP inspects a hook's annotations at registration.)
"""

from typing import Any

from torch import nn

from gradcomp.errors import ConfigError
from gradcomp.transport.dist import DistTransport

BASELINES = {
    "torch-fp32": "plain DDP, torch's built-in fp32 allreduce (no hook)",
    "torch-fp16": "DDP + torch's fp16_compress_hook",
    "torch-powersgd": "DDP + torch's powerSGD_hook (one bucket)",
}
ALIASES = {"ddp": "torch-fp32"}

# torch-powersgd's parameters (race spelling → PowerSGDState argument) and their defaults here
POWERSGD_PARAMS = {
    "rank": ("matrix_approximation_rank", 2),
    "start_iter": ("start_powerSGD_iter", 2),  # the smallest torch allows with error feedback or warm start
    "min_compression_rate": ("min_compression_rate", 2.0),
    "error_feedback": ("use_error_feedback", True),
    "warm_start": ("warm_start", True),
    "seed": ("random_seed", 0),
    "batch_same_shape": ("batch_tensors_with_same_shape", False),
}


def canonical(name: str) -> str | None:
    """The baseline's name for ``name`` (aliases resolved), or None if it is not a torch baseline."""
    name = ALIASES.get(name, name)
    return name if name in BASELINES else None


def check_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The baseline's parameters with defaults filled in; ConfigError for an unknown one."""
    if name == "torch-powersgd":
        unknown = sorted(set(params) - set(POWERSGD_PARAMS))
        if unknown:
            raise ConfigError(
                f"torch-powersgd takes {', '.join(POWERSGD_PARAMS)}; unknown: {', '.join(unknown)}"
            )
        full = {key: params.get(key, default) for key, (_, default) in POWERSGD_PARAMS.items()}
        if not isinstance(full["rank"], int) or full["rank"] < 1:
            raise ConfigError(f"torch-powersgd rank must be a positive integer, got {full['rank']!r}")
        if (full["error_feedback"] or full["warm_start"]) and full["start_iter"] <= 1:
            raise ConfigError("torch-powersgd needs start_iter >= 2 with error_feedback or warm_start (torch's rule)")
        return full
    if params:
        raise ConfigError(f"{name} takes no parameters, got {', '.join(sorted(params))}")
    return {}


class _Timers:
    """torch's hooks run inside backward and are not timed apart: compression and communication read 0."""

    compress_s = 0.0
    communicate_s = 0.0


def _powersgd_one_bucket(state, bucket):
    if bucket.index() != 0 or not bucket.is_last():
        raise ConfigError(
            "torch's powerSGD_hook needs a single DDP bucket on gloo (its second allreduce is issued from a "
            "callback); raise bucket_cap_mb above the model's size"
        )
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    return powerSGD_hook(state, bucket)


class TorchHookState:
    """torch's hook registered on ``ddp``, seen through the attributes ``run_worker`` reads of a hook state."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, name: str, params: dict[str, Any]):
        self.name = name
        self.params = check_params(name, params)
        self.transport = DistTransport(ddp.process_group)
        self.exchange = _Timers()
        self.powersgd = None
        if name == "torch-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            ddp.register_comm_hook(None, fp16_compress_hook)
        elif name == "torch-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            kwargs = {POWERSGD_PARAMS[key][0]: value for key, value in self.params.items()}
            self.powersgd = PowerSGDState(process_group=None, **kwargs)
            ddp.register_comm_hook(self.powersgd, _powersgd_one_bucket)
        elif name != "torch-fp32":
            raise ConfigError(f"unknown torch baseline {name!r}; known: {', '.join(BASELINES)}")

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"baseline": self.name, "params": dict(self.params), "iter": getattr(self.powersgd, "iter", None)}


def torch_hook_registrar(name: str, params: dict[str, Any]):
    """The ``register_hook`` for ``run_worker``: registers torch's baseline ``name`` instead of gradcomp's hook."""
    name = canonical(name) or name
    check_params(name, params)

    def register(ddp, method, *, topology: str = "auto", server_compressor=None) -> TorchHookState:
        del method, topology, server_compressor  # the configuration's compressor is "none"; torch's hook rules
        return TorchHookState(ddp, name, params)

    return register
