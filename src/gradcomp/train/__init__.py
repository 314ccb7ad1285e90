"""Training integration: the exchange, the aggregator for plain loops, and the DDP communication hook."""

from gradcomp.train.aggregator import GradientAggregator
from gradcomp.train.ddp_hook import CompressionHookState, compression_hook, register_ddp_hook
from gradcomp.train.exchange import GradientExchange, check_gradients
from gradcomp.train.local_steps import LocalUpdateExchange
from gradcomp.train.onebit_adam import OneBitAdam
from gradcomp.train.zero_one_adam import ZeroOneAdam

__all__ = [
    "CompressionHookState", "GradientAggregator", "GradientExchange", "LocalUpdateExchange", "OneBitAdam", "ZeroOneAdam",
    "check_gradients",
    "compression_hook", "register_ddp_hook",
]
