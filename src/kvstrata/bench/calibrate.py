"""``kvstrata bench calibrate``, pure parts: scale a Mooncake slice to the reference engine,
express it in the simulator's units, and compare the two TTFT distributions.

**Scaling** (:func:`scale_trace`, reported as ``scaling`` in the JSON):

* *Tokens.* One trace block id (512 tokens in the trace) becomes ``block_tokens`` live tokens
  (default 16, the reference engine's KV block: prefix sharing is then exactly the trace's, one
  engine block per id). ``input_length`` scales by ``block_tokens / 512`` (rounded, ≥ 1); the
  prompt's token ids are drawn from the id of the block they fall in (:func:`prompt_ids`), so
  two requests share a live prefix exactly as far as they share trace ids. A prompt is cut at
  ``max_prompt_tokens`` (SmolLM2's context is 8,192; default 4,096 keeps one prefill ≲ 10 s).
* *Output.* ``output_length`` scales the same way, clamped to ``[1, max_output_tokens]``.
* *Time.* Arrivals keep the trace's spacing divided by ``rate_scale``, chosen so the slice's
  prefill work — every request's uncached tokens against one shared infinite cache, priced by
  the live-unit prefill model — fills ``workers`` at ``target_utilisation`` over the slice's
  arrival span: ``rate_scale = utilisation · workers · span / work``.

**Simulator units** (:func:`sim_requests`, :func:`sim_profile`): the simulator's blocks are
512 tokens, so one simulated token is ``k = 512 / block_tokens`` of a live token's share of a
block: a request of ``n`` live tokens is ``n · k`` simulated tokens and its hashes are its full
live blocks' ids. The profile is rescaled so every duration is unchanged: ``per_token_s / k``,
``per_token_ctx_s / k²`` (exact for the quadratic prefill model), fetch times per block as for
``block_tokens`` live tokens, KV bytes per token ``/ k``, and the prefill chunk of ``k ×`` the
engine's step budget (``max_num_batched_tokens``, 512 live tokens). Decode steps count output
tokens, which are not rescaled. Capacities: the device pool in live blocks (``pool_gib``), no
host tier on either side.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Final

from kvstrata.costs import PrefillModel
from kvstrata.errors import InvalidInput
from kvstrata.router.costs import CostProfile
from kvstrata.sim.profiles import BLOCK_TOKENS, SimProfile
from kvstrata.sim.trace import SimRequest
from kvstrata.workloads.mooncake import TraceRequest

TRACE_BLOCK_TOKENS: Final = 512
ENGINE_STEP_TOKENS: Final = 512
"""The reference engine's default ``scheduler.max_num_batched_tokens``."""
TOKEN_LO, TOKEN_HI = 1_000, 48_000
"""Prompt token ids are drawn from this range of SmolLM2's 49,152 (no special tokens)."""
GOAL_LO, GOAL_HI = 0.8, 1.25
PERCENTILES: Final = (10, 50, 90, 99)


@dataclass(frozen=True, slots=True)
class Scaling:
    """How a trace slice became a live workload (module docstring)."""

    block_tokens: int = 16
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 8
    target_utilisation: float = 0.5
    workers: int = 2

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or TRACE_BLOCK_TOKENS % self.block_tokens:
            raise InvalidInput(f"block_tokens must divide 512, got {self.block_tokens}")
        if self.max_prompt_tokens < self.block_tokens or self.max_output_tokens < 1:
            raise InvalidInput("max_prompt_tokens must be >= block_tokens, max_output >= 1")
        if not 0 < self.target_utilisation < 1.5 or self.workers < 1:
            raise InvalidInput("target_utilisation must lie in (0, 1.5), workers >= 1")

    @property
    def token_scale(self) -> float:
        return self.block_tokens / TRACE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """One scaled request: what the live replay sends and the simulator replays."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    """Trace ids of every block the prompt touches (the last one may be partial)."""


def _live_blocks(request: TraceRequest, scaling: Scaling) -> tuple[int, int, int]:
    prompt = max(1, round(request.input_length * scaling.token_scale))
    prompt = min(prompt, scaling.max_prompt_tokens, len(request.hash_ids) * scaling.block_tokens)
    output = round(request.output_length * scaling.token_scale)
    output = max(1, min(output, scaling.max_output_tokens))
    blocks = -(-prompt // scaling.block_tokens)
    return prompt, output, blocks


def scale_trace(
    requests: Sequence[TraceRequest], scaling: Scaling, model: PrefillModel
) -> tuple[list[LiveRequest], dict[str, Any]]:
    """Scaled requests (arrivals from 0) and the scaling record (module docstring)."""
    if not requests:
        raise InvalidInput("the trace slice is empty")
    ordered = sorted(requests, key=lambda r: r.timestamp_ms)
    origin = ordered[0].timestamp_ms
    span_s = (ordered[-1].timestamp_ms - origin) / 1000.0
    shaped = []
    seen: set[int] = set()
    work_s = 0.0
    for request in ordered:
        prompt, output, blocks = _live_blocks(request, scaling)
        ids = tuple(int(h) for h in request.hash_ids[:blocks])
        full = prompt // scaling.block_tokens
        matched = 0
        for block in ids[:full]:
            if block not in seen:
                break
            matched += 1
        seen.update(ids[:full])
        cached = min(matched * scaling.block_tokens, prompt - 1)
        work_s += model.seconds(prompt - cached, cached)
        shaped.append((request.timestamp_ms, prompt, output, ids))
    if span_s <= 0:
        raise InvalidInput("the slice's arrivals span no time; pick a later start or more requests")
    rate_scale = scaling.target_utilisation * scaling.workers * span_s / work_s
    out = [
        LiveRequest(
            index=i,
            arrival_s=(stamp - origin) / 1000.0 / rate_scale,
            prompt_tokens=prompt,
            output_tokens=output,
            block_ids=ids,
        )
        for i, (stamp, prompt, output, ids) in enumerate(shaped)
    ]
    record = asdict(scaling) | {
        "trace_block_tokens": TRACE_BLOCK_TOKENS,
        "token_scale": scaling.token_scale,
        "rate_scale": rate_scale,
        "trace_span_s": span_s,
        "live_span_s": span_s / rate_scale,
        "offered_prefill_work_s": work_s,
        "requests": len(out),
        "prompt_tokens_mean": sum(r.prompt_tokens for r in out) / len(out),
        "prompt_tokens_max": max(r.prompt_tokens for r in out),
        "output_tokens_mean": sum(r.output_tokens for r in out) / len(out),
        "work_model": {
            "overhead_s": model.overhead_s,
            "per_token_s": model.per_token_s,
            "per_token_ctx_s": model.per_token_ctx_s,
        },
        "rule": "live tokens = trace tokens x block_tokens/512; arrivals = trace gaps / "
        "rate_scale with rate_scale = target_utilisation x workers x trace_span / prefill "
        "work (uncached tokens vs one shared infinite cache, live-unit prefill model)",
    }
    return out, record


def prompt_ids(request: LiveRequest, block_tokens: int, salt: int = 0) -> list[int]:
    """Token ids of the prompt: block ``i``'s tokens are drawn from its trace id alone."""
    tokens: list[int] = []
    for block in request.block_ids:
        rng = random.Random(block * 1_000_003 + salt)
        tokens.extend(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(block_tokens))
    return tokens[: request.prompt_tokens]


def sim_requests(requests: Sequence[LiveRequest], block_tokens: int) -> list[SimRequest]:
    """The same requests in simulator units (module docstring)."""
    k = BLOCK_TOKENS // block_tokens
    return [
        SimRequest(
            index=r.index,
            arrival_s=r.arrival_s,
            prompt_tokens=r.prompt_tokens * k,
            output_tokens=r.output_tokens,
            hashes=r.block_ids[: r.prompt_tokens // block_tokens],
        )
        for r in requests
    ]


def sim_profile(
    base: SimProfile,
    block_tokens: int,
    device_blocks: int,
    prefill: PrefillModel | None = None,
) -> SimProfile:
    """``base`` (or its prefill replaced by ``prefill``, live units) in simulator units."""
    k = BLOCK_TOKENS // block_tokens
    live = prefill if prefill is not None else base.cost.prefill
    scaled = replace(
        live,
        per_token_s=live.per_token_s / k,
        per_token_ctx_s=live.per_token_ctx_s / (k * k),
        kv_bytes_per_token=max(1, base.kv_bytes_per_token // k),
    )
    f = base.cost.fetch_s_per_block
    cost: CostProfile = replace(
        base.cost,
        prefill=scaled,
        fetch_s_per_block=(f[0] / k, f[1] / k, f[2] / k, f[3] / k),
        prefill_chunk_tokens=ENGINE_STEP_TOKENS * k,
    )
    return replace(
        base,
        name=f"{base.name}/{block_tokens}-token-blocks",
        cost=cost,
        kv_bytes_per_token=max(1, base.kv_bytes_per_token // k),
        device_blocks=device_blocks,
        host_blocks=0,
    )


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """p10/p50/p90/p99 (linear interpolation), mean and count; None when empty."""
    out: dict[str, float | int | None] = {"n": len(values)}
    ordered = sorted(values)
    for p in PERCENTILES:
        out[f"p{p}"] = _quantile(ordered, p / 100.0) if ordered else None
    out["mean"] = sum(ordered) / len(ordered) if ordered else None
    return out


def _quantile(ordered: Sequence[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return float(a) / float(b)


def per_worker(answered: Iterable[tuple[str, int, float]]) -> dict[str, dict[str, Any]]:
    """Per worker: requests, prompt tokens and TTFT p50 / p90 of ``(worker, prompt tokens,
    TTFT)`` rows: how the router split the load, and what each side of the split saw."""
    groups: dict[str, list[tuple[int, float]]] = {}
    for worker, tokens, ttft in answered:
        groups.setdefault(worker, []).append((tokens, ttft))
    out: dict[str, dict[str, Any]] = {}
    for worker in sorted(groups):
        rows = groups[worker]
        stats = percentiles([ttft for _, ttft in rows])
        out[worker] = {
            "requests": len(rows),
            "prompt_tokens": sum(tokens for tokens, _ in rows),
            "ttft_p50_s": stats["p50"],
            "ttft_p90_s": stats["p90"],
        }
    return out


def predictions(pairs: Iterable[tuple[float, float]]) -> dict[str, Any]:
    """How well the router predicted the TTFTs of ``(predicted, measured)`` pairs: the
    measured ÷ predicted ratio's p10 / p50 / p90 and the share within a factor of 2."""
    ratios = sorted(measured / predicted for predicted, measured in pairs if predicted > 0)
    stats = percentiles(ratios)
    within = sum(1 for r in ratios if 0.5 <= r <= 2.0)
    return {
        "n": len(ratios),
        "actual_over_predicted": {f"p{p}": stats[f"p{p}"] for p in (10, 50, 90)},
        "within_2x": within / len(ratios) if ratios else None,
    }


ORDER_TOLERANCE_S: Final = 0.05
"""First tokens closer than this count as one step's (a packed step ends for all at once)."""


def placement_order(rows: Iterable[tuple[str, float, float]]) -> dict[str, int]:
    """Of ``(worker, placed_at, first_token_at)`` rows (wall clock), the pairs on one worker
    whose first tokens came in the opposite order to their placements (by more than
    :data:`ORDER_TOLERANCE_S`), out of all pairs on one worker. The engine serves its queue
    in order and a later prompt's chunks go after an earlier one's, so an inversion means the
    later request was admitted first (requests proxied together race to the worker), or a
    preemption or an in-flight deferral reordered them."""
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for worker, placed, first in rows:
        by_worker.setdefault(worker, []).append((placed, first))
    pairs = inverted = 0
    for items in by_worker.values():
        items.sort()
        for i, (_, first_i) in enumerate(items):
            for _, first_j in items[i + 1 :]:
                pairs += 1
                inverted += first_i > first_j + ORDER_TOLERANCE_S
    return {"pairs": pairs, "inverted": inverted}


def compare(live: Sequence[float], sims: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Both distributions and sim ÷ live at p50 and p90 for every simulated profile."""
    live_stats = percentiles(live)
    out: dict[str, Any] = {"live": {"ttft_s": live_stats}, "sim": {}}
    for name, values in sims.items():
        stats = percentiles(values)
        p50 = _ratio(stats["p50"], live_stats["p50"])
        p90 = _ratio(stats["p90"], live_stats["p90"])
        met = all(r is not None and GOAL_LO <= r <= GOAL_HI for r in (p50, p90))
        out["sim"][name] = {
            "ttft_s": stats,
            "ratio_p50": p50,
            "ratio_p90": p90,
            "goal_met": met,
        }
    return out
