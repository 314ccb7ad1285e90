"""GradientAggregator: the call between ``loss.backward()`` and ``optimizer.step()``.

    aggregator = gradcomp.GradientAggregator(model, gradcomp.make("topk", density=0.01, error_feedback=True))
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        aggregator.step()          # every .grad now holds the compressed, aggregated average over workers
        optimizer.step()

Granularity ``layer`` compresses every parameter on its own (one slot each, still one collective per step);
``model`` flattens all gradients into one vector and compresses that (global top-k, one random block, ...).
A parameter without a gradient on this step contributes zeros, so all workers always send the same slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from gradcomp.compressors.base import Compressor, Slot
from gradcomp.errors import ConfigError
from gradcomp.train.exchange import GradientExchange, check_gradients, warn_float64
from gradcomp.transport.base import Transport

GRANULARITIES = ("layer", "model")


def _named_parameters(params) -> list[tuple[str, nn.Parameter]]:
    if isinstance(params, nn.Module):
        named = list(params.named_parameters())
    else:
        named = []
        for i, item in enumerate(params):
            named.append(item if isinstance(item, tuple) else (f"param{i}", item))
    return [(name, p) for name, p in named if p.requires_grad]


class GradientAggregator:
    def __init__(
        self,
        params: nn.Module | Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]],
        compressor: Compressor,
        transport: Transport | None = None,
        *,
        granularity: str = "layer",
        topology: str = "auto",
        server_compressor: Compressor | None = None,
        root: int = 0,
    ):
        if granularity not in GRANULARITIES:
            raise ConfigError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.named = _named_parameters(params)
        if not self.named:
            raise ConfigError("no parameters that require gradients")
        if transport is None:
            from gradcomp.transport.dist import DistTransport

            transport = DistTransport()
        self.granularity = granularity
        warn_float64(self.named, "GradientAggregator")
        self.names = [name for name, _ in self.named]
        self.slots = self.slots_for(self.named, granularity)
        self.exchange = GradientExchange(
            compressor, transport, topology=topology, server_compressor=server_compressor, root=root
        )
        self.steps = 0

    @staticmethod
    def slots_for(named: Sequence[tuple[str, nn.Parameter]], granularity: str) -> list[Slot]:
        """One slot per parameter (``layer``) or one for the whole flattened model (``model``)."""
        if granularity == "layer":
            return [Slot(name, i, p.numel(), tuple(p.shape)) for i, (name, p) in enumerate(named)]
        return [Slot("model", 0, sum(p.numel() for _, p in named))]

    @property
    def transport(self) -> Transport:
        return self.exchange.transport

    def current_gradients(self) -> list[Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.named]

    def aggregate(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """The averaged gradients for ``grads`` (one per parameter, in order); advances the step counter."""
        if len(grads) != len(self.named):
            raise ConfigError(f"expected {len(self.named)} gradients, got {len(grads)}")
        check_gradients(self.names, grads, self.steps)
        if self.granularity == "layer":
            averaged = self.exchange.exchange(self.slots, grads, self.steps, validate=False)
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])
            (average,) = self.exchange.exchange(self.slots, [flat], self.steps, validate=False)
            averaged = list(torch.split(average, [g.numel() for g in grads]))
        self.steps += 1
        return [a.view_as(g) for a, g in zip(averaged, grads)]

    @torch.no_grad()
    def step(self) -> None:
        """Replace every parameter's ``.grad`` with the aggregated average over all workers."""
        averaged = self.aggregate(self.current_gradients())
        for (_, p), a in zip(self.named, averaged):
            if p.grad is None:
                p.grad = a.to(p.dtype).clone()
            else:
                p.grad.copy_(a)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "exchange": self.exchange.state_dict(), **self.exchange.identity(self.slots)}

    def load_state_dict(self, state: dict) -> None:
        """ConfigError, and nothing loaded, for a state saved by another method or for other parameters."""
        self.exchange.check_saved(state, ("steps", "exchange"), self.slots, "GradientAggregator")
        self.exchange.load_state_dict(state["exchange"])
        self.steps = int(state["steps"])
