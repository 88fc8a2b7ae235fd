"""A trace as the simulator replays it: arrivals, full-block ids, and the hit-rate bound.

Conventions (the same ones the router's TTFT estimator uses, so numbers compare):

* Only *full* 512-token blocks are cacheable: a Mooncake id names a whole prefix, and a
  partial last block is extended (and renamed) by the next turn, so an engine never reuses
  it. A request with ``input_length`` tokens has ``input_length // 512`` cacheable blocks.
* Hit tokens of a request = ``min(matched_blocks · 512, input_length − 1)``: the last prompt
  token is always computed (it produces the first output token's logits), as in the engine.
* ``infinite_cache_hit_rate``: the same count against one infinite cache shared by every
  worker, in arrival order — the trace's bound for any placement and any cache size. It is a
  little below ``kvstrata bench reuse``'s "infinite" rate, which also counts partial last
  blocks.
* ``ttft_p99_floor``: the p99 of every request's prefill alone with that infinite cache's
  hit — what no placement can beat.
* The trace's ids are used directly as router hashes (index block size 512): the index
  never hashes tokens in the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstrata.costs import PrefillModel
from kvstrata.errors import InvalidInput
from kvstrata.sim.profiles import BLOCK_TOKENS
from kvstrata.workloads.mooncake import TraceRequest


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request as the simulator sees it (times already shifted and rate-scaled)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hashes: tuple[int, ...]
    """Ids of the full blocks only (see the module docstring)."""

    @property
    def kv_blocks(self) -> int:
        """Device blocks the request occupies while it runs: prompt + output, rounded up."""
        return -(-(self.prompt_tokens + self.output_tokens) // BLOCK_TOKENS)

    def hit_tokens(self, matched_blocks: int) -> int:
        return max(0, min(matched_blocks * BLOCK_TOKENS, self.prompt_tokens - 1))


def select_window(
    requests: Sequence[TraceRequest], start_s: float | None, end_s: float | None
) -> list[TraceRequest]:
    """Requests whose trace timestamp lies in ``[start_s, end_s)`` (None = open end)."""
    lo = float("-inf") if start_s is None else start_s * 1000.0
    hi = float("inf") if end_s is None else end_s * 1000.0
    return [r for r in requests if lo <= r.timestamp_ms < hi]


def parse_window(text: str) -> tuple[float | None, float | None]:
    """``"START:END"`` seconds, either side may be empty (``"1800:"``)."""
    start, sep, end = text.partition(":")
    if not sep:
        raise InvalidInput(f"time window must be START:END seconds, got {text!r}")
    try:
        lo = float(start) if start.strip() else None
        hi = float(end) if end.strip() else None
    except ValueError as exc:
        raise InvalidInput(f"bad time window {text!r}") from exc
    if any(bound is not None and not math.isfinite(bound) for bound in (lo, hi)):
        raise InvalidInput(f"time window bounds must be finite (or empty): {text!r}")
    if lo is not None and hi is not None and hi <= lo:
        raise InvalidInput(f"time window end must exceed its start: {text!r}")
    return lo, hi


def prepare(requests: Sequence[TraceRequest], rate_scale: float) -> list[SimRequest]:
    """Shift arrivals to start at 0 and divide them by ``rate_scale`` (×2 = twice the rate)."""
    if not math.isfinite(rate_scale) or rate_scale <= 0:
        raise InvalidInput(f"rate scale must be a finite number > 0, got {rate_scale}")
    if not requests:
        return []
    ordered = sorted(range(len(requests)), key=lambda i: (requests[i].timestamp_ms, i))
    origin = requests[ordered[0]].timestamp_ms
    out: list[SimRequest] = []
    for position, i in enumerate(ordered):
        request = requests[i]
        full = request.input_length // BLOCK_TOKENS
        out.append(
            SimRequest(
                index=position,
                arrival_s=(request.timestamp_ms - origin) / 1000.0 / rate_scale,
                prompt_tokens=max(request.input_length, 1),
                output_tokens=request.output_length,
                hashes=tuple(int(h) for h in request.hash_ids[:full]),
            )
        )
    return out


def infinite_cache_matches(requests: Sequence[SimRequest]) -> list[int]:
    """Per request, in arrival order, its blocks found in one infinite cache shared by every
    worker (module docstring)."""
    seen: set[int] = set()
    out: list[int] = []
    for request in requests:
        matched = 0
        for block in request.hashes:
            if block not in seen:
                break
            matched += 1
        out.append(matched)
        seen.update(request.hashes)
    return out


def infinite_cache_hit_rate(requests: Sequence[SimRequest]) -> float:
    """Hit rate of one infinite cache shared by all workers (module docstring)."""
    matched = infinite_cache_matches(requests)
    hit = sum(r.hit_tokens(m) for r, m in zip(requests, matched, strict=True))
    total = sum(request.prompt_tokens for request in requests)
    return hit / total if total else 0.0


def ttft_p99_floor(requests: Sequence[SimRequest], prefill: PrefillModel) -> float:
    """The 99th percentile of each request's prefill alone, with the infinite cache's hit,
    no queue, no fetch and no decode interference: no placement can do better.

    Why: at light load the best baseline's p99 is already close to it (on the Mooncake
    conversation trace the p99 is long cold prompts), which bounds what any router can
    gain there. A floor of the model's times, not of a run: per-job service noise (median 1)
    can take a run's p99 a little below it.
    """
    if not requests:
        return 0.0
    matched = infinite_cache_matches(requests)
    seconds = []
    for request, blocks in zip(requests, matched, strict=True):
        cached = request.hit_tokens(blocks)
        seconds.append(prefill.seconds(request.prompt_tokens - cached, cached))
    return float(np.percentile(np.asarray(seconds, dtype=np.float64), 99.0))
