"""The eviction policies people deploy, as kvstrata's peers (``kvstrata bench eviction`` and a
tier's ``eviction_policy``): S3-FIFO, ARC, GDSF and TinyLFU in front of LRU. Each module cites
its paper and says how it honours prefix closure.

A tier's ``s3fifo`` / ``tinylfu`` / ``gdsf`` run with their papers' defaults. A benchmark's peer
runs at its best (issue 15): each parameterised peer got a sweep of its main parameter on the
same tuning windows and budget kvstrata's own weight was chosen on, and ``NAME-tuned`` is the
point the sweep chose (:data:`PEER_PARAMETERS`). ``NAME:VALUE`` names any other point, so the
sweep is a ``kvstrata bench eviction --policies`` command line. ARC has no parameter (it adapts
its own target).

How the tuned points were chosen (``kvstrata bench eviction --trace
…/mooncake/conversation_trace.jsonl --skip S --requests 1500 --capacities 2%,5%,15%
--policies <every point>`` for S = 0, 1,500, 3,000, 4,500: the trace's first half, where
kvstrata's ``SECONDS_WEIGHT`` was chosen): for each point, the geometric mean over the 12
(window, capacity) cells of √(saved seconds × saved tokens), relative to the default point;
the highest wins. Where the best point was at the edge of the sweep, the sweep was extended
until it was not (or the gain stopped: :data:`PEER_PARAMETERS` lists every point tried).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.errors import InvalidInput
from kvstrata.store.arc import ARCPolicy
from kvstrata.store.gdsf import GDSFPolicy
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.s3fifo import SMALL_FRACTION, S3FIFOPolicy
from kvstrata.store.tinylfu import SAMPLE_FACTOR, TinyLFUPolicy

__all__ = [
    "DEPLOYED_POLICIES",
    "PEER_PARAMETERS",
    "TUNED_PEERS",
    "ARCPolicy",
    "GDSFPolicy",
    "S3FIFOPolicy",
    "TinyLFUPolicy",
    "peer_point",
    "peer_policy",
]

TUNED_SUFFIX = "-tuned"


def _gdsf(demotion_fetch_s_per_byte: float | None, beta: float = 1.0) -> EvictionPolicy:
    return GDSFPolicy(demotion_fetch_s_per_byte=demotion_fetch_s_per_byte, beta=beta)


DEPLOYED_POLICIES: dict[str, Callable[[float | None], EvictionPolicy]] = {
    "s3fifo": lambda _fetch: S3FIFOPolicy(),
    "arc": lambda _fetch: ARCPolicy(),
    "gdsf": _gdsf,
    "tinylfu": lambda _fetch: TinyLFUPolicy(),
}
"""name → factory taking the demotion target's fetch cost (seconds per byte, or None)."""


@dataclass(frozen=True)
class PeerParameter:
    """A deployed policy's main parameter: its paper's default, the points swept, the choice."""

    keyword: str
    default: float
    swept: tuple[float, ...]
    tuned: float
    build: Callable[[float, float | None], EvictionPolicy]


PEER_PARAMETERS: dict[str, PeerParameter] = {
    # S3-FIFO's small-queue share of the objects (paper: 10 %).
    "s3fifo": PeerParameter(
        "small_fraction",
        SMALL_FRACTION,
        (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3),
        0.002,
        lambda value, _fetch: S3FIFOPolicy(small_fraction=value),
    ),
    # TinyLFU's sample size (sketch reset period) in multiples of the cache size (paper: ~10).
    # Re-swept (2026-12-06) once TinyLFU refused newcomers as its paper says: 1 / 1.5 / 2 /
    # 2.5 / 3 / 4 / 5 / 10 / 20 / 40 scored 0.893 / 0.954 / 1.101 / 1.055 / 1.132 / 1.079 /
    # 1.031 / 1 / 0.973 / 0.975 (it had chosen 2 when a refused newcomer was still stored).
    "tinylfu": PeerParameter(
        "sample_factor",
        SAMPLE_FACTOR,
        (1, 1.5, 2, 2.5, 3, 4, 5, 10, 20, 40),
        3,
        lambda value, _fetch: TinyLFUPolicy(sample_factor=value),
    ),
    # GreedyDual*'s β (Jin & Bestavros): priority L + (frequency · cost / size)^(1/β); 1 is GDSF.
    "gdsf": PeerParameter(
        "beta",
        1.0,
        (0.0625, 0.09, 0.125, 0.25, 0.35, 0.5, 1.0, 2.0, 4.0, 8.0),
        0.125,
        lambda value, fetch: _gdsf(fetch, value),
    ),
}

TUNED_PEERS: tuple[str, ...] = tuple(f"{name}{TUNED_SUFFIX}" for name in PEER_PARAMETERS)
"""The benchmark's peers at their tuned points (``s3fifo-tuned``, …)."""


def peer_point(spec: str) -> tuple[str, float | None] | None:
    """The deployed policy ``spec`` names and the value of its main parameter: ``NAME`` (the
    paper's default; ``None`` for ARC, which has no parameter), ``NAME-tuned`` or
    ``NAME:VALUE``. ``None`` when ``spec`` names no deployed policy; ``InvalidInput`` when it
    names one with a value that is not a positive finite number."""
    name, colon, value_text = spec.partition(":")
    if colon:
        if name not in PEER_PARAMETERS:
            return None
        try:
            value = float(value_text)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise InvalidInput(f"{spec!r}: {name}'s {PEER_PARAMETERS[name].keyword} must be > 0")
        return name, value
    if name in TUNED_PEERS:
        base = name.removesuffix(TUNED_SUFFIX)
        return base, PEER_PARAMETERS[base].tuned
    if name in PEER_PARAMETERS:
        return name, PEER_PARAMETERS[name].default
    if name in DEPLOYED_POLICIES:
        return name, None
    return None


def peer_policy(spec: str, demotion_fetch_s_per_byte: float | None = None) -> EvictionPolicy:
    """The deployed policy ``spec`` names (any form :func:`peer_point` takes)."""
    point = peer_point(spec)
    if point is None:
        raise InvalidInput(
            f"unknown deployed policy {spec!r}: expected one of {', '.join(DEPLOYED_POLICIES)}, "
            f"NAME{TUNED_SUFFIX} or NAME:VALUE for {', '.join(PEER_PARAMETERS)}"
        )
    name, value = point
    if value is None or value == PEER_PARAMETERS[name].default:
        return DEPLOYED_POLICIES[name](demotion_fetch_s_per_byte)
    return PEER_PARAMETERS[name].build(value, demotion_fetch_s_per_byte)


def is_peer_spec(spec: str) -> bool:
    """Whether ``spec`` names a deployed policy; one with a bad value does (building it says
    what is wrong)."""
    try:
        return peer_point(spec) is not None
    except InvalidInput:
        return True
