"""Cache-aware routing: TTFT estimates per worker, hot-prefix spill-over, and baselines."""

from kvstrata.errors import NoWorkerAvailable
from kvstrata.router.core import Router
from kvstrata.router.costs import CostProfile
from kvstrata.router.model import (
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerEstimate,
    WorkerLoad,
)
from kvstrata.router.policies import HotPrefixConfig, KvstrataPolicy
from kvstrata.router.registry import POLICIES

__all__ = [
    "POLICIES",
    "CostProfile",
    "HotPrefixConfig",
    "KvstrataPolicy",
    "NoWorkerAvailable",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RoutingPolicy",
    "WorkerEstimate",
    "WorkerLoad",
]
