"""dpcoord: the Python side of the data-parallel rank coordinator.

Frontends ask :class:`RouterClient` (or :class:`AsyncRouterClient`) which DP rank
gets each request; engines publish their load with :class:`StatsPublisher`;
:mod:`dpcoord.adapters` maps vLLM and SGLang scheduler stats onto it.
"""

from .adapters import EngineCounters, publish_sglang, publish_vllm
from .aio import AsyncRouterClient
from .client import RouterClient
from .errors import (
    ERRORS,
    BadRequestError,
    DpcoordError,
    InvalidRankError,
    NoEngineAvailableError,
    ProtocolError,
    RankUnavailableError,
    TooLargeError,
    UnknownOpError,
    UnreachableError,
    UnsupportedVersionError,
)
from .prefix import block_keys, chain_seed
from .publisher import StatsPublisher

__version__ = "0.1.0"

__all__ = [
    "AsyncRouterClient",
    "BadRequestError",
    "DpcoordError",
    "ERRORS",
    "EngineCounters",
    "InvalidRankError",
    "NoEngineAvailableError",
    "ProtocolError",
    "RankUnavailableError",
    "RouterClient",
    "StatsPublisher",
    "TooLargeError",
    "UnknownOpError",
    "UnreachableError",
    "UnsupportedVersionError",
    "block_keys",
    "chain_seed",
    "publish_sglang",
    "publish_vllm",
]
