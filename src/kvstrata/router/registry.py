"""The policy registry: every routing policy by name, with its published default parameters.

``POLICIES[spec]`` accepts a plain name or a spec with parameters (:mod:`.specs`); the
defaults recorded here are the ones each policy's docstring cites (:mod:`.policies`,
:mod:`.dynamo_policy`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from kvstrata.router.dynamo_policy import DynamoLinearPolicy, DynamoWeights
from kvstrata.router.model import RoutingPolicy
from kvstrata.router.policies import (
    DEFAULT_WORK_WEIGHT,
    KvstrataPolicy,
    LeastLoadedPolicy,
    LlmdScorerPolicy,
    LlmdWeights,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
)
from kvstrata.router.specs import PolicyKind, PolicyRegistry, Profiles

_DYNAMO_PARAMS: Final = ("prefill_load_scale", "device_credit", "host_credit", "disk_credit")
_LLMD_PARAMS: Final = ("prefix", "kv_utilisation", "queue")


def _kvstrata(profiles: Profiles, params: Mapping[str, float]) -> RoutingPolicy:
    return KvstrataPolicy(profiles, work_weight=params["work_weight"])


def _dynamo(profiles: Profiles, params: Mapping[str, float]) -> RoutingPolicy:
    return DynamoLinearPolicy(profiles, DynamoWeights(**params))


def _llmd(profiles: Profiles, params: Mapping[str, float]) -> RoutingPolicy:
    return LlmdScorerPolicy(profiles, LlmdWeights(**params))


def _plain(cls: Callable[[Profiles], RoutingPolicy]) -> PolicyKind:
    return PolicyKind(lambda profiles, _params: cls(profiles))


POLICIES: Final = PolicyRegistry(
    {
        "kvstrata": PolicyKind(_kvstrata, {"work_weight": DEFAULT_WORK_WEIGHT}),
        "round-robin": _plain(RoundRobinPolicy),
        "least-loaded": _plain(LeastLoadedPolicy),
        "prefix-affinity": _plain(PrefixAffinityPolicy),
        "dynamo": PolicyKind(
            _dynamo,
            {name: getattr(DynamoWeights(), name) for name in _DYNAMO_PARAMS},
        ),
        "llm-d": PolicyKind(_llmd, {name: getattr(LlmdWeights(), name) for name in _LLMD_PARAMS}),
    }
)
"""Policy spec (``NAME`` or ``NAME:KEY=VALUE…``, :mod:`.specs`) → constructor taking the
per-worker cost profile lookup; iterating yields the plain names."""
