"""Training integration: the exchange, the aggregator for plain loops, and the DDP communication hook."""

from gradcomp.train.aggregator import GradientAggregator
from gradcomp.train.ddp_hook import CompressionHookState, compression_hook, register_ddp_hook
from gradcomp.train.exchange import GradientExchange, check_gradients
from gradcomp.train.local_steps import LocalUpdateExchange

__all__ = [
    "CompressionHookState", "GradientAggregator", "GradientExchange", "LocalUpdateExchange", "check_gradients",
    "compression_hook", "register_ddp_hook",
]
